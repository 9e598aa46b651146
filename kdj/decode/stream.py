"""Bulk generation through the slot pool: every prompt streamed through an `Engine` whose
results are read at the end (kdj.generate with max_batch, data generation)."""

from __future__ import annotations

from typing import NamedTuple

from kdj.decode.engine import PREFILL_CHUNK, Engine
from kdj.decode.logprobs import TokenLogprob
from kdj.decode.requests import Request
from kdj.decode.tree import DraftShape
from kdj.handles import Drafter, Target


def bulk_wake(max_batch: int) -> int:
    """`wake` for a pool whose results are read at the end (kdj.generate, data generation):
    the host takes its turn once an eighth of the pool has finished, not at every finish
    (a turn costs about a step's time on a GPU), and admits in groups of that size."""
    return max(1, max_batch // 8)


class Streamed(NamedTuple):
    """What generate_stream gives back, one entry per prompt."""

    tokens: list[list[int]]  # generated tokens, ending at the first stop token or the budget
    steps: list[int]  # the pool's steps each took (plain decoding: tokens - 1)
    logprobs: list[list[TokenLogprob]] | None = None  # one per token, when asked for


def generate_stream(target: Target, prompts: list[list[int]], max_batch: int, max_new: list[int],
                    stop: list[list[int]], *, cache_size: int, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, seeds: list[int] | None = None,
                    chunk_steps: int = 32, drafter: Drafter | None = None,
                    block_size: int | None = None, menu: tuple[DraftShape, ...] = (),
                    cost=None, calibration: float = 1.0, widths=None, wake: int = 1,
                    admit_rows: int = 64, prefill_chunk: int = PREFILL_CHUNK,
                    logprobs: int | None = None) -> Streamed:  # fmt: skip
    """Every prompt (token ids) streamed through a pool of `max_batch` slots (drafting with
    `drafter`, at the ladder `widths`, as `Engine` does). seeds: one per prompt (its
    samples then do not depend on the other prompts); else each is derived from `seed`.
    logprobs=k: each token's log-probability and k alternatives' too."""
    engine = Engine(target, max_batch, cache_size, max(max_new), drafter=drafter,
                    block_size=block_size, menu=menu, cost=cost, calibration=calibration,
                    chunk_steps=chunk_steps, seed=seed, widths=widths, wake=wake,
                    admit_rows=admit_rows, prefill_chunk=prefill_chunk)  # fmt: skip
    seeds = seeds if seeds is not None else [None] * len(prompts)
    ids = [engine.submit(Request(list(p), m, list(s), temperature, top_p, seed, logprobs))
           for p, m, s, seed in zip(prompts, max_new, stop, seeds)]  # fmt: skip
    got: dict[int, list[int]] = {i: [] for i in ids}
    scored: dict[int, list[TokenLogprob]] = {i: [] for i in ids}
    steps = dict.fromkeys(ids, 0)
    while engine.busy:
        for u in engine.step():
            got[u.id] += u.tokens
            scored[u.id] += u.logprobs or []
            steps[u.id] = u.steps
    record = None if logprobs is None else [scored[i] for i in ids]
    return Streamed([got[i] for i in ids], [steps[i] for i in ids], record)
