"""Online distillation: generate fresh target responses, train the drafter on them (once, or
optim.passes times), repeat until the time budget is spent.

The GPU comes in short windows and regenerated data cannot be kept between them, so data is
bounded by GPU time, not by storage: each round answers `sequences_per_round` new prompts
with the target, trains one pass over exactly those sequences, and throws them away. Only the
drafter (exported in the published DFlash format) and a campaign record persist.

Prompts come from two offline sources, neither touching held-out data:
  - ShareGPT: every user turn of the first 16,000 conversations (the split rule), with its
    history, walked as an endless stream. Pass p over the turns samples its responses at
    `sharegpt_temperatures[p % len]` with its own seed, so each pass gives new responses.
  - Magpie: the target writes the user turn itself (its chat template up to the user's
    message, then sampled until the end of the turn); degenerate turns are dropped; the
    target then answers it (greedy by default: the held-out evaluation is greedy).

Where a window starts is a function of the campaign so far: `OnlineState` (stream position,
rounds, tokens) is saved beside every checkpoint and in <out_dir>/campaign.json, and a new
window (a later GPU session) passes the last window's state in `online.resume_from` (or
starts from `online.stream_start`), so no (prompt, seed) pair is ever drawn twice.

One schedule across windows: every round also writes <out_dir>/resume/ (kdj/train/resume.py),
a bundle of every drafter's float32 weights, optimiser state and step with the stream
position, in parts small enough to come back from the GPU machine. A new window that passes
it in `online.resume_state` continues exactly there: the same schedule, not a new warmup.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdj.train.config import OnlineConfig
from kdj.train.data import chat_prompt_ids, respond
from kdj.train.loop import chat_prompts, check_room, held_out_tau, prepare_prompts
from kdj.train.resume import read_bundle, restore_trainers, write_bundle
from kdj.train.trainer import DrafterTrainer, check_finite, drafter_config_for

MAGPIE_MARK = "\x00kdj-user-turn\x00"  # split point of a rendered template


@dataclass
class OnlineState:
    """Where the campaign is: what has been drawn and trained on so far."""

    stream_pos: int = 0  # next ShareGPT stream position (pass * turns + index in the pass)
    magpie_rounds: int = 0  # rounds of self-written prompts drawn (their seed)
    rounds: int = 0
    sequences: int = 0
    response_tokens: int = 0
    sharegpt_sequences: int = 0
    magpie_sequences: int = 0
    magpie_rejected: int = 0

    @staticmethod
    def load(path) -> OnlineState:
        d = json.loads(Path(path).read_text())
        return OnlineState(**d.get("state", d))

    def new_window(self) -> OnlineState:
        """The stream position carried on; the per-window counts start at zero."""
        return OnlineState(stream_pos=self.stream_pos, magpie_rounds=self.magpie_rounds)


def sharegpt_stream(n_turns: int, seed: int, start: int, count: int):
    """(turn index, pass) of stream positions start..start+count-1: pass p walks the turns in
    its own seeded order, so consecutive passes revisit every turn in a new order."""
    out = []
    pos = start
    while len(out) < count:
        p, i = divmod(pos, n_turns)
        take = min(count - len(out), n_turns - i)
        perm = np.random.default_rng([seed, 7_777, p]).permutation(n_turns)
        out.extend((int(t), p) for t in perm[i : i + take])
        pos += take
    return out


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's message begins."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MAGPIE_MARK}])
    return tokenizer.encode(text[: text.index(MAGPIE_MARK)])


def acceptable_turn(text: str) -> bool:
    """A self-written user turn worth answering: some words, mostly not one repeated."""
    words = text.split()
    if len(text.strip()) < 12 or len(words) < 3:
        return False
    return len(set(words)) >= 0.4 * len(words)


def magpie_prompts(target, n, cfg, online: OnlineConfig, seed: int, capacity: int):
    """About n prompts the target writes itself. Returns (prompt ids, rejected count)."""
    tok = target.tokenizer
    prefix = user_turn_prefix(tok)
    stops = set(tok.stop_ids)
    prompts, rejected = [], 0
    turns = respond(target, [prefix] * n, cfg.data.gen_batch_size, online.magpie_max_tokens,
                    online.magpie_temperature, seed * 1_000, capacity).tokens  # fmt: skip
    for ids in turns:
        ended = bool(ids) and ids[-1] in stops
        text = tok.decode([t for t in ids if t not in stops]).strip()
        p = chat_prompt_ids(tok, text, cfg.data.max_prompt_tokens) if ended else None
        if p is None or not acceptable_turn(text):
            rejected += 1
        else:
            prompts.append(p)
    return prompts, rejected


def answer(target, prompts, temperature, seed, cfg, capacity):
    """The target's responses to prompts, streamed through a pool of gen_batch_size slots."""
    return respond(target, prompts, cfg.data.gen_batch_size, cfg.data.max_response_tokens,
                   temperature, seed, capacity).tokens  # fmt: skip


def pack(prompts, responses, max_len: int):
    """Rows [N, max_len] of prompt + response and the loss mask (True on response tokens)."""
    tokens = np.zeros((len(prompts), max_len), np.int32)
    mask = np.zeros((len(prompts), max_len), bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = (p + r)[:max_len]
        tokens[i, : len(seq)] = seq
        mask[i, len(p) : len(seq)] = True
    return tokens, mask


def draw_round(target, turns, cfg, online: OnlineConfig, state: OnlineState, capacity: int):
    """One round of fresh data: (tokens, mask, record). `turns` are the ShareGPT training
    prompts (token ids) the stream indexes."""
    seed = cfg.optim.seed
    n = online.sequences_per_round
    t0 = time.perf_counter()
    n_magpie = round(n * online.magpie_fraction)
    m_prompts, rejected = [], 0
    if n_magpie:
        m_prompts, rejected = magpie_prompts(
            target, n_magpie, cfg, online, seed + 1_000 * (state.magpie_rounds + 1), capacity
        )
    t_magpie = time.perf_counter() - t0
    n_share = n - len(m_prompts)
    drawn = sharegpt_stream(len(turns), seed, state.stream_pos, n_share)
    temps = online.sharegpt_temperatures
    prompts, responses = [], []
    for p in sorted({p for _, p in drawn}):  # one generation per pass: its own temperature
        idx = [t for t, q in drawn if q == p]
        batch = [turns[t] for t in idx]
        pass_seed = seed + 10_000 * (p + 1) + state.stream_pos  # distinct per (pass, round)
        prompts += batch
        responses += answer(target, batch, temps[p % len(temps)], pass_seed, cfg, capacity)
    if m_prompts:
        prompts += m_prompts
        responses += answer(
            target, m_prompts, online.magpie_response_temperature,
            seed + 5_000_000 + state.magpie_rounds * 1_000, cfg, capacity,
        )  # fmt: skip
    gen_s = time.perf_counter() - t0
    tokens, mask = pack(prompts, responses, cfg.optim.max_len)
    n_resp = int(sum(len(r) for r in responses))
    record = {
        "stream": [state.stream_pos, state.stream_pos + n_share],
        "sharegpt": n_share,
        "magpie": len(m_prompts),
        "magpie_rejected": rejected,
        "response_tokens": n_resp,
        "trained_tokens": int(mask.sum()),
        "generation_s": gen_s,
        "magpie_prompt_s": t_magpie,
        "response_tokens_per_s": n_resp / max(gen_s - t_magpie, 1e-9),
    }
    state.stream_pos += n_share
    state.magpie_rounds += 1 if n_magpie else 0
    state.sequences += len(prompts)
    state.sharegpt_sequences += n_share
    state.magpie_sequences += len(m_prompts)
    state.magpie_rejected += rejected
    state.response_tokens += n_resp
    return tokens, mask, record


def _taus(e: dict) -> str:
    return ", ".join(f"{k} {v['tau']:.3f}" for k, v in e["drafters"].items())


def run_online(cfg, log=print) -> dict:
    """The online campaign window: rounds of (fresh data -> one training pass) until
    optim.max_minutes, then checkpoint, export and a held-out evaluation. Returns a summary
    (also <out_dir>/summary.json); the campaign record is <out_dir>/campaign.json."""
    import kdj

    t_start = time.perf_counter()
    online = cfg.online
    out = Path(cfg.out_dir)
    state_path = out / "online_state.json"
    bundle = None
    if online.resume_state and not state_path.exists():  # verified before the target loads
        bundle = read_bundle(online.resume_state)
        if bundle.online_state is None:
            raise ValueError(f"resume bundle {bundle.path} holds no online stream position")
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    target = kdj.load_target(cfg.target, dtype=cfg.target_dtype, mesh=cfg.mesh)
    turns, _, evals = prepare_prompts(cfg, target.tokenizer)
    check_room(turns, cfg)
    capacity = -(-(cfg.data.max_prompt_tokens + cfg.data.max_response_tokens) // 128) * 128

    if state_path.exists():  # a later call of the same window: resume with the checkpoint
        state = OnlineState.load(state_path)
    elif bundle is not None:
        state = OnlineState(**bundle.online_state).new_window()
    elif online.resume_from:
        state = OnlineState.load(online.resume_from).new_window()
    else:
        state = OnlineState(stream_pos=online.stream_start)
    call_start = dataclasses.asdict(state)
    # a later call of the window keeps the window's start, first evaluation and evaluations
    record = out / "campaign.json"
    earlier = json.loads(record.read_text()) if state_path.exists() and record.exists() else {}

    empty = np.zeros((1, cfg.optim.max_len), np.int32)
    o = cfg.optim

    def make_trainer(shape, folder, optim):
        init_from = None if bundle is not None else shape.init_from  # the bundle's weights win
        return DrafterTrainer(
            target, drafter_config_for(target.cfg, shape), optim, empty, empty.astype(bool),
            folder, init_from=init_from, grow=shape.grow, retap=shape.retap,
        )  # fmt: skip

    # "main" is the campaign's drafter; the others train on the same rounds for comparison
    trainers = {"main": make_trainer(cfg.drafter, out, cfg.optim)}
    for name, entry in online.compare.items():
        optim = dataclasses.replace(cfg.optim, **entry.optim)
        trainers[name] = make_trainer(entry.drafter, out / name, optim)
    trainer = trainers["main"]
    eval_prompts = chat_prompts(
        target.tokenizer, evals["sharegpt"][: cfg.eval.num_prompts], cfg.data.max_prompt_tokens
    )

    def evaluate():
        results = {}
        e = cfg.eval
        for name, tr in trainers.items():
            r = held_out_tau(target, tr.drafter(), eval_prompts, e.max_new_tokens, e.temperature,
                             deterministic=e.deterministic)  # fmt: skip
            results[name] = dict(r, step=tr.step)
        return dict(results["main"], sequences=state.sequences, drafters=results)

    log_path = out / "train_log.jsonl"
    logf = log_path.open("a")

    def write(rec):
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    resumed = [tr.restore() for tr in trainers.values()][0]
    if bundle is not None and not resumed:
        dropped = restore_trainers(bundle, trainers, cfg.target)
        log(f"resumed {bundle.path}: step {trainer.step} of {o.steps}, next lr "
            f"{trainer.learning_rate():.3g}, stream position {state.stream_pos}"
            + (f"; not resumed (no longer configured): {dropped}" if dropped else ""))  # fmt: skip
    bundle_path = out / "resume"
    part_bytes = max(1, int(online.resume_part_mib * 2**20))

    def checkpoint():
        """Orbax checkpoints for later calls of this window, the bundle for the next window."""
        for tr in trainers.values():
            tr.save()
        state_path.write_text(json.dumps(dataclasses.asdict(state)))
        write_bundle(bundle_path, trainers, cfg.target, dataclasses.asdict(state), part_bytes,
                     replace=True)  # fmt: skip

    first_round = state.rounds + 1
    first_eval = None
    if not resumed:
        first_eval = evaluate()
        write({"eval": first_eval})
        log(f"start: held-out tau {_taus(first_eval)}")

    def minutes() -> float:
        return (time.perf_counter() - t_start) / 60

    budget = cfg.optim.max_minutes
    # A round starts only if it can end within the budget, judged by the fastest round so far
    # (the first round also compiles every program: half of it is the estimate after it).
    round_s = 0.0
    evals_done = []
    while budget is None or minutes() + round_s / 60 < budget:
        if trainer.step >= o.steps:
            break
        t0 = time.perf_counter()
        tokens, mask, rec = draw_round(target, turns, cfg, online, state, capacity)
        t1, before = time.perf_counter(), trainer.step
        for name, tr in trainers.items():
            tr.set_data(tokens, mask)
            per_pass = len(tokens) // tr.optim.batch_size  # optim.passes over the round
            steps = max(0, min(tr.optim.passes * per_pass, tr.optim.steps - tr.step))
            window = [tr.train_step() for _ in range(steps)]
            if not window:  # a compared drafter whose schedule has ended
                continue
            check_finite(window, tr.step, tr.optim, "" if name == "main" else name)
            m = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
            if name == "main":
                metrics = m
            else:
                rec[name] = m
        train_s = time.perf_counter() - t1
        state.rounds += 1
        steps = trainer.step - before
        rec.update(metrics, round=state.rounds, step=trainer.step, train_s=train_s,
                   train_seq_per_s=steps * o.batch_size / train_s, minutes=minutes())  # fmt: skip
        write(rec)
        log(
            f"round {state.rounds}: {rec['sharegpt']} sharegpt + {rec['magpie']} magpie "
            f"({rec['magpie_rejected']} rejected), {rec['response_tokens']:,} response tokens "
            f"in {rec['generation_s']:.0f} s ({rec['response_tokens_per_s']:,.0f} tok/s); "
            f"{steps} steps in {train_s:.0f} s; loss {metrics['loss']:.3f} "
            f"train tau {metrics['tau']:.2f}"
        )
        checkpoint()
        if online.eval_every_rounds and state.rounds % online.eval_every_rounds == 0:
            e = evaluate()
            evals_done.append(e)
            write({"eval": e})
            log(f"round {state.rounds}: held-out tau {_taus(e)}")
        took = time.perf_counter() - t0
        round_s = took / 2 if state.rounds == first_round else min(round_s, took)
    logf.close()
    checkpoint()
    for name, tr in trainers.items():
        tr.export((out if name == "main" else out / name) / "drafter")
    path = out / "drafter"
    final = evaluate()
    with log_path.open("a") as f:
        f.write(json.dumps({"eval": final}) + "\n")
    campaign = {
        "window_start": earlier.get("window_start", call_start),
        "call_start": call_start,
        "state": dataclasses.asdict(state),
        "steps": trainer.step,
        "first_eval": earlier.get("first_eval", first_eval),
        "final_eval": final,
        "evals": earlier.get("evals", []) + evals_done,
        "resumed_state": earlier.get("resumed_state", str(bundle.path) if bundle else None),
        "resume_bundle": str(bundle_path / "resume.json"),
        "online": dataclasses.asdict(online),
    }
    record.write_text(json.dumps(campaign, indent=2))
    (out / "summary.json").write_text(json.dumps(campaign, indent=2))
    log(f"done: {trainer.step} steps, {state.sequences:,} sequences this window; "
        f"held-out tau {_taus(final)}; drafter at {path}")  # fmt: skip
    return campaign
