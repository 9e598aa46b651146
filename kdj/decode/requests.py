"""What a caller hands the slot pool (`Request`) and gets back (`Update`), and the `Mode` a
pool's running requests share (kdj/decode/engine.py)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from kdj.decode.logprobs import TokenLogprob


@dataclasses.dataclass
class Request:
    tokens: list[int]
    max_new: int
    stop: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # its samples' seed (None: one derived from the pool's and its id)
    logprobs: int | None = None  # k: each token's log-probability and k alternatives'
    id: int = -1  # set by Engine.submit


class Mode(NamedTuple):
    """What the whole pool shares: greedy and whether it records log-probabilities (both
    static in the compiled programs), and top_p."""

    greedy: bool
    top_p: float
    logprobs: bool


def mode_of(req: Request) -> Mode:
    greedy = req.temperature == 0.0
    return Mode(greedy, 1.0 if greedy else req.top_p, req.logprobs is not None)


class Update(NamedTuple):
    """New tokens of one request since the last update; `finished` once it is done. steps:
    the pool's steps it has taken so far (its tokens per step: (tokens - 1) / steps)."""

    id: int
    tokens: list[int]
    finished: bool
    steps: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
