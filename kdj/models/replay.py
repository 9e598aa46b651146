"""The replay drafter, FOR BENCHMARKS ONLY: not a model, it learns nothing. It proposes the
target's own recorded greedy continuation, corrupted at a chosen rate, so a target of any
shape (random weights included) decodes speculatively at a chosen acceptance.
(Recording, building and calibrating it: kdj/replay.py.)

Table: each recorded position p of a continuation g (g[j] sits at p = prompt length + j)
gives one entry, key (p, the last CONTEXT generated tokens up to g[j]) -> g[j + 1], hashed
to two uint32 words; entries sorted by the first word, the second checks a hit.

Draft: from a row's root (its newest token at position L) walk the table for block_size - 1
depths along the recorded tokens. Each depth proposes the recorded token, or, with
probability `corrupt`, another one; the choice is a hash of the depth's key and `seed`, so a
context is corrupted or not whatever the batch, method or pool slot (runs are reproducible).
A context the table lacks (a prompt never recorded, or a target that left its recording)
proposes a token drawn from its key's hash, which is almost never right.

Per-depth distribution (a chain reads the argmax, DDTree the top-K, auto's forecast the
probabilities): the proposal q = clip(1 - corrupt, Q_MIN, Q_MAX) (it is right with
probability about 1 - corrupt); the runner-up (1 - q) / 2, which is the recorded token with
probability RUNNER_UP when the proposal is a corruption (a near miss a tree's sibling can
recover, as with a real drafter), else a hashed token; two more hashed tokens (1 - q) / 4
and (1 - q) / 8; every token left (1 - q) / 8 spread evenly.

The key holds generated tokens only (the loop keeps a row's emitted tokens, `state.out`, not
its prompt): two recorded prompts of one length whose continuations begin alike share their
first keys, and the first one recorded wins. The drafter reads tokens and positions only,
never the target's hidden states (it takes in no context: `add_context` keeps nothing), and
verification decides every token, as with any drafter.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj import cache as kvc
from kdj.config import ModelConfig
from kdj.models.drafter import DrafterConfig

CONTEXT = 4  # generated tokens in a key, beside the position
Q_MIN, Q_MAX = 0.4, 0.98  # the proposal's probability: above the runner-up's, below 1
RUNNER_UP = 0.5  # chance a corrupted depth keeps the recorded token second
CANDIDATES = 4  # proposal, runner-up, two more
KEY_SALTS = (0x9E3779B9, 0x85EBCA6B)  # the two words of a key
CORRUPT_SALT, RUNNER_SALT, MISS_SALT = 0xC0, 0xC1, 0xC2  # one draw each from a key


def mix(x):
    """lowbias32: a uint32 -> uint32 bijection in which every input bit moves every output bit."""
    x = jnp.asarray(x, jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def context_keys(positions, window):
    """positions [...] int32 (the window's last token's), window [..., CONTEXT] int32 (-1:
    before the first generated token) -> the key's two uint32 words, each [...]."""
    words = []
    for salt in KEY_SALTS:
        h = mix(jnp.asarray(positions).astype(jnp.uint32) ^ jnp.uint32(salt))
        for i in range(window.shape[-1]):
            h = mix(h ^ (window[..., i] + 1).astype(jnp.uint32))
        words.append(h)
    return words


def draw(key, seed, salt: int):
    """A uint32 draw from a key word [...], the drafter's seed and a salt."""
    return mix(key ^ mix(seed ^ jnp.uint32(salt)))


def uniform(key, seed, salt: int):
    return draw(key, seed, salt).astype(jnp.float32) / np.float32(2**32)


def build_table(prompt_lens, continuations):
    """(keys, checks, next tokens) numpy arrays, sorted by key, one entry per distinct
    recorded context (the first recorded continuation wins a repeated one)."""
    positions, windows, nexts = [], [], []
    for P, g in zip(prompt_lens, continuations):
        g = np.asarray(g, np.int32)
        if len(g) < 2:
            continue
        padded = np.concatenate([np.full(CONTEXT - 1, -1, np.int32), g[:-1]])
        windows.append(np.lib.stride_tricks.sliding_window_view(padded, CONTEXT))
        positions.append(P + np.arange(len(g) - 1, dtype=np.int32))
        nexts.append(g[1:])
    if not nexts:
        raise ValueError("the recording has no continuation of 2 tokens or more: nothing to "
                         "replay (record with max_new_tokens >= 2)")  # fmt: skip
    keys, checks = (np.asarray(w) for w in context_keys(np.concatenate(positions),
                                                        np.concatenate(windows)))  # fmt: skip
    order = np.lexsort((checks, keys))  # stable: recording order among equal keys
    keys, checks, nexts = keys[order], checks[order], np.concatenate(nexts)[order]
    first = np.ones(len(keys), bool)
    first[1:] = (keys[1:] != keys[:-1]) | (checks[1:] != checks[:-1])
    return keys[first], checks[first], nexts[first]


def replay_config(target: ModelConfig, block_size: int) -> DrafterConfig:
    """A DrafterConfig the loop and the pool can carry: the target's width and vocabulary
    (kdj.handles.check_pair), one tap (layer 0, never read) and a one-layer, one-value
    context cache (nothing is written to it); model_type "replay" keeps tuned costs apart."""
    layers = target.replace(family="llama", model_type="replay", num_layers=1, num_heads=1,
                            num_kv_heads=1, head_dim=1, intermediate_size=1, qk_norm=False,
                            n_routed_experts=0, first_k_dense_replace=0)  # fmt: skip
    return DrafterConfig(layers=layers, block_size=block_size, mask_token_id=0,
                         target_layer_ids=(0,), num_target_layers=target.num_layers)  # fmt: skip


class ReplayDrafter(nnx.Module):
    """Benchmarks' stand-in drafter (see the module's docstring). kdj/decode/step.py `draft`
    calls `replay` instead of a DFlash drafter's layers."""

    def __init__(self, cfg: DrafterConfig, table, corrupt: float, seed: int = 0):
        keys, checks, nexts = table
        self.cfg = cfg
        self.keys = nnx.Variable(jnp.asarray(keys, jnp.uint32))
        self.checks = nnx.Variable(jnp.asarray(checks, jnp.uint32))
        self.next_tokens = nnx.Variable(jnp.asarray(nexts, jnp.int32))
        # arrays, not config: a new rate or seed reuses every compiled program
        self.corrupt = nnx.Variable(jnp.float32(corrupt))
        self.seed = nnx.Variable(jnp.uint32(seed))
        self.selector = None  # no DFlash2 walk: the chain is the argmax

    def add_context(self, feats, start, cache: kvc.KVCache) -> kvc.KVCache:
        """Takes in nothing: the replay never reads the target's features."""
        return cache

    def lookup(self, key, check):
        """The recorded next token of each key [B]; a hashed token where none was recorded."""
        keys = self.keys[...]
        i = jnp.clip(jnp.searchsorted(keys, key), 0, keys.shape[0] - 1)
        hit = (keys[i] == key) & (self.checks[...][i] == check)
        V = self.cfg.layers.vocab_size
        miss = (draw(key, self.seed[...], MISS_SALT) % V).astype(jnp.int32)
        return jnp.where(hit, self.next_tokens[...][i], miss)

    def candidates(self, key, recorded):
        """[B, CANDIDATES] tokens of one depth, most probable first."""
        V, seed = self.cfg.layers.vocab_size, self.seed[...]

        def other(i):  # a token other than the recorded one
            return (recorded + 1 + (draw(key, seed, i) % (V - 1)).astype(jnp.int32)) % V

        corrupted = uniform(key, seed, CORRUPT_SALT) < self.corrupt[...]
        kept = corrupted & (uniform(key, seed, RUNNER_SALT) < RUNNER_UP)
        proposal = jnp.where(corrupted, other(1), recorded)
        runner_up = jnp.where(kept, recorded, other(2))
        return jnp.stack([proposal, runner_up, other(3), other(4)], axis=-1)

    def replay(self, out, n, lengths, k: int):
        """Draft logits [B, k - 1, V] float32 for rows whose emitted tokens are out[b, :n[b]]
        (the last of them the root, at position lengths[b])."""
        B, N = out.shape
        at = n[:, None] - CONTEXT + jnp.arange(CONTEXT)
        window = jnp.take_along_axis(out, jnp.clip(at, 0, N - 1), axis=1)
        window = jnp.where(at >= 0, window, -1)
        position, depths = lengths, []
        for _ in range(k - 1):
            key, check = context_keys(position, window)
            recorded = self.lookup(key, check)
            depths.append(self.candidates(key, recorded))
            # the walk follows the recording, not the proposal: depths are marginals
            window = jnp.concatenate([window[:, 1:], recorded[:, None]], axis=1)
            position = position + 1
        return self.distribution(jnp.stack(depths, axis=1))

    def distribution(self, cands):
        """Candidates [B, L, CANDIDATES] -> logits [B, L, V] (log-probabilities)."""
        B, L, _ = cands.shape
        V = self.cfg.layers.vocab_size
        q = jnp.clip(1.0 - self.corrupt[...], Q_MIN, Q_MAX)
        mass = [q, (1 - q) / 2, (1 - q) / 4, (1 - q) / 8]
        logits = jnp.full((B, L, V), jnp.log((1 - q) / 8 / V), jnp.float32)
        b, d = jnp.arange(B)[:, None], jnp.arange(L)[None]
        for i in reversed(range(CANDIDATES)):  # the proposal last: it wins a collision
            logits = logits.at[b, d, cands[..., i]].set(jnp.log(mass[i]))
        return logits
