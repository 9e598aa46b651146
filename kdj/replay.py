"""The replay drafter's host side, FOR BENCHMARKS ONLY: record a target's greedy
continuations, build a drafter that replays them corrupted at a chosen rate
(kdj/models/replay.py `ReplayDrafter`), measure the acceptance it gets, and pick the rate for
a requested one. It lets a target with random weights (any shape: an MoE Kimi-class one)
run speculative decoding at a chosen tau; it drafts the target's own answers, so it says
nothing about any real drafter's quality.

    rec = record(target, prompts, max_new_tokens=256)       # plain greedy decoding, once
    drafter = replay_drafter(target, rec, corrupt=0.3)      # a kdj.Drafter
    drafter = calibrate(target, rec, tau=3.0).drafter       # the rate giving DFlash's tau ~3
    kdj.generate(target, rec.prompts, drafter=drafter, method="ddtree", max_batch=64)

Greedy decoding with it is lossless like with any drafter: verification decides every
token. It drafts well only the prompts it recorded, decoded greedily.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from kdj.api import generate
from kdj.handles import Drafter, Target
from kdj.models.replay import ReplayDrafter, build_table, replay_config

DEFAULT_BLOCK = 16  # the block size of the published DFlash drafters


@dataclasses.dataclass(frozen=True)
class Recording:
    """A target's greedy continuation of each prompt (the first token is prefill's)."""

    prompts: list[list[int]]
    continuations: list[list[int]]
    vocab_size: int  # of the target that recorded them


def record(target: Target, prompts, max_new_tokens: int = 256,
           max_batch: int | None = None) -> Recording:  # fmt: skip
    """Plain greedy decoding of token-id `prompts`, stop tokens off (every continuation runs
    max_new_tokens), through the slot pool when max_batch is given."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        raise ValueError("record needs at least one prompt")
    out = generate(target, prompts, method="ar", max_new_tokens=max_new_tokens, stop_tokens=[],
                   max_batch=max_batch)  # fmt: skip
    return Recording(prompts, out.tokens, target.cfg.vocab_size)


def replay_drafter(target: Target, recording: Recording, corrupt: float,
                   block_size: int = DEFAULT_BLOCK, seed: int = 0) -> Drafter:  # fmt: skip
    """A kdj.Drafter replaying `recording`, each depth corrupted with probability `corrupt`
    (decided per context and `seed`)."""
    _check_rate(corrupt)
    if not isinstance(recording, Recording):
        kind = type(recording).__name__
        raise ValueError(f"recording must be a kdj.replay.Recording (got a {kind})")
    if not recording.continuations:
        raise ValueError("the recording is empty: record at least one prompt")
    if recording.vocab_size != target.cfg.vocab_size:
        have, want = recording.vocab_size, target.cfg.vocab_size
        raise ValueError(f"the recording's vocabulary ({have}) does not match the target's "
                         f"({want}): another target recorded it")  # fmt: skip
    if target.cfg.vocab_size < 2:
        raise ValueError("replay needs a vocabulary of 2 tokens or more (to corrupt a token)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2 (got {block_size!r})")
    table = build_table([len(p) for p in recording.prompts], recording.continuations)
    model = ReplayDrafter(replay_config(target.cfg, block_size), table, corrupt, seed)
    return Drafter.from_model(model, name=_name(corrupt))


def with_corruption(drafter: Drafter, corrupt: float) -> Drafter:
    """The same replay drafter at another rate: same shapes, so nothing recompiles."""
    _check_rate(corrupt)
    model = drafter.model
    if not isinstance(model, ReplayDrafter):
        raise ValueError(f"{drafter.name!r} is not a replay drafter")
    model.corrupt[...] = jnp.float32(corrupt)
    return dataclasses.replace(drafter, state=nnx.state(model), name=_name(corrupt))


def measure_tau(target: Target, drafter: Drafter, recording: Recording, method: str = "dflash",
                prompts: int | None = None, max_batch: int | None = None,
                **kw) -> float:  # fmt: skip
    """Mean tokens per step (tau) of greedy `method` over the first `prompts` recorded
    prompts (all: None), each run to its recorded length; kw: more generate arguments."""
    ps = recording.prompts[:prompts]
    n = [len(c) for c in recording.continuations[: len(ps)]]
    out = generate(target, ps, drafter=drafter, method=method, max_new_tokens=n, stop_tokens=[],
                   max_batch=max_batch, **kw)  # fmt: skip
    return float(out.stats["mean_acceptance"])


class Calibrated(NamedTuple):
    drafter: Drafter  # prior_acceptance set to `tau`
    corrupt: float
    tau: float  # measured at `corrupt`


def calibrate(target: Target, recording: Recording, tau: float, method: str = "dflash",
              block_size: int = DEFAULT_BLOCK, seed: int = 0, prompts: int | None = 8,
              steps: int = 8, tolerance: float = 0.1) -> Calibrated:  # fmt: skip
    """The corruption rate at which greedy `method` on the first `prompts` recorded prompts
    reaches `tau`: bisection over [0, 1], at most `steps` measurements after the two ends,
    stopping within `tolerance`. With a fixed seed a higher rate corrupts a superset of the
    contexts, so tau falls as the rate rises. A tau beyond what the ends give is refused."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not math.isfinite(tau):
        raise ValueError(f"tau must be a number (got {tau!r})")
    drafter = replay_drafter(target, recording, 0.0, block_size, seed)

    def at(rate):
        d = with_corruption(drafter, rate)
        return d, measure_tau(target, d, recording, method, prompts)

    best = at(0.0)
    if tau > best[1] + tolerance:
        raise ValueError(f"tau {tau} is out of reach: the uncorrupted replay gets "
                         f"{best[1]:.2f} with {method} (record longer continuations, or take a "
                         "larger block)")  # fmt: skip
    lo, hi = 0.0, 1.0  # tau(lo) >= tau >= tau(hi)
    worst = at(hi)
    if tau < worst[1] - tolerance:
        raise ValueError(f"tau {tau} is out of reach: fully corrupted replay still gets "
                         f"{worst[1]:.2f} with {method}")  # fmt: skip
    found = {0.0: best, 1.0: worst}  # rate -> (drafter, tau measured)

    def closest():
        return min(found, key=lambda r: abs(found[r][1] - tau))

    for _ in range(steps):
        if abs(found[closest()][1] - tau) <= tolerance:
            break
        mid = (lo + hi) / 2
        found[mid] = at(mid)
        lo, hi = (mid, hi) if found[mid][1] > tau else (lo, mid)
    rate = closest()
    d, got = found[rate]
    return Calibrated(dataclasses.replace(d, prior_acceptance=got), rate, got)


def _check_rate(corrupt) -> None:
    ok = isinstance(corrupt, numbers.Real) and not isinstance(corrupt, bool)
    if not ok or not 0.0 <= corrupt <= 1.0:
        raise ValueError(f"corrupt must be a probability in [0, 1] (got {corrupt!r})")


def _name(corrupt: float) -> str:
    return f"replay drafter (benchmarks only), corrupt={corrupt:.4g}"
