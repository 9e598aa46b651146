"""bench/multi_gpu.py (the multi-GPU mesh comparison, ready for a multi-GPU host) runs end to
end on the 8 virtual CPU devices with a tiny MoE config: every mesh gives the first mesh's
tokens for AR, DFlash and DDTree. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TINY = """
model_type: deepseek_v3
vocab_size: 64
hidden_size: 64
intermediate_size: 96
moe_intermediate_size: 32
num_hidden_layers: 2
num_attention_heads: 8
num_key_value_heads: 8
q_lora_rank: null
kv_lora_rank: 32
qk_nope_head_dim: 16
qk_rope_head_dim: 8
v_head_dim: 16
n_routed_experts: 8
n_shared_experts: 1
num_experts_per_tok: 2
first_k_dense_replace: 1
max_position_embeddings: 2048
"""


def test_multi_gpu_script_on_virtual_devices(tmp_path, monkeypatch):
    bench = Path(__file__).resolve().parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))  # the script imports its neighbours, as when run
    path = bench / "multi_gpu.py"
    spec = importlib.util.spec_from_file_location("multi_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "tiny.yaml").write_text(TINY)
    out = tmp_path / "multi.json"
    script.main(["--model", str(tmp_path / "tiny.yaml"), "--batches", "2", "--prompt-len", "5",
                 "--new", "8", "--block", "4", "--budget", "4", "--drafter-layers", "1",
                 "--repeats", "1", "--dtype", "float32", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["mesh"] for r in rows] == ["tp", "ep", "ep_dp_attn"]
    for r in rows:
        for m in ("ar", "dflash", "ddtree"):
            assert r[m]["same_tokens_as_first_mesh"], (r["mesh"], m)
        assert r["split"]["ddtree"]["moe_or_mlp_s"] > 0
