"""kdj's public calls on a loaded target: `generate` and `forward` (loading: kdj/loading.py).

generate = check the arguments, pack the prompts, plan the run (which steps the loop
composes: kdj/decode/state.py `Plan`), prefill + run the on-device loop (kdj/decode/loop.py),
assemble tokens, texts and stats.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdj import arguments
from kdj.cache import init_cache
from kdj.decode import auto, loop, picks, tune
from kdj.decode import logprobs as lps
from kdj.decode.logprobs import TokenLogprob
from kdj.decode.sampling import request_keys, spread_seeds
from kdj.decode.state import Plan, Prefilled
from kdj.decode.stream import bulk_wake, generate_stream
from kdj.decode.tree import DraftShape
from kdj.decode.widths import ladder as widths_ladder
from kdj.handles import Drafter, Target, check_pair
from kdj.models.transformer import full_sequence
from kdj.report import decode_stats, speculative_stats
from kdj.sharding.apply import as_sharding, shard_cache
from kdj.tokenizer import Tokenizer

METHODS = arguments.METHODS
DEFAULT_TREE_BUDGET = 64  # DDTree nodes per step when the caller gives none


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated tokens only, cut after the first stop token
    texts: list[str] | None
    stats: dict[str, Any]
    # why each sequence ended (FINISH_REASONS): "stop" (it emitted one of its stop tokens),
    # "length" (it used its max_new_tokens), "cache" (its KV cache filled first)
    finish_reasons: list[str]
    # with logprobs=k: per prompt, one per token of `tokens`: its log-probability under the
    # target (log-softmax of the raw logits, whatever the sampling) and its k alternatives'
    logprobs: list[list[TokenLogprob]] | None = None


FINISH_REASONS = ("stop", "length", "cache")


class Batch(NamedTuple):
    """Prompts packed for the device: B real rows, then `pad` one-token dummies."""

    tokens: np.ndarray  # [B + pad, P] int32, right-padded
    lens: list[int]
    max_new: list[int]
    stop: np.ndarray  # [B + pad, K] int32, -1 = unused
    capacity: int  # KV-cache slots per sequence
    B: int


def generate(
    target: Target,
    prompts,
    drafter: Drafter | None = None,
    method: str = "auto",
    max_new_tokens=256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed=0,
    block_size=None,
    tree_budget=None,
    stop_tokens=None,
    tokenizer: Tokenizer | None = None,
    mesh=None,
    cache_size: int | None = None,
    menu=None,
    cost=None,
    calibration: float | None = None,
    max_batch: int | None = None,
    deterministic: bool = False,
    logprobs: int | None = None,
) -> GenerateOutput:
    """Generate for a batch of prompts (strings or token-id lists of any lengths).

    method "ar" is plain decoding; "dflash" verifies the drafter's chain, "ddtree" a tree of
    `tree_budget` nodes. "auto" is "ar" without a drafter; with one, every step picks from
    `menu` (default auto.DEFAULT_MENU: "none", "chain", "chainN", "treeN") what maximises
    expected tokens per second, from the drafter's confidence (temperature-scaled by
    `calibration`, default the drafter's fitted one) and `cost` (a kdj.cost.StepCost or its
    JSON path: an override; "tune": time this machine's steps first, said on stderr;
    "estimate": an estimate from the target's shapes; default: the cost a tuning pass cached
    for this pair, device and batch bucket, else, on an accelerator, such a pass at first use
    (said on stderr), else the estimate: kdj/decode/tune.py). Before
    compiling, auto drops the entries that cannot pay at this batch size (auto.paying_menu;
    stats["menu"] lists the rest); with none left it runs plain decoding, every step a
    "skip". max_new_tokens may be one int or one per prompt; stop_tokens one list or one list
    per prompt (default: the tokenizer's end-of-turn ids, else the config's eos). cache_size
    fixes the KV-cache capacity (default: the longest prompt + max_new_tokens, rounded up to a
    multiple of 128 within max_position_embeddings). A tree (tree_budget, a menu's treeN)
    larger than the cache can hold after the shortest prompt is cut to that size:
    stats["tree_budget"] / stats["menu"] say what ran. Bad arguments raise TypeError or
    ValueError before anything compiles (kdj.arguments); an argument the method does not use
    is refused, not ignored. With more prompts than `max_batch`, the prompts stream through a
    pool of max_batch slots (kdj/decode/engine.py, at the smallest of its compiled widths that
    holds the live slots; auto's menu priced at each width; the host refills it once an
    eighth of it has finished, kdj/decode/stream.py bulk_wake): each prompt's result is what it gets
    alone (greedy: the same tokens; stats["request_steps"] and "mean_acceptance" from each
    prompt's own steps).

    Returns a GenerateOutput: tokens and texts per prompt, stats, and finish_reasons, one
    per prompt: "stop" (it emitted a stop token), "length" (max_new_tokens reached) or
    "cache" (its KV cache filled first).

    Sampling draws the token at position p of a sequence with a key from (its seed, p)
    (kdj/decode/sampling.py): `seed` one per prompt, or one int s: prompt i then draws with
    seed s + i * 0x9E3779B9 (mod 2**32), so the first prompt's samples are those of `seed=[s]`
    and of a server request with "seed": s (with deterministic=True every prompt uses s as
    its own seed). With
    deterministic=True (kernel policy `as_deterministic`) the output depends only on the
    target, the prompt, the sampling parameters and the prompt's seed: not on the drafter,
    the method, the batch or the run.

    logprobs=k (0 .. 20) also returns, for every generated token, its log-probability and
    the k most likely tokens at its position with theirs (GenerateOutput.logprobs): the
    log-softmax of the target's raw logits there (temperature and top_p aside), the same for
    every method; the tokens are those of logprobs=None.
    """
    # ---- arguments: every check of the caller's options, before anything is compiled
    opts = check_options(target, drafter, method, block_size, tree_budget, menu, calibration,
                         temperature, top_p, mesh, cost)  # fmt: skip
    temperature, top_p = arguments.sampling(temperature, top_p)
    logprobs = arguments.logprobs(logprobs)
    if arguments.flag(deterministic, "deterministic"):
        target = deterministic_target(target)
    if tokenizer is not None:
        arguments.loaded(tokenizer, Tokenizer, "tokenizer", "kdj.load_tokenizer")
    cost = arguments.cost(cost)
    tokenizer = tokenizer or target.tokenizer
    batch = pack(target, prompts, tokenizer, max_new_tokens, stop_tokens, cache_size)
    if max_batch is not None and batch.B > arguments.integer(max_batch, "max_batch", 1):
        return stream(opts, target, drafter, batch, max_batch, temperature, top_p, seed,
                      tokenizer, cost, logprobs)  # fmt: skip
    seeds = prompt_seeds(seed, batch.B, target.cfg.kernels.deterministic)
    seeds += [0] * (batch.tokens.shape[0] - batch.B)  # the padding rows
    opts = cap_trees(opts, batch)
    # ---- plan: which steps the loop composes
    if opts.method != "ar":
        if target.sharding is not None:
            drafter = drafter.on(target.sharding)  # the drafter lives on its target's mesh
        drafter = drafter.with_kernels(target.cfg.kernels)  # and follows its kernel policy
    plan, prior, shapes = make_plan(opts, target, drafter, batch, temperature == 0.0, cost)
    # a vocabulary has no more alternatives than its tokens
    k = None if logprobs is None else min(logprobs, target.cfg.vocab_size)
    plan = dataclasses.replace(plan, logprobs=k)
    # ---- run
    keys = request_keys(seeds)
    sampling = (keys, jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p))
    res = execute(target, drafter if plan.speculative else None, batch, plan, sampling,
                  opts.calibration, prior)  # fmt: skip
    # ---- output
    return assemble(opts, shapes, batch, res, tokenizer, logprobs)


def deterministic_target(target: Target) -> Target:
    """`target` under its kernel policy in deterministic mode, sharing its compiled programs
    (the policy is part of their keys, through the graphdef)."""
    if target.cfg.kernels.deterministic:
        return target
    same = target.with_kernels(target.cfg.kernels.as_deterministic())
    return dataclasses.replace(same, executables=target.executables)


class Options(NamedTuple):
    """generate's options, checked."""

    method: str  # "ar" also for "auto" without a drafter
    block_size: int | None
    tree_budget: int | None
    calibration: float
    shapes: tuple  # the menu as parsed (before pricing); () for "ar"
    requested_tree_budget: int | None  # tree_budget as asked, before cap_trees
    forecast: bool  # drafted steps compute the drafter's forecast (auto, or calibration given)


def check_options(target, drafter, method, block_size, tree_budget, menu, calibration,
                  temperature, top_p, mesh, cost=None) -> Options:  # fmt: skip
    arguments.loaded(target, Target, "target", "kdj.load_target")
    if drafter is not None:
        arguments.loaded(drafter, Drafter, "drafter", "kdj.load_drafter")
    method = arguments.method(method, drafter is not None, block_size=block_size,
                              tree_budget=tree_budget, menu=menu, cost=cost,
                              calibration=calibration)  # fmt: skip
    arguments.sampling(temperature, top_p)
    menu = arguments.menu(menu)
    speculative = method != "ar"
    if speculative and block_size is not None:
        block_size = arguments.integer(block_size, "block_size")
    block_size = check_pair(target, drafter, block_size) if speculative else None
    if method == "ddtree":
        tree_budget = DEFAULT_TREE_BUDGET if tree_budget is None else tree_budget
        tree_budget = arguments.integer(tree_budget, "tree_budget", 1)
    shapes = ()
    # a fixed method forecasts (stats expected_acceptance) only when asked for a calibration
    forecast = method == "auto" or (speculative and calibration is not None)
    if speculative:
        calibration = drafter.calibration if calibration is None else calibration
        calibration = arguments.calibration(calibration)
        shapes = auto.parse_menu(method, menu, block_size, tree_budget)
    if mesh is not None and as_sharding(mesh) != target.sharding:
        raise ValueError("the target lives on another mesh: load it with load_target(mesh=...)")
    return Options(method, block_size, tree_budget, calibration or 1.0, shapes, tree_budget,
                   forecast)  # fmt: skip


def cap_trees(opts: Options, batch: Batch) -> Options:
    """No step can verify more nodes than the cache has room for: trees larger than that are
    cut to it (stats say what ran)."""
    if opts.method == "ar":
        return opts
    shapes = arguments.cap_trees(
        opts.shapes, arguments.tree_cap(batch.capacity, batch.lens[: batch.B])
    )
    budget = shapes[0].size if opts.method == "ddtree" else None
    return opts._replace(shapes=shapes, tree_budget=budget)


def make_plan(opts: Options, target, drafter, batch, greedy: bool, cost):
    """(Plan, auto's priors, the menu left after pricing). auto prices its menu for this
    batch first; with no draft shape left it runs plain decoding's plan."""
    max_steps, shapes = max(batch.max_new), opts.shapes
    if opts.method == "ar":
        return Plan(greedy, max_steps), [0.0], shapes
    context = float(np.mean(batch.lens) + np.mean(batch.max_new) / 2)  # decode's mean
    shapes, cost = priced_menu(shapes, target, drafter, len(batch.lens), context, cost)
    if all(s.kind == "none" for s in shapes):
        return Plan(greedy, max_steps), [0.0], shapes
    plan = Plan(greedy, max_steps, opts.block_size, shapes, cost, forecast=opts.forecast)
    return plan, auto.priors(shapes, drafter), shapes


def priced_menu(shapes, target, drafter, batch: int, context: float, cost):
    """(menu, StepCost) for steps of `batch` rows at `context`: auto's menu (several
    entries) less what cannot pay there (auto.paying_menu), with this machine's tuned cost
    when one is cached (kdj/decode/tune.py); one entry (DFlash, DDTree) as it is, no cost."""
    if len(shapes) <= 1:
        return shapes, None
    cost = auto.step_cost(tune.resolve(cost, target, drafter, shapes, batch, context), target,
                          drafter)  # fmt: skip
    priors = (drafter.prior_acceptance, drafter.entry_acceptance)
    return auto.paying_menu(shapes, cost, batch, context, *priors), cost


def pool_menu(shapes, target, drafter, batch: int, context: float, cost):
    """(menu, StepCost) of a slot pool's width of `batch` rows: auto's entries worth
    compiling there, each priced alone (a pool's chunk runs one entry, picked from what the
    chunks measure: kdj/decode/picks.py), "none" always; one entry (DFlash, DDTree) as it is."""
    if len(shapes) <= 1:
        return shapes, None
    cost = auto.step_cost(tune.resolve(cost, target, drafter, shapes, batch, context), target,
                          drafter)  # fmt: skip
    prior, measured = drafter.prior_acceptance, drafter.entry_acceptance
    rates = [auto.entry_rate(s, cost, batch, context, auto.largest_tree((s,)), prior, measured)
             for s in shapes]  # fmt: skip
    keep = picks.worth_compiling(rates, [s.kind == "none" for s in shapes], prior > 0)
    return tuple(s for s, k in zip(shapes, keep) if k), cost


def pack(target, prompts, tokenizer, max_new_tokens, stop_tokens, cache_size) -> Batch:
    """Check and pack the prompts, budgets and stop ids; choose the cache capacity."""
    ids = _as_token_lists(target, prompts, tokenizer)
    B = len(ids)
    max_new = arguments.max_new_tokens(max_new_tokens, B)
    # A batch split over devices must divide evenly: pad with one-token dummy sequences.
    shards = 1 if target.sharding is None else target.sharding.size("batch")
    pad = -B % shards
    ids, max_new = ids + [[0]] * pad, max_new + [1] * pad
    lens = [len(p) for p in ids]
    capacity = arguments.cache_capacity(
        lens, max_new, cache_size, target.cfg.max_position_embeddings
    )
    default_stop = tokenizer.stop_ids if tokenizer is not None else target.cfg.eos_token_ids
    rows = arguments.stop_rows(stop_tokens, B, sorted(default_stop), target.cfg.vocab_size)
    stop = _stop_matrix(rows)
    stop = np.concatenate([stop, np.full((pad, stop.shape[1]), -1, np.int32)])
    P = _round_up(max(lens), 16)  # bucket prompt lengths so similar batches share a compile
    tokens = np.zeros((B + pad, P), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    return Batch(tokens, lens, max_new, stop, capacity, B)


class Run(NamedTuple):
    """A run's loop output on the host, and its times."""

    out: np.ndarray
    n_out: np.ndarray
    steps: int
    stats: Any  # kdj.decode.state.Stats of numpy arrays, None for plain decoding
    times: dict  # compile_s, prefill_s, decode_s
    logprobs: Any = None  # kdj.decode.logprobs.Logprobs of numpy arrays, when the plan asks


def execute(target, drafter, batch: Batch, plan: Plan, sampling, calibration, prior) -> Run:
    """Compile (once per signature, kept by the target), prefill, run the loop; with syncs
    between, so each time is its own."""
    key, temp, topp = sampling
    B, S = batch.tokens.shape[0], batch.capacity
    tokens, lens = jnp.asarray(batch.tokens), jnp.asarray(batch.lens, jnp.int32)
    max_new, stop = jnp.asarray(batch.max_new, jnp.int32), jnp.asarray(batch.stop)
    tcache = shard_cache(init_cache(target.cfg, B, S, target.dtype), target.sharding)
    tg, ts, dg, ds, dcache = target.graphdef, target.state, None, None, None
    if drafter is not None:
        dg, ds = drafter.graphdef, drafter.state
        dcache = init_cache(drafter.cfg.layers, B, S, target.dtype)
        dcache = shard_cache(dcache, drafter.sharding)
    cal, prior = jnp.float32(calibration), jnp.asarray(prior, jnp.float32)
    exe, xla = target.executables, target.cfg.kernels.compiler_options()
    t0 = time.perf_counter()
    pre = exe.get(loop.prefill, tg, ts, dg, ds, tokens, lens, tcache, dcache, key, temp, topp,
                  options=xla, greedy=plan.greedy, logprobs=plan.logprobs)  # fmt: skip
    # compile the loop for exactly what prefill hands it: XLA may lay a cache out differently
    # from how it was passed in (e.g. a single KV head split by head_dim)
    record = None if plan.logprobs is None else lps.empty((B,), plan.logprobs)
    like = Prefilled(jnp.zeros((B,), jnp.int32), tcache, dcache, record)
    spec = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like,
                        pre.output_shardings)  # fmt: skip
    with warnings.catch_warnings():
        if plan.logprobs is not None:  # the first token's [B, k] alternatives, donated with
            # the rest of `pre`, fit no buffer of the run's [B, N, k] record: no harm
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        dec = exe.get(loop.decode, tg, ts, dg, ds, spec, max_new, stop, key, temp, topp, cal,
                      prior, options=xla, plan=plan)  # fmt: skip
    t1 = time.perf_counter()
    first = jax.block_until_ready(pre(ts, ds, tokens, lens, tcache, dcache, key, temp, topp))
    t2 = time.perf_counter()
    out = dec(ts, ds, first, max_new, stop, key, temp, topp, cal, prior).output()
    out = jax.tree.map(np.asarray, out)  # only what the host needs: never the caches
    t3 = time.perf_counter()
    times = {"compile_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2}
    return Run(out.out, out.n_out, int(out.steps), out.stats, times, out.logprobs)


def prompt_seeds(seed, B: int, deterministic: bool) -> list[int]:
    """Each prompt's seed: as given per prompt; one int spread over the prompts
    (sampling.spread_seeds), or in deterministic mode every prompt's own, so that a prompt's
    samples do not depend on its row."""
    seeds, per_prompt = arguments.seeds(seed, B)
    return seeds if per_prompt or deterministic else spread_seeds(seeds[0], B)


def pool_drafting(opts: Options, target, drafter, max_batch: int, cache_size: int,
                  context: float, cost=None, widths=None) -> dict:  # fmt: skip
    """The engine's drafting arguments (kdj/decode/engine.py `Engine`) for checked options:
    auto's menu at each width of the pool's ladder (`widths` as the engine takes it), the
    entries priced at `context` to rank them until the pool has measured them and to leave
    out those priced far below the best (`pool_menu`); none when plain decoding is what runs
    at every width."""
    if opts.method == "ar":
        return {}
    shapes = arguments.cap_trees(opts.shapes, arguments.tree_cap(cache_size, [1]))
    ladder = widths_ladder(max_batch, widths)
    costs = dict.fromkeys(ladder, cost)
    if len(shapes) > 1:  # only auto prices a menu: one tuning pass for the whole ladder
        costs = tune.resolve_widths(cost, target, drafter, shapes, ladder, context)
    priced = {w: pool_menu(shapes, target, drafter, w, context, costs[w]) for w in ladder}
    if all(s.kind == "none" for menu, _ in priced.values() for s in menu):
        return {}
    return {"drafter": drafter, "block_size": opts.block_size,
            "menu": {w: menu for w, (menu, _) in priced.items()},
            "cost": {w: c for w, (_, c) in priced.items()},
            "calibration": opts.calibration}  # fmt: skip


def stream(opts: Options, target, drafter, batch: Batch, max_batch, temperature, top_p, seed,
           tokenizer, cost=None, logprobs=None) -> GenerateOutput:  # fmt: skip
    """generate with more prompts than max_batch: the prompts stream through the engine."""
    B, t0 = batch.B, time.perf_counter()
    wake = bulk_wake(max_batch)
    context = float(np.mean(batch.lens[:B]) + np.mean(batch.max_new[:B]) / 2)  # as make_plan's
    drafting = pool_drafting(opts, target, drafter, max_batch, batch.capacity, context, cost)
    res = generate_stream(
        target, [batch.tokens[b, : batch.lens[b]].tolist() for b in range(B)], max_batch,
        batch.max_new[:B], [[int(i) for i in row if i >= 0] for row in batch.stop[:B]],
        cache_size=batch.capacity, temperature=temperature, top_p=top_p,
        wake=wake, admit_rows=wake, logprobs=logprobs,
        seeds=prompt_seeds(seed, B, target.cfg.kernels.deterministic), **drafting,
    )  # fmt: skip
    toks, texts = res.tokens, None
    if tokenizer is not None:
        texts = [reply_text(tokenizer, seq, batch.stop[b]) for b, seq in enumerate(toks)]
    new, steps, seconds = sum(map(len, toks)), sum(res.steps), time.perf_counter() - t0
    stats = {"method": opts.method, "batch": B, "max_batch": max_batch, "new_tokens": new,
             "seconds": seconds, "request_steps": res.steps,
             # the whole run's: the pool interleaves compiles, prefills and steps
             "tokens_per_s": new / seconds,
             # tokens per step of every prompt's steps: the first token came from prefill
             "mean_acceptance": (new - B) / steps if steps else float("nan")}  # fmt: skip
    if opts.method == "auto":  # what the pool's menu kept at its full width, and at each
        menus = drafting.get("menu", {max_batch: (DraftShape("none"),)})
        stats["menu"] = [str(s) for s in menus[max_batch]]
        stats["menus"] = {w: [str(s) for s in m] for w, m in menus.items()}
    return GenerateOutput(toks, texts, stats, finish_reasons(toks, batch), res.logprobs)


def reply_text(tokenizer, tokens, stop) -> str:
    """The text of a reply's tokens without the stop token that ended it (one of its own
    `stop` ids, always its last token), and a last character that no token completed (the
    reply was cut off inside it) dropped rather than shown as U+FFFD."""
    ended = bool(tokens) and tokens[-1] in stop
    return tokenizer.decode(tokens[:-1] if ended else tokens).rstrip("\ufffd")


def finish_reasons(tokens: list[list[int]], batch: Batch) -> list[str]:
    """Why each sequence ended, from its tokens: its last one is one of its stop ids ("stop"),
    it has its max_new_tokens ("length"), else its cache ran out of slots first ("cache")."""
    reasons = []
    for b, seq in enumerate(tokens):
        if seq and seq[-1] in batch.stop[b]:  # ids >= 0: the -1 padding never matches
            reasons.append("stop")
        elif len(seq) >= batch.max_new[b]:
            reasons.append("length")
        else:
            reasons.append("cache")
    return reasons


def assemble(opts: Options, shapes, batch: Batch, res: Run, tokenizer,
             logprobs: int | None = None) -> GenerateOutput:  # fmt: skip
    """Tokens per prompt (padding rows dropped), texts, stats, and `logprobs` alternatives
    per token when not None."""
    B, method = batch.B, opts.method
    toks = [res.out[b, : res.n_out[b]].tolist() for b in range(B)]
    texts = None
    if tokenizer is not None:
        texts = [reply_text(tokenizer, seq, batch.stop[b]) for b, seq in enumerate(toks)]
    stats = decode_stats(method, res, B)
    if method != "ar":
        stats.update(speculative_stats(method, res, B, shapes, opts.block_size, opts.forecast))
    if method == "ddtree":
        sizes = [int(s) for row in res.stats.sizes[:B] for s in row if s > 0]
        stats["tree_budget"] = opts.tree_budget  # what ran: capped by what fits in the cache
        stats["tree_budget_requested"] = opts.requested_tree_budget
        stats["mean_tree_size"] = float(np.mean(sizes)) if sizes else float("nan")
        stats["mean_accepted_depth"] = stats["mean_acceptance"] - 1
    record = None
    if logprobs is not None:
        record = [lps.rows(res.logprobs, b, 0, len(toks[b]), logprobs) for b in range(B)]
    return GenerateOutput(toks, texts, stats, finish_reasons(toks, batch), record)


def _as_token_lists(target: Target, prompts, tokenizer: Tokenizer | None) -> list[list[int]]:
    out = []
    for i, p in enumerate(arguments.prompts(prompts)):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (pass tokenizer= or token ids)")
            p = tokenizer.encode(arguments.text(p, i))
        out.append(arguments.token_ids(p, i, target.cfg.vocab_size))
    return out


def _stop_matrix(rows) -> np.ndarray:
    """Per-sequence stop ids as [B, K] int32, padded with -1 (K a multiple of 4, so calls
    with a few stop ids more or less share a compile)."""
    width = _round_up(max(1, max(len(r) for r in rows)), 4)
    return np.array([r + [-1] * (width - len(r)) for r in rows], np.int32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def forward(target: Target, token_ids) -> np.ndarray:
    """Full-sequence logits [B, T, V] float32 with no cache reuse (parity and research)."""
    arguments.loaded(target, Target, "target", "kdj.load_target")
    cfg = target.cfg
    arr = arguments.forward_tokens(token_ids, cfg.vocab_size, cfg.max_position_embeddings)
    tokens = jnp.asarray(arr, jnp.int32)
    return np.asarray(full_sequence(target.graphdef, target.state, tokens)[0])


def hidden_states(target: Target, token_ids, layers) -> np.ndarray:
    """Output hidden states of the given decoder layers, [B, T, len(layers), D] float32
    (HF `hidden_states[id + 1]`), from one full-sequence pass with no cache reuse."""
    arr = np.asarray(token_ids, np.int32).reshape(-1, np.shape(token_ids)[-1])
    taps = tuple(int(i) for i in layers)
    if any(not 0 <= i < target.cfg.num_layers for i in taps):
        raise ValueError(f"layer ids {taps} outside [0, {target.cfg.num_layers})")
    out = full_sequence(target.graphdef, target.state, jnp.asarray(arr), taps=taps)[1]
    return np.asarray(out, np.float32)
