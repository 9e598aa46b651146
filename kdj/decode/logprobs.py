"""Log-probabilities of the emitted tokens, recorded only when a run asks (`Plan.logprobs`).

What kdj reports: log-softmax of the target's raw logits at the token's position (temperature
1, no top-p), whatever the sampling parameters, as vLLM does by default. Every method emits
a token from logits the target computed for that position anyway (plain_step, and verify's
rows along the accepted path), so AR and every speculative method report the same values.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP = 20  # alternatives per token at most (OpenAI's top_logprobs bound)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Logprobs:
    """Per token (any leading shape [...]: [B] for one token a row, [B, N] for a run's):
    its log-probability, and the k most likely tokens with theirs, most likely first."""

    chosen: jax.Array  # [...] float32
    top: jax.Array  # [..., k] float32
    ids: jax.Array  # [..., k] int32

    def put(self, index, new: Logprobs) -> Logprobs:
        """`new` written at `index` of each leaf (out-of-range entries dropped)."""
        return jax.tree.map(lambda x, v: x.at[index].set(v, mode="drop"), self, new)

    def take(self, at) -> Logprobs:
        """Rows [B, W] at columns `at` [B, W] of a [B, N] record."""
        return Logprobs(jnp.take_along_axis(self.chosen, at, axis=1),
                        jnp.take_along_axis(self.top, at[..., None], axis=1),
                        jnp.take_along_axis(self.ids, at[..., None], axis=1))  # fmt: skip


def empty(shape: tuple[int, ...], k: int) -> Logprobs:
    """A zero record of `shape` tokens with k alternatives each."""
    return Logprobs(jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, k), jnp.float32),
                    jnp.zeros((*shape, k), jnp.int32))  # fmt: skip


def of(logits, tokens, k: int) -> Logprobs:
    """logits [..., V] float32 (raw), tokens [...] -> their Logprobs with k alternatives."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(lp, k)
    return Logprobs(chosen, top, ids.astype(jnp.int32))


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability, on the host."""

    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def rows(record: Logprobs, b: int, start: int, end: int, k: int) -> list[TokenLogprob]:
    """Tokens start .. end - 1 of row b of a host record (numpy leaves), k alternatives each."""
    chosen = np.asarray(record.chosen[b, start:end], np.float64).tolist()
    top = np.asarray(record.top[b, start:end, :k], np.float64).tolist()
    ids = np.asarray(record.ids[b, start:end, :k]).tolist()
    return [TokenLogprob(c, list(zip(i, t))) for c, i, t in zip(chosen, ids, top)]
