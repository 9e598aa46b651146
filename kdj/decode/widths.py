"""The slot pool at several compiled widths: the ladder, and the device program that moves a
pool from one width to another (kdj/decode/engine.py decides when).

A step computes every row of its compiled width, live or not, so a pool of 256 slots serving
one request would pay a 256-row step per token. The engine instead runs at the smallest
width of a short ladder (default powers of 4 up to max_batch) that holds its live slots,
and between chunks `resize` gathers the live rows of every per-slot array into a pool of
another width (fresh rows as `pool.empty` makes them).

Which axis of a leaf is its slot axis is not written down per field: `batch_axes` finds it
by building the empty pool at two widths and comparing shapes, so a per-slot field added to
DecodeState (or Pool) moves with its slot without anyone remembering to list it. Leaves
that do not depend on the width (scalars, Stats.choices [N]) are the batch's and carry over.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from kdj.decode import auto
from kdj.decode.pool import Pool
from kdj.decode.state import Plan


def ladder(max_batch: int, widths=None) -> tuple[int, ...]:
    """The widths a pool of max_batch slots may run at, ascending, ending at max_batch:
    `widths` as given (checked), default 1, 4, 16, 64, ... below max_batch, then max_batch."""
    if widths is None:
        widths, w = [], 1
        while w < max_batch:
            widths.append(w)
            w *= 4
        return (*widths, max_batch)
    widths = tuple(sorted({int(w) for w in widths}))
    if not widths or widths[0] < 1 or widths[-1] != max_batch:
        raise ValueError(f"widths must be >= 1 and end at max_batch ({max_batch}), got "
                         f"{list(widths)}")  # fmt: skip
    return widths


def chunk_bounds(chunk_steps: int | Mapping[int, int], widths: tuple[int, ...]) -> dict[int, int]:
    """Steps per chunk at each width: one for all, or one per width."""
    bounds = chunk_steps if isinstance(chunk_steps, Mapping) else dict.fromkeys(widths, chunk_steps)
    if set(bounds) != set(widths):
        raise ValueError(f"chunk_steps needs one entry per width {list(widths)}, got "
                         f"{sorted(bounds)}")  # fmt: skip
    bad = {w: s for w, s in bounds.items() if isinstance(s, bool) or not isinstance(s, int)
           or s < 1}  # fmt: skip
    if bad:
        raise ValueError(f"chunk_steps must be integers >= 1, got {bad}")
    return dict(bounds)


def fitting(widths: tuple[int, ...], need: int) -> int:
    """The smallest width of the ladder that holds `need` slots (the largest if none does)."""
    return next((w for w in widths if w >= need), widths[-1])


def batch_axes(make) -> tuple[int | None, ...]:
    """The slot axis of every leaf of the pool `make(width)` builds (None: the leaf does not
    depend on the width), in jax.tree.leaves order: the one axis whose size differs between
    the pools of width 1 and 2. A leaf whose shape changes in any other way is an error."""
    one, two = (jax.tree.leaves(jax.eval_shape(functools.partial(make, w))) for w in (1, 2))
    axes = []
    for a, b in zip(one, two, strict=True):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        if diff and (len(diff) > 1 or (a.shape[diff[0]], b.shape[diff[0]]) != (1, 2)):
            raise ValueError(f"a pool leaf of shape {a.shape} at width 1, {b.shape} at 2: "
                             "not one slot axis")  # fmt: skip
        axes.append(diff[0] if diff else None)
    return tuple(axes)


def _move(src, fresh, rows, axis):
    """fresh with its rows j (along `axis`) taken from src's rows[j] where rows[j] >= 0. A leaf
    without a slot axis carries over, unless its shape is the other width's own (auto's
    tally over another menu): then it starts afresh."""
    if axis is None:
        return src if src.shape == fresh.shape else fresh
    src, fresh = jnp.moveaxis(src, axis, 0), jnp.moveaxis(fresh, axis, 0)
    W = fresh.shape[0]
    taken = src[jnp.clip(rows, 0, src.shape[0] - 1)]
    out = fresh.at[jnp.where(rows >= 0, jnp.arange(W), W)].set(taken, mode="drop")
    return jnp.moveaxis(out, 0, axis)


@functools.partial(jax.jit, static_argnames=("axes", "src", "dst"),
                   donate_argnames=("fresh",))  # fmt: skip
def resize(pool: Pool, fresh: Pool, rows, prior, *, axes, src: Plan, dst: Plan) -> Pool:
    """The pool at fresh's width: its row j is pool's row rows[j] (-1: fresh's own, a free
    slot). axes: `batch_axes` of dst's pool. src, dst: the plans of the two widths (auto's
    menu may differ: its controller's rows follow their entries, `auto.remenu`)."""
    state = pool.state
    if dst.adaptive and src.menu != dst.menu:
        state = dataclasses.replace(state, auto=auto.remenu(state.auto, src.menu, dst, prior))
    leaves, tree = jax.tree.flatten(Pool(state, pool.steps))
    new, fresh_tree = jax.tree.flatten(fresh)
    if tree != fresh_tree:
        raise ValueError("the two widths' pools differ in structure, not only in width")
    return jax.tree.unflatten(tree, [_move(s, f, rows, a) for s, f, a in zip(leaves, new, axes)])
