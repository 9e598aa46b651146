"""kdj's DFlash drafter against numbers produced by the published reference implementation.

The fixtures in tests/fixtures/dflash_tiny*/ (see their README.md) hold a tiny drafter in the
published checkpoint format and, for two consecutive draft steps of the reference inference
loop, the context features fed, the block, the drafter's final hidden states, draft logits and
its context K/V cache after cropping. They were produced by running the public z-lab/dflash
reference code (float32, CPU) outside this repository; no reference code is part of kdj.
This test loads the checkpoint with kdj.load_drafter and replays the two steps.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.cache import init_cache

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_dir(name, tmp_path) -> Path:
    src = FIXTURES / name
    if (src / "model.safetensors").exists():
        return src
    dst = tmp_path / name  # the SWA variant shares dflash_tiny's weights
    shutil.copytree(src, dst)
    shutil.copy(FIXTURES / "dflash_tiny" / "model.safetensors", dst)
    return dst


@pytest.mark.parametrize("name, tol", [("dflash_tiny", 1e-5), ("dflash_tiny_swa", 1e-5)])
def test_two_draft_steps_match_reference(name, tol, tmp_path):
    ref = np.load(FIXTURES / name / "reference.npz")
    drafter = kdj.load_drafter(fixture_dir(name, tmp_path), dtype="float32").model
    embed, lm_head = ref["embed_tokens"], ref["lm_head"]
    cache = init_cache(drafter.cfg.layers, 1, 32, jnp.float32)
    for step in (1, 2):
        p = f"step{step}_"
        ctx_pos = ref[p + "ctx_positions"]
        cache = drafter.add_context(jnp.asarray(ref[p + "ctx_features"])[None],
                                    jnp.asarray(ctx_pos[:1]), cache)  # fmt: skip
        cache = cache.with_lengths(jnp.asarray([ctx_pos[-1] + 1]))
        block = embed[ref[p + "block_ids"]][None]
        h = np.asarray(drafter(jnp.asarray(block), jnp.asarray(ref[p + "block_positions"])[None],
                               cache))[0]  # fmt: skip
        np.testing.assert_allclose(h, ref[p + "hidden"], atol=tol, rtol=tol)
        logits = h[1:] @ lm_head.T
        np.testing.assert_allclose(logits, ref[p + "draft_logits"], atol=10 * tol, rtol=tol)
        np.testing.assert_array_equal(logits.argmax(-1), ref[p + "draft_tokens"])
        n = ctx_pos[-1] + 1  # the reference's cache after cropping holds positions 0 .. n-1
        for layer in range(drafter.cfg.layers.num_layers):
            k = np.asarray(cache.k[layer])[0, :, :n]  # [KVH, n, hd], as the reference keeps it
            v = np.asarray(cache.v[layer])[0, :, :n]
            np.testing.assert_allclose(k, ref[p + "cache_k_after_crop"][layer], atol=tol, rtol=tol)
            np.testing.assert_allclose(v, ref[p + "cache_v_after_crop"][layer], atol=tol, rtol=tol)
