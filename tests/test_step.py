"""Each piece of the decode step alone (kdj/decode/step.py) on a tiny model, checked against
the full-sequence target pass; and the target's executable cache. (Each piece is jitted
here only because that is faster than running it op by op.)"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdj
from kdj.cache import init_cache
from kdj.config import ModelConfig
from kdj.decode import loop
from kdj.decode import tree as trees
from kdj.decode.state import Plan, init_state
from kdj.decode.step import accept, commit, draft, plain_step, propose, verify
from kdj.handles import Executables
from kdj.models.drafter import DrafterConfig, build_drafter
from kdj.models.transformer import build_model, full_sequence

PROMPTS = [[3, 1, 4, 1, 5], [9, 2]]
K = 4  # block size: 3 drafts


@pytest.fixture(scope="module")
def models():
    cfg = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 12, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 256,
    })  # fmt: skip
    target = kdj.Target.from_model(build_model(cfg, jnp.float32, seed=1))
    layers = cfg.replace(model_type="qwen3", num_layers=1, qk_norm=True)
    dcfg = DrafterConfig(layers=layers, block_size=K, mask_token_id=11, target_layer_ids=(0, 1),
                         num_target_layers=2)  # fmt: skip
    return target, kdj.Drafter.from_model(build_drafter(dcfg, jnp.float32, seed=2))


def start(target, drafter):
    """The state after prefill of PROMPTS, greedy, cache of 32 slots."""
    B, P = len(PROMPTS), max(map(len, PROMPTS))
    tokens = jnp.asarray([p + [0] * (P - len(p)) for p in PROMPTS], jnp.int32)
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    one, key = jnp.float32(1.0), jax.random.split(jax.random.key(0), B)
    dg = ds = dcache = None
    if drafter is not None:
        dg, ds = drafter.graphdef, drafter.state
        dcache = init_cache(drafter.cfg.layers, B, 32, jnp.float32)
    pre = loop.prefill(target.graphdef, target.state, dg, ds, tokens, lens,
                       init_cache(target.cfg, B, 32, jnp.float32), dcache, key, one, one,
                       greedy=True)  # fmt: skip
    menu = (trees.DraftShape("chain", K - 1),) if drafter else ()
    plan = Plan(True, 8, K if drafter else 0, menu)
    width = target.cfg.hidden_size * 2
    stop_ids = jnp.full((B, 1), -1, jnp.int32)
    return init_state(pre, jnp.full((B,), 8), stop_ids, key, one, one, one, [0.0], plan, width)


def causal_logits(target, seq):
    """Full-sequence logits [len(seq), V] of the token list seq (padded to one length: the
    pass is causal, so the padding changes nothing before it, and compiles once)."""
    padded = jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32)
    return full_sequence(target.graphdef, target.state, padded)[0][0, : len(seq)]


def greedy_next(target, seq):
    """The target's argmax after the token list seq."""
    return int(jnp.argmax(causal_logits(target, seq)[-1]))


def test_plain_step_emits_the_target_argmax_and_advances_only_active_rows(models):
    target, _ = models
    state = start(target, None)
    first = np.asarray(state.last)
    assert first[0] == greedy_next(target, PROMPTS[0])
    state = dataclasses.replace(state, done=jnp.asarray([False, True]))
    after = jax.jit(lambda s: plain_step(target.model, s, greedy=True))(state)
    want = greedy_next(target, PROMPTS[0] + [int(first[0])])
    assert after.out[0, :2].tolist() == [first[0], want] and int(after.last[0]) == want
    assert after.tcache.lengths.tolist() == [len(PROMPTS[0]) + 1, len(PROMPTS[1])]
    assert after.n.tolist() == [2, 1] and after.out[1, 1] == 0 and int(after.step) == 1


def test_draft_gives_log_probs_and_ignores_queue_padding(models):
    target, drafter = models
    state = start(target, drafter)
    run = jax.jit(lambda s: draft(target.model, drafter.model, s, K))
    dist, after = run(state)
    lp = dist.logits - dist.lse[..., None]
    assert lp.shape == (2, K - 1, target.cfg.vocab_size)
    np.testing.assert_allclose(jax.nn.logsumexp(lp, axis=-1), 0.0, atol=1e-5)
    assert after.dcache.lengths.tolist() == state.dcache.lengths.tolist()  # commit moves it
    # nothing queued (n_pend = 0): whatever the queue's padding holds is never seen
    junk = jax.random.normal(jax.random.key(3), state.pending.shape)
    junk_dist, _ = run(dataclasses.replace(state, pending=junk))
    np.testing.assert_allclose(junk_dist.logits - junk_dist.lse[..., None], lp, atol=1e-5)


def test_propose_chain_is_the_argmax_and_a_tree_slices_the_largest(models):
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (2, K - 1, 12)), axis=-1)
    run = jax.jit(propose, static_argnums=0)
    lp = trees.Draft.of(lp)
    chain = run(trees.DraftShape("chain", K - 1), lp)
    assert chain["tokens"].tolist() == jnp.argmax(lp.logits, -1).tolist()
    full = run(trees.DraftShape("tree", 8), lp)
    small = run(trees.DraftShape("tree", 3), lp, full)
    alone = run(trees.DraftShape("tree", 3), lp)
    for name in ("tokens", "parent", "depth"):
        assert small[name].tolist() == alone[name].tolist()


def chain_of(tokens):
    """A chain tree over tokens [B, N] (what propose("chain") returns)."""
    lp = jax.nn.one_hot(jnp.asarray(tokens), 12) * 10.0
    return trees.chain_trees(trees.Draft.of(jax.nn.log_softmax(lp, -1)))


def test_verify_equals_the_causal_pass_over_root_and_chain(models):
    target, drafter = models
    state = start(target, drafter)
    drafts = [[7, 7, 2], [0, 5, 6]]
    tree = chain_of(drafts)
    taps = drafter.cfg.target_layer_ids
    got = jax.jit(lambda c, last, t: verify(target.model, c, last, t, taps))(
        state.tcache, state.last, tree
    )
    assert got.features.shape == (2, K, target.cfg.hidden_size * 2)
    assert got.valid.all()
    for b, prompt in enumerate(PROMPTS):
        seq = prompt + [int(state.last[b])] + drafts[b]
        want = causal_logits(target, seq)[len(prompt) :]
        np.testing.assert_allclose(got.logits[b], want, atol=1e-4)


def test_accept_and_commit_take_the_verified_prefix_plus_the_bonus(models):
    target, drafter = models
    state = start(target, drafter)
    model, taps = target.model, drafter.cfg.target_layer_ids
    verify_ = jax.jit(lambda c, last, t: verify(model, c, last, t, taps))
    accept_ = jax.jit(functools.partial(accept, block_size=K, greedy=True))
    commit_ = jax.jit(commit)
    # the target's own greedy continuation for two drafts, then a wrong third
    seqs = [p + [int(t)] for p, t in zip(PROMPTS, state.last)]
    good = [[greedy_next(target, s)] for s in seqs]
    good = [g + [greedy_next(target, s + g)] for s, g in zip(seqs, good)]
    bonus = [greedy_next(target, s + g) for s, g in zip(seqs, good)]
    wrong = [[*g, (greedy_next(target, s + g) + 1) % 12] for s, g in zip(seqs, good)]
    tree = chain_of(wrong)
    verified = verify_(state.tcache, state.last, tree)
    one = jnp.float32(1.0)
    args = (jax.random.split(jax.random.key(0), 2), one, one)
    acc = accept_(tree, verified, jnp.asarray([9, 1]), *args)
    assert acc.a.tolist() == [2, 1]  # row 1 is held to one draft by its limit
    assert acc.bonus.tolist() == [bonus[0], good[1][1]]
    assert acc.path[0, :3].tolist() == [0, 1, 2] and acc.size.tolist() == [K - 1, K - 1]

    after, count = commit_(state, verified.tcache, acc)
    L = [len(p) for p in PROMPTS]
    assert count.tolist() == [3, 2] and after.n.tolist() == [4, 3]
    assert after.tcache.lengths.tolist() == [L[0] + 3, L[1] + 2]
    assert after.dcache.lengths.tolist() == after.tcache.lengths.tolist()
    assert after.out[0, :4].tolist() == [int(state.last[0]), *good[0], bonus[0]]
    assert after.last.tolist() == [bonus[0], good[1][1]] and after.n_pend.tolist() == [3, 2]
    # a stop token among the drafts cuts the emitted tokens after it and ends the sequence
    stop = dataclasses.replace(state, stop_ids=jnp.asarray([[good[0][0]], [-1]], jnp.int32))
    cut, count = commit_(stop, verified.tcache, acc)
    assert count.tolist() == [1, 2] and cut.done.tolist() == [True, False]


def test_the_target_keeps_its_compiled_programs_bounded_and_clearable(models):
    target, _ = models
    kw = dict(method="ar", max_new_tokens=3, stop_tokens=[])
    a = kdj.generate(target, [[1, 2]], **kw).tokens
    n = len(target.executables)
    assert n == 2 and len(target.executables.compiled(loop.decode)) == 1  # prefill, the loop
    assert kdj.generate(target, [[1, 2]], **kw).tokens == a and len(target.executables) == n
    target.executables.clear()
    assert len(target.executables) == 0

    cache = Executables(capacity=2)
    f = jax.jit(lambda x: x + 1)
    two = cache.get(f, jnp.zeros(2))
    assert cache.get(f, jnp.zeros(2)) is two
    cache.get(f, jnp.zeros(3))
    cache.get(f, jnp.zeros(2))  # most recently used: the 3-vector goes first
    cache.get(f, jnp.zeros(4))
    assert len(cache) == 2 and cache.get(f, jnp.zeros(2)) is two


def test_programs_differ_by_graph_definition_not_only_by_array_shapes():
    """Two modules with the same (no) params and different static settings get two programs."""

    @jax.jit
    def scaled(graphdef, state, x):
        return x * nnx.merge(graphdef, state).rate

    scaled = jax.jit(scaled.__wrapped__, static_argnames=("graphdef",))
    cache = Executables()
    x = jnp.ones(3)
    outs = []
    for rate in (0.25, 0.5):
        g, s = nnx.split(nnx.Dropout(rate))
        outs.append(float(cache.get(scaled, g, s, x)(s, x)[0]))
    assert outs == [0.25, 0.5] and len(cache) == 2
