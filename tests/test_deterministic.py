"""Deterministic mode (kdj.generate(deterministic=True)): in bf16, tokens depend only on the
target, the prompt, the sampling parameters and the prompt's seed; not on the method, the
drafter, the batch or the run. Tiny dense and MLA/MoE targets with random drafters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.cache import init_cache
from kdj.config import ModelConfig
from kdj.kernels import KernelPolicy
from kdj.models import layers
from kdj.models.transformer import build_model
from tests.test_adaptive import switching  # noqa: F401 (fixture: auto visits every branch)
from tests.test_speculative import make_drafter
from tests.test_tree_attention import path_of

VOCAB = 16
CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256},
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": 32,
                    "intermediate_size": 64, "moe_intermediate_size": 16,
                    "num_hidden_layers": 1, "num_attention_heads": 4, "n_routed_experts": 8,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
                    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 256},
}  # fmt: skip
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5]]  # ragged
REMIX = [1, 2, 0]  # the same prompts in other rows, beside other neighbours
AUTO = dict(method="auto", menu=["none", "chain", "tree3"])
METHODS = {  # the full set on the dense target; the MLA/MoE one (slower to compile) a part
    "llama": [dict(method="dflash"), dict(method="ddtree", tree_budget=3),
              dict(method="ddtree", tree_budget=9), AUTO],
    "deepseek_v3": [dict(method="ddtree", tree_budget=9), AUTO],
}  # fmt: skip
RUN = dict(max_new_tokens=[14, 9, 12], stop_tokens=[], cache_size=64, deterministic=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    cfg = ModelConfig.from_hf(CONFIGS[request.param])
    target = kdj.Target.from_model(build_model(cfg, jnp.bfloat16, seed=1))
    return request.param, target, make_drafter(target, layers=1, block=4, seed=2)


def remixed(tokens):
    return [tokens[i] for i in REMIX]


def rows_match_steps(target, k=5) -> bool:
    """Whether a k-token pass gives each row the same logits, bitwise, as k 1-token passes
    (over a ragged committed prefix), and a row alone the same as inside the batch."""
    model, cfg, dtype = target.model, target.cfg, target.dtype
    B, P = 3, 6
    toks = jax.random.randint(jax.random.key(0), (B, P + k), 0, cfg.vocab_size)
    lens = jnp.asarray([6, 2, 4], jnp.int32)
    run = jax.jit(lambda t, s, c: model(t, s, c)[:2])

    def prefix(rows):
        cache = init_cache(cfg, len(rows), 32, dtype)
        return run(toks[rows, :P], jnp.zeros(len(rows), jnp.int32), cache)[1]

    wide, _ = run(toks[:, P:], lens, prefix([0, 1, 2]))
    cache, steps = prefix([0, 1, 2]), []
    for i in range(k):
        logits, cache = run(toks[:, P + i : P + i + 1], lens + i, cache)
        steps.append(logits[:, 0])
    alone, _ = run(toks[1:2, P:], lens[1:2], prefix([1]))
    return bool((wide == jnp.stack(steps, 1)).all() and (alone[0] == wide[1]).all())


TREE_PARENTS = [-1, 0, 0, 1, 0, 2, 3]  # a random-shaped tree: node 0 the root, parents first


def tree_rows_match_paths(target) -> bool:
    """Whether one pass over a tree gives each node the same logits, bitwise, as a plain
    decode of the node's path from the root (over a ragged committed prefix)."""
    model, cfg, dtype = target.model, target.cfg, target.dtype
    B, P, T = 3, 6, len(TREE_PARENTS)
    toks = jax.random.randint(jax.random.key(1), (B, P + T), 0, cfg.vocab_size)
    lens = jnp.asarray([6, 2, 4], jnp.int32)
    paths = [path_of(TREE_PARENTS, t) for t in range(T)]
    tree = jnp.zeros((B, T, T), bool)
    for t, path in enumerate(paths):
        tree = tree.at[:, t, jnp.asarray(path)].set(True)
    depth = jnp.asarray([len(path) - 1 for path in paths], jnp.int32)
    run = jax.jit(lambda t, s, c, **kw: model(t, s, c, **kw)[:2])
    prefix = run(toks[:, :P], jnp.zeros(B, jnp.int32), init_cache(cfg, B, 32, dtype))[1]
    nodes = toks[:, P:]
    wide, _ = run(nodes, lens, prefix, positions=lens[:, None] + depth, tree=tree)
    for t, path in enumerate(paths):
        cache = prefix
        for i, node in enumerate(path):
            logits, cache = run(nodes[:, node : node + 1], lens + i, cache)
        if not (logits[:, 0] == wide[:, t]).all():
            return False
    return True


def width_dependent_matmul(x, w, kernels):
    """A matmul whose rounding depends on how many rows are in flight: two bf16 halves of K
    summed when there are several rows (as a split-K chosen by M would)."""
    if x.shape[-2] == 1:
        return jnp.tensordot(x, w, axes=1)
    h = x.shape[-1] // 2
    return jnp.tensordot(x[..., :h], w[:h], axes=1) + jnp.tensordot(x[..., h:], w[h:], axes=1)


def test_verify_rows_equal_decode_steps_and_the_check_catches_a_width_dependent_op(
    pair, monkeypatch
):
    _, target, _ = pair
    det = target.with_kernels(target.cfg.kernels.as_deterministic())
    assert rows_match_steps(det)
    assert tree_rows_match_paths(det)
    monkeypatch.setattr(layers, "matmul", width_dependent_matmul)
    assert not rows_match_steps(det)


def test_fixed_tiles_and_splits_keep_rows_equal(pair):
    """Deterministic mode where Pallas runs (the GPU): matmuls and logits on fixed tiles
    (layers.fixed_tile_matmul), attention with splits fixed from slot 0, one node a query
    tile or several; here in Pallas' interpreter, on a target whose heads the attention
    kernel takes."""
    family, _, _ = pair
    if family != "llama":
        pytest.skip("the dense projections and GQA attention are the llama family's")
    shape = dict(hidden_size=128, intermediate_size=128, head_dim=32)
    cfg = ModelConfig.from_hf(dict(CONFIGS["llama"], **shape))
    target = kdj.Target.from_model(build_model(cfg, jnp.bfloat16, seed=1))
    policy = KernelPolicy(dense_gemv="pallas", attention="pallas", deterministic=True,
                          fixed_split_inputs=64)  # every matmul in 2 K slices  # fmt: skip
    assert policy.fixed_tiles() and not policy.replace(deterministic=False).fixed_tiles()
    assert policy.fixed_splits(128, 128) == 2 and policy.fixed_splits(128, cfg.vocab_size) == 2
    assert policy.attention_kernel_for(1) and policy.attention_config(1)["fixed_split"]
    assert rows_match_steps(target.with_kernels(policy))
    assert tree_rows_match_paths(target.with_kernels(policy))
    packed = policy.replace(attention_nodes_per_tile=8)  # tree nodes sharing query tiles
    assert packed.attention_config(4)["nodes_per_tile"] == 8
    assert tree_rows_match_paths(target.with_kernels(packed))
    x = jax.random.normal(jax.random.key(0), (70, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 200), jnp.float32)
    assert jnp.allclose(layers.fixed_tile_matmul(x[:, :40], w[:40]), x[:, :40] @ w[:40],
                        atol=1e-4, rtol=1e-4)  # K padded to 48  # fmt: skip
    assert jnp.allclose(layers.fixed_tile_matmul(x, w), x @ w, atol=1e-4, rtol=1e-4)
    x, w = x.astype(jnp.bfloat16), jnp.concatenate([w, w, -w]).astype(jnp.bfloat16)[:, :130]
    x = jnp.concatenate([x, x[:, ::-1], x], axis=1)  # K = 192: 3 slices of one K tile
    split = layers.fixed_tile_matmul(x, w, splits=3)
    assert jnp.allclose(split, x.astype(jnp.float32) @ w.astype(jnp.float32), atol=1e-2)
    for n in (1, 5, 64, 65):  # a row's bits whatever the rows beside it
        np.testing.assert_array_equal(layers.fixed_tile_matmul(x[:n], w, splits=3), split[:n])


def xla_order_dependent(jaxpr) -> list[str]:
    """The ops of a jaxpr outside Pallas kernels (nested jaxprs included) whose float result
    depends on an order XLA picks per shape: matmuls and float sums."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        name = eqn.primitive.name
        floats = any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars)
        if name == "dot_general" or (floats and name in ("reduce_sum", "cumsum")):
            found.append(f"{name}{[v.aval for v in eqn.invars]}")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += xla_order_dependent(sub)
    return found


@pytest.mark.parametrize("family", list(CONFIGS))
def test_no_op_of_a_deterministic_gpu_forward_picks_its_order_by_shape(family):
    """With the GPU's policy in deterministic mode no matmul is left to XLA (whose GEMM is
    picked per shape) in a decode or a verify pass: projections, logits, attention, MoE; nor
    any float sum (XLA's reduction order follows the row count): norms, the MoE's combine."""
    shapes = {"llama": dict(hidden_size=64, head_dim=16),
              "deepseek_v3": dict(hidden_size=64, kv_lora_rank=32, qk_rope_head_dim=16,
                                  qk_nope_head_dim=16, v_head_dim=16)}  # fmt: skip
    cfg = ModelConfig.from_hf(dict(CONFIGS[family], **shapes[family]))
    model = build_model(cfg, jnp.bfloat16, seed=1)
    layers.set_kernels(model, KernelPolicy.default("gpu").as_deterministic())
    for T in (1, 4):
        toks, start = jnp.zeros((2, T), jnp.int32), jnp.zeros(2, jnp.int32)
        cache = init_cache(model.cfg, 2, 64, jnp.bfloat16)
        jaxpr = jax.make_jaxpr(lambda t, s, c: model(t, s, c)[0])(toks, start, cache)
        assert xla_order_dependent(jaxpr.jaxpr) == [], (family, T)


def test_fixed_order_sum_adds_in_its_pairwise_tree():
    """fixed_order_sum is the documented tree (zero padding, halves added), bit for bit."""
    x = np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32)
    ref = np.concatenate([x, np.zeros((3, 1024 - 576), np.float32)], -1)
    while ref.shape[-1] > 1:
        ref = ref[:, : ref.shape[-1] // 2] + ref[:, ref.shape[-1] // 2 :]
    got = np.asarray(layers.fixed_order_sum(jnp.asarray(x)))
    assert got.shape == (3, 1) and (got.view(np.uint32) == ref.view(np.uint32)).all()
    np.testing.assert_allclose(np.asarray(layers.fixed_order_sum(jnp.asarray(x.T), 0)).T, ref)


def check_all_methods(family, target, drafter, ar, **kw):
    """Every method's tokens equal `ar` in the batch, and some drafts were accepted."""
    accepted = 0
    for spec in METHODS[family]:
        out = kdj.generate(target, PROMPTS, drafter=drafter, **spec, **kw, **RUN)
        assert out.tokens == ar.tokens, spec
        accepted += sum(out.stats["acceptance_histogram"][1:])
    assert accepted > 0, "no draft was ever accepted: the comparison tests nothing"


def test_greedy_tokens_do_not_depend_on_method_batch_or_run(pair, switching):  # noqa: F811
    family, target, drafter = pair
    ar = kdj.generate(target, PROMPTS, method="ar", **RUN)
    assert kdj.generate(target, PROMPTS, method="ar", **RUN).tokens == ar.tokens  # run to run
    mixed = dict(RUN, max_new_tokens=remixed(RUN["max_new_tokens"]))
    assert kdj.generate(target, remixed(PROMPTS), method="ar", **mixed).tokens == remixed(ar.tokens)
    check_all_methods(family, target, drafter, ar)
    # a prompt alone (row 0) equals its row inside the batch (row 1), speculative too
    alone = dict(RUN, max_new_tokens=RUN["max_new_tokens"][1])
    out = kdj.generate(target, [PROMPTS[1]], drafter=drafter, **METHODS[family][-2], **alone)
    assert out.tokens == [ar.tokens[1]]


def test_sampled_tokens_are_ar_samples_for_each_prompts_seed(pair, switching):  # noqa: F811
    family, target, drafter = pair
    if family != "llama":
        pytest.skip("sampling keys do not depend on the family; the MLA/MoE rows: greedy tests")
    seeds, sampled = [11, 12, 13], dict(temperature=1.0, top_p=0.9)
    ar = kdj.generate(target, PROMPTS, method="ar", seed=seeds, **sampled, **RUN)
    check_all_methods(family, target, drafter, ar, seed=seeds, **sampled)
    # a prompt's samples follow its seed, not its row: remixed, or one int for every prompt
    mixed = dict(RUN, max_new_tokens=remixed(RUN["max_new_tokens"]), **sampled)
    out = kdj.generate(target, remixed(PROMPTS), method="ar", seed=remixed(seeds), **mixed)
    assert out.tokens == remixed(ar.tokens)
    out = kdj.generate(target, PROMPTS, method="ar", seed=12, **sampled, **RUN)
    assert out.tokens[1] == ar.tokens[1] and out.tokens[0] != ar.tokens[0]
    greedy = kdj.generate(target, PROMPTS, method="ar", **RUN)
    assert ar.tokens != greedy.tokens  # it does sample


def test_default_mode_samples_do_not_depend_on_the_row(pair):
    """Per-prompt seeds: a prompt's samples are its own in the default mode too; one seed
    for the batch: each row draws its own stream (equal prompts differ)."""
    family, target, _ = pair
    if family != "llama":
        pytest.skip("the sampling keys do not depend on the family")
    kw = dict(method="ar", temperature=1.0, max_new_tokens=10, stop_tokens=[], cache_size=64)
    batch = kdj.generate(target, PROMPTS, seed=[4, 5, 6], **kw).tokens
    assert kdj.generate(target, remixed(PROMPTS), seed=[5, 6, 4], **kw).tokens == remixed(batch)
    same = kdj.generate(target, [PROMPTS[1]] * 3, seed=5, **kw).tokens
    assert same[0] != same[1]


def test_bad_deterministic_and_seed_arguments(pair):
    _, target, _ = pair
    kw = dict(method="ar", max_new_tokens=2)
    with pytest.raises(TypeError, match="deterministic"):
        kdj.generate(target, PROMPTS, deterministic="yes", **kw)
    with pytest.raises(ValueError, match="seed has 2 entries for 3 prompts"):
        kdj.generate(target, PROMPTS, seed=[1, 2], **kw)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        kdj.generate(target, PROMPTS, seed=-1, **kw)


def test_deterministic_programs_round_every_bf16_op_as_written():
    """XLA may keep a fused bf16 intermediate in float32 (excess precision), and what fuses
    depends on the shapes: deterministic programs compile without it, so they equal the same
    ops rounded one by one; with it (the default) the same program rounds differently."""
    from kdj.handles import Executables

    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(4096), jnp.bfloat16) for _ in range(2))
    f = jax.jit(lambda a, b: (a * b + a * 3).astype(jnp.float32))
    one_by_one = ((a * b) + (a * 3)).astype(jnp.float32)  # eager: each op its own program
    exe = Executables()
    det = exe.get(f, a, b, options=KernelPolicy().as_deterministic().compiler_options())
    default = exe.get(f, a, b, options=KernelPolicy().compiler_options())
    assert det is not default  # the options are part of the key
    np.testing.assert_array_equal(det(a, b), one_by_one)
    assert not np.array_equal(default(a, b), one_by_one)
