"""What the decode loop carries: `DecodeState` (arrays, a pytree) and `Plan` (static).

Per sequence b, `tcache.lengths[b]` (= `dcache.lengths[b]`) counts committed tokens whose K/V
are in the caches; `last[b]` is the newest committed token, not yet in the cache, so a step's
root sits at slot lengths[b]. Finished sequences keep their slot (static shapes) but stop
advancing, emitting and counting.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kdj.cache import KVCache
from kdj.cost import StepCost
from kdj.decode import auto
from kdj.decode import logprobs as lps
from kdj.decode.logprobs import Logprobs
from kdj.decode.tree import DraftShape


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of a run (part of the jit key): which steps the loop composes.

    block_size 0 is plain decoding (no drafter); otherwise `menu` lists what a drafted step
    may verify: one entry for DFlash ("chain") or DDTree ("tree"), several for method="auto",
    whose controller (kdj/decode/auto.py, needs `cost`) picks one per step."""

    greedy: bool
    max_steps: int  # = max(max_new): every step commits >= 1 token
    block_size: int = 0
    menu: tuple[DraftShape, ...] = ()
    cost: StepCost | None = None
    forecast: bool = False  # record the drafter's forecast in a fixed method too (calibration)
    # None: no log-probabilities; k: each emitted token's and its k most likely alternatives'
    # (kdj/decode/logprobs.py), so a run without them compiles the program it always did
    logprobs: int | None = None
    # the slot pool's auto: run menu[pin] alone, as its fixed method would (no forecasts, no
    # controller), while the state keeps the whole menu's layout, so the host can pick another
    # entry for the next chunk (kdj/decode/picks.py); None: the controller picks per step
    pin: int | None = None

    @property
    def speculative(self) -> bool:
        return self.block_size > 0

    @property
    def adaptive(self) -> bool:
        return len(self.menu) > 1

    @property
    def controlled(self) -> bool:
        """Whether auto's on-device controller picks each step's entry (not pinned)."""
        return self.adaptive and self.pin is None

    @property
    def shapes(self) -> tuple[DraftShape, ...]:
        """What this program's drafted steps may verify: the menu, or its pinned entry."""
        return self.menu if self.pin is None else (self.menu[self.pin],)

    @property
    def forecasts(self) -> bool:
        """Whether drafted steps compute the drafter's forecast: auto prices with it; a
        fixed method only when asked (it costs a pass over the [B, L, V] draft)."""
        return self.controlled or (self.forecast and self.pin is None)

    @property
    def can_skip(self) -> bool:
        """Whether steps may skip the drafter: "none" on a menu of several."""
        return self.adaptive and any(s.kind == "none" for s in self.menu)

    @property
    def queue_slots(self) -> int:
        """Feature slots of the queue: a drafted step's block, more for auto's plain runs."""
        return self.block_size * (auto.QUEUE_BLOCKS if self.can_skip else 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stats:
    """Per-step records of a speculative run ([B, N] or [N], N = max_steps)."""

    taus: jax.Array  # [B, N] int32 tokens committed (0 once finished)
    sizes: jax.Array  # [B, N] int32 draft nodes verified
    choices: jax.Array  # [N] int32 menu index; len(menu): the drafter was skipped; -1: no step
    expected: jax.Array  # [B, N] float32 tokens the drafter expected the step to commit
    # [len(menu) + 1, 2] int32 per choice: steps taken, tokens they committed (all rows);
    # never dropped, so the slot pool, whose steps outrun N, still knows what auto chose
    tally: jax.Array

    def record(self, i, count, size, choice, expected) -> Stats:
        return Stats(
            taus=self.taus.at[:, i].set(count, mode="drop"),
            sizes=self.sizes.at[:, i].set(size, mode="drop"),
            choices=self.choices.at[i].set(choice, mode="drop"),
            expected=self.expected.at[:, i].set(expected, mode="drop"),
            tally=self.tally.at[choice].add(jnp.stack([1, jnp.sum(count)]).astype(jnp.int32)),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    tcache: KVCache  # target K/V of the committed tokens
    dcache: KVCache | None  # drafter context K/V (None: plain decoding)
    last: jax.Array  # [B] int32 newest committed token (the next step's root)
    # target features of positions L - n_pend .. L - 1 that the drafter's context has not
    # taken in yet: [B, Q, F] (slots >= n_pend are padding); None without a drafter
    pending: jax.Array | None
    n_pend: jax.Array | None  # [B] int32
    out: jax.Array  # [B, N] int32 tokens emitted so far (the first came from prefill)
    n: jax.Array  # [B] int32 tokens emitted
    done: jax.Array  # [B] bool hit a stop token or its budget
    max_new: jax.Array  # [B] int32 per-sequence token budget
    stop_ids: jax.Array  # [B, K] int32 (-1 = unused)
    key: jax.Array  # [B] PRNG keys: the token at position p samples with fold_in(key[b], p)
    temperature: jax.Array  # [] float32, or [B] (the engine's pool: one per slot)
    top_p: jax.Array  # [] float32
    calibration: jax.Array  # [] float32 forecast temperature of the drafter
    step: jax.Array  # [] int32 steps taken
    stats: Stats | None  # None for plain decoding (tau is 1 every step)
    auto: auto.Controller | None  # method="auto"'s controller state (None: fixed methods)
    logprobs: Logprobs | None = None  # [B, N] beside `out` when the plan asks for them

    @property
    def active(self):
        return ~self.done

    def output(self) -> LoopOutput:
        return LoopOutput(self.out, self.n, self.step, self.stats, self.logprobs)


class Prefilled(NamedTuple):
    """What prefill hands the loop."""

    first: jax.Array  # [B] int32 the first new token
    tcache: KVCache
    dcache: KVCache | None
    logprobs: Logprobs | None = None  # [B] the first token's, when the plan asks for them


class LoopOutput(NamedTuple):
    """What the host reads back after the loop (never the caches: gigabytes at large batch)."""

    out: jax.Array  # [B, max_steps] int32
    n_out: jax.Array  # [B] int32 valid tokens of each row of out
    steps: jax.Array  # [] int32
    stats: Stats | None
    logprobs: Logprobs | None = None  # [B, max_steps] beside out, when the plan asks


def is_stop(tokens, stop_ids):
    """tokens [B], stop_ids [B, K] (-1 = unused) -> [B] bool."""
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def init_state(pre: Prefilled, max_new, stop_ids, key, temperature, top_p, calibration, prior,
               plan: Plan, feature_dim: int = 0) -> DecodeState:  # fmt: skip
    """The state after prefill. prior [len(menu)]: tokens per step each menu entry is expected
    to commit before any draft (0 = unknown), read by auto's controller only."""
    B, N = pre.first.shape[0], plan.max_steps
    n = jnp.ones((B,), jnp.int32)
    done = is_stop(pre.first, stop_ids) | (n >= max_new)
    pending = n_pend = stats = ctrl = None
    if plan.speculative:
        dtype = pre.tcache.k[0].dtype
        pending = jnp.zeros((B, plan.queue_slots, feature_dim), dtype)
        n_pend = jnp.zeros((B,), jnp.int32)
        taus, sizes = jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.int32)  # a buffer each
        stats = Stats(taus, sizes, jnp.full((N,), -1, jnp.int32), jnp.zeros((B, N), jnp.float32),
                      jnp.zeros((len(plan.menu) + 1, 2), jnp.int32))  # fmt: skip
    if plan.adaptive:
        ctrl = auto.init_controller(plan, prior, pre.tcache.lengths, ~done)
    record = None
    if plan.logprobs is not None:
        record = lps.empty((B, N), plan.logprobs).put((slice(None), 0), pre.logprobs)
    return DecodeState(
        tcache=pre.tcache, dcache=pre.dcache, last=pre.first, pending=pending, n_pend=n_pend,
        out=jnp.zeros((B, N), jnp.int32).at[:, 0].set(pre.first), n=n, done=done,
        max_new=max_new, stop_ids=stop_ids, key=key, temperature=jnp.float32(temperature),
        top_p=jnp.float32(top_p), calibration=jnp.float32(calibration), step=jnp.int32(0),
        stats=stats, auto=ctrl, logprobs=record,
    )  # fmt: skip
