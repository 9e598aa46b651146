"""The drafter training pipeline: prompts -> the target's responses (cached) -> training
(kdj/train/trainer.py, resumable) -> export, with periodic held-out acceptance."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from kdj.train.config import TrainConfig
from kdj.train.data import settings_diff
from kdj.train.trainer import DrafterTrainer, check_drafter, check_finite, drafter_config_for


def held_out_tau(
    target, drafter, prompts, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
    deterministic: bool = False,
) -> dict:  # fmt: skip
    """DFlash on held-out prompts: mean acceptance (tokens per step, bonus included)."""
    import kdj

    out = kdj.generate(
        target,
        prompts,
        drafter=drafter,
        method="dflash",
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        deterministic=deterministic,
    )
    s = out.stats
    return {
        "tau": s["mean_acceptance"],
        "tokens_per_s": s["tokens_per_s"],
        "new_tokens": s["new_tokens"],
    }


# ---------------------------------------------------------------------- the whole pipeline
def prompt_settings(cfg: TrainConfig) -> dict:
    """The data settings that decide the tokenised training prompts (recorded in prompts.npz)."""
    d = cfg.data
    return {
        "turns": d.turns,
        "max_prompt_tokens": int(d.max_prompt_tokens),
        "num_conversations": int(d.num_conversations),
    }


def _check_prompt_settings(npz: Path, cached: dict | None, asked: dict) -> None:
    """ValueError unless the prompts in `npz` (settings `cached`; None: a file from before
    settings were recorded, which was made with turns "first") suit the config's `asked`."""
    if cached is None:
        if asked["turns"] == "first":
            return  # as before: such a file is trusted for the first-turn prompts
        diff = [
            f"turns: 'first' (a file without recorded settings) cached, {asked['turns']!r} asked"
        ]
    else:
        diff = settings_diff(cached, asked)
    if diff:
        raise ValueError(
            f"the training prompts {npz} were made with other data settings ({'; '.join(diff)}): "
            "delete prompts.npz to tokenise them again, or use another data.cache_dir (or "
            "--prompts folder) made with these settings"
        )


def check_room(prompts: list[list[int]], cfg: TrainConfig) -> None:
    """Training sequences are cut to optim.max_len tokens, prompt first: some prompt must
    leave room for its response, else no token would train (refused before the target
    answers them)."""
    shortest = min(map(len, prompts), default=0)
    if prompts and shortest >= cfg.optim.max_len:
        raise ValueError(f"optim.max_len {cfg.optim.max_len} leaves no response token to "
                         f"train on: the shortest training prompt is {shortest} tokens (at "
                         f"most data.max_prompt_tokens {cfg.data.max_prompt_tokens}); raise "
                         "optim.max_len above the prompts' length")  # fmt: skip


def prepare_prompts(cfg: TrainConfig, tokenizer) -> tuple[list[list[int]], list[int], dict]:
    """Tokenised training prompts and held-out evaluation texts, cached in the data folder
    (prompts.npz, eval_prompts.json) so later runs need neither the dataset packages nor the
    tokenising time. prompts.npz records the data settings it was made with (prompt_settings:
    turns, max_prompt_tokens, num_conversations); a cached file made with other settings is a
    ValueError. data.turns "all" makes one prompt per user turn, with history (see
    kdj.train.data.chat_history_prompt_ids); conv_ids then repeat, one per turn."""
    from kdj.train.data import (
        chat_history_prompt_ids,
        chat_prompt_ids,
        humaneval_prompts,
        sharegpt_split,
        sharegpt_train_turns,
    )

    d = cfg.cache_dir
    d.mkdir(parents=True, exist_ok=True)
    npz, evj = d / "prompts.npz", d / "eval_prompts.json"
    settings = prompt_settings(cfg)
    if npz.exists() and evj.exists():
        with np.load(npz) as z:
            tokens, off, conv = z["tokens"], z["offsets"], z["conv_ids"]
            cached = json.loads(str(z["settings"])) if "settings" in z.files else None
        _check_prompt_settings(npz, cached, settings)
        prompts = [tokens[off[i] : off[i + 1]].tolist() for i in range(len(conv))]
        return prompts, conv.tolist(), json.loads(evj.read_text())
    train, held = sharegpt_split(cfg.data.sharegpt)
    mp = cfg.data.max_prompt_tokens
    if cfg.data.turns == "all":
        turns = sharegpt_train_turns(cfg.data.sharegpt, cfg.data.num_conversations)
        ids = [
            chat_history_prompt_ids(tokenizer, h, m, mp)
            for _, h, m in tqdm(turns, desc="tokenising turns")
        ]
        conv_all = [i for i, _, _ in turns]
    else:
        train = [(i, m) for i, m in train if i < cfg.data.num_conversations]
        ids = [chat_prompt_ids(tokenizer, m, mp) for _, m in tqdm(train, desc="tokenising")]
        conv_all = [i for i, _ in train]
    prompts = [p for p in ids if p is not None]
    conv = [i for i, p in zip(conv_all, ids) if p is not None]
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    np.savez_compressed(
        npz,
        tokens=np.concatenate([np.asarray(p, np.int32) for p in prompts]),
        offsets=offsets,
        conv_ids=np.asarray(conv, np.int64),
        settings=np.asarray(json.dumps(settings)),
    )
    evals = {
        "sharegpt": [m for _, m in held[:256]],
        "sharegpt_conv_ids": [i for i, _ in held[:256]],
    }
    try:
        evals["humaneval"] = humaneval_prompts()
    except (ModuleNotFoundError, FileNotFoundError):
        evals["humaneval"] = []
    evj.write_text(json.dumps(evals))
    return prompts, conv, evals


def chat_prompts(tokenizer, messages, max_tokens: int) -> list[list[int]]:
    from kdj.train.data import chat_prompt_ids

    ids = (chat_prompt_ids(tokenizer, m, max_tokens) for m in messages)
    return [p for p in ids if p is not None]


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Data (prompts -> target responses, cached) -> training (resumable) -> export.
    Returns a summary dict (also written to <out_dir>/summary.json).

    With drafter.init_from, training starts from that drafter's weights, which are first
    evaluated on the same held-out prompts as the final drafter (summary "init_eval" next to
    "final_eval"); a checkpoint in <out_dir>/checkpoints still takes precedence."""
    import kdj
    from kdj.train.data import load_cache, regenerate

    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    target = kdj.load_target(cfg.target, dtype=cfg.target_dtype, mesh=cfg.mesh)
    tok = target.tokenizer
    prompts, conv, evals = prepare_prompts(cfg, tok)
    check_room(prompts, cfg)
    # a drafter that cannot train fails now, not after the target has answered every prompt
    dcfg = drafter_config_for(target.cfg, cfg.drafter)
    init_from = cfg.drafter.init_from
    check_drafter(target, dcfg, cfg.optim, init_from, cfg.drafter.grow, cfg.drafter.retap)
    t0 = time.perf_counter()
    regenerate(
        target,
        prompts,
        conv,
        cfg.cache_dir,
        max_new_tokens=cfg.data.max_response_tokens,
        temperature=cfg.data.temperature,
        batch_size=cfg.data.gen_batch_size,
        seed=cfg.optim.seed,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        samples_per_prompt=cfg.data.samples_per_prompt,
        turns=cfg.data.turns,
    )
    gen_s = time.perf_counter() - t0
    tokens, mask, _ = load_cache(cfg.cache_dir, cfg.optim.max_len)
    log(
        f"data: {len(tokens)} sequences ({len(prompts)} prompts, turns {cfg.data.turns}, "
        f"{cfg.data.samples_per_prompt} per prompt), {int(mask.sum())} response tokens, "
        f"regeneration {gen_s:.0f} s"
    )

    if not mask.any():
        raise ValueError(f"no response tokens to train on in {cfg.cache_dir}: every response "
                         f"is empty or cut off by optim.max_len {cfg.optim.max_len}")  # fmt: skip
    trainer = DrafterTrainer(target, dcfg, cfg.optim, tokens, mask, out, init_from=init_from,
                             grow=cfg.drafter.grow, retap=cfg.drafter.retap)  # fmt: skip
    eval_prompts = chat_prompts(
        tok, evals["sharegpt"][: cfg.eval.num_prompts], cfg.data.max_prompt_tokens
    )

    def evaluate():
        e = cfg.eval
        r = held_out_tau(target, trainer.drafter(), eval_prompts, e.max_new_tokens, e.temperature,
                         deterministic=e.deterministic)  # fmt: skip
        return dict(r, step=trainer.step)

    log_path = out / "train_log.jsonl"
    init_eval = None
    if init_from is not None:
        # The starting drafter on the same held-out prompts (before any resume): the baseline
        # the continued drafter is judged against, and the eval program compiled once.
        init_eval = dict(evaluate(), init_from=init_from)
        with log_path.open("a") as logf:
            logf.write(json.dumps({"eval": init_eval}) + "\n")
        log(f"initialised from {init_from}: held-out tau {init_eval['tau']:.2f}")
    if trainer.restore():
        log(f"resumed from step {trainer.step}")

    history, evals_done = [], []
    t_train = time.perf_counter()
    o = cfg.optim
    bar = tqdm(total=o.steps, initial=trainer.step, desc="training drafter", unit="step")
    window = []

    def over_budget() -> bool:  # max_minutes counts from the start of run_training
        return o.max_minutes is not None and (time.perf_counter() - t_start) / 60 > o.max_minutes

    with log_path.open("a") as logf:
        while trainer.step < o.steps:
            if over_budget():  # checked before a step: regeneration may have used it all
                log(f"time budget of {o.max_minutes} min reached at step {trainer.step}")
                break
            m = trainer.train_step()
            window.append(m)
            bar.update(1)
            last = trainer.step == o.steps or over_budget()  # log the final partial window
            if trainer.step % o.log_every == 0 or last:
                check_finite(window, trainer.step, o)
                avg = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
                avg.update(step=trainer.step, elapsed_s=time.perf_counter() - t_train)
                window = []
                history.append(avg)
                logf.write(json.dumps(avg) + "\n")
                logf.flush()
                bar.set_postfix(loss=f"{avg['loss']:.3f}", tau=f"{avg['tau']:.2f}")
            if cfg.eval.every and trainer.step % cfg.eval.every == 0 and trainer.step < o.steps:
                e = evaluate()
                evals_done.append(e)
                logf.write(json.dumps({"eval": e}) + "\n")
                log(f"step {trainer.step}: held-out tau {e['tau']:.2f}")
            if o.ckpt_every and trainer.step % o.ckpt_every == 0:
                check_finite(window, trainer.step, o)  # the steps since the last log
                trainer.save()
    bar.close()
    train_s = time.perf_counter() - t_train
    check_finite(window, trainer.step, o)
    trainer.save()
    path = trainer.export(out / "drafter")
    final = evaluate()
    summary = {
        "sequences": len(tokens),
        "prompts": len(prompts),
        "response_tokens": int(mask.sum()),
        "steps": trainer.step,
        "regeneration_s": gen_s,
        "train_s": train_s,
        "final_eval": final,
        "init_from": init_from,
        "init_eval": init_eval,
        "evals": evals_done,
        "first_log": history[0] if history else None,
        "last_log": history[-1] if history else None,
        "drafter": str(path),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    base = f" (init_from {init_eval['tau']:.2f})" if init_eval is not None else ""
    log(
        f"done: {trainer.step} steps in {train_s:.0f} s; held-out tau {final['tau']:.2f}{base}; "
        f"drafter at {path}"
    )
    return summary
