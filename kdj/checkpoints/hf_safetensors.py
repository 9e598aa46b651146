"""Hugging Face safetensors checkpoints: single file or sharded with model.safetensors.index.json.

The reader memory-maps each file and hands out one tensor at a time, so a checkpoint is never
held twice in host memory. It parses the safetensors header itself (8-byte little-endian
length + JSON) because numpy lacks float8 and the `safetensors` numpy API refuses it.
Quantised linears (FP8 block scales, INT4 compressed-tensors) come out dequantised, under the
plain `<name>.weight` key, so the rest of kdj only ever sees float tensors with HF names.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from kdj.quant import FP8_BLOCK, dequant_fp8, dequant_int4

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
# Companion tensors consumed together with their `.weight`; never yielded on their own.
AUX_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_shape", ".weight_zero_point")


class SafetensorsFile:
    """Lazy view of one .safetensors file: names, shapes and memory-mapped tensors."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("file shorter than its 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > path.stat().st_size - 8:
                    raise ValueError(f"header length {n} exceeds the file size")
                self.header = json.loads(f.read(n))
        except FileNotFoundError:
            raise FileNotFoundError(f"missing checkpoint shard: {path}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupt safetensors file {path}: {e}") from None
        self.header.pop("__metadata__", None)
        self.offset = 8 + n
        self.size = path.stat().st_size

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if self.offset + end > self.size or end - start != np.dtype(dtype).itemsize * int(
            np.prod(shape, dtype=np.int64)
        ):
            raise ValueError(f"corrupt safetensors file {self.path}: tensor {name} is truncated")
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.offset + start, shape=shape)


class HFCheckpoint:
    """A checkpoint directory: config.json + one or many .safetensors files."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if self.dir.is_file():
            raise ValueError(f"{self.dir} is a file: a checkpoint is a directory (config.json and "
                             "*.safetensors)")  # fmt: skip
        if not self.dir.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.dir}")
        self.config_path = self.dir / "config.json"
        if not self.config_path.exists():
            raise FileNotFoundError(f"{self.dir} has no config.json")
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"corrupt {index}: {e}") from None
            files = {name: self.dir / f for name, f in weight_map.items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.dir} has no *.safetensors files")
            files = {}
            for p in shards:
                for name in SafetensorsFile(p).keys():
                    files[name] = p
        self._where = files
        try:
            config = json.loads(self.config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"corrupt {self.config_path}: {e}") from None
        # not an object: ModelConfig.from_json says so when the config is parsed
        quant = (config.get("quantization_config") if isinstance(config, dict) else None) or {}
        self.fp8_block = int((quant.get("weight_block_size") or [FP8_BLOCK])[0])
        self._open: dict[Path, SafetensorsFile] = {}

    def names(self) -> list[str]:
        return list(self._where)

    def raw(self, name: str) -> np.ndarray:
        path = self._where[name]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        f = self._open[path]
        if name not in f.header:
            raise ValueError(f"index says {name} is in {path.name}, but that file lacks it")
        return f.get(name)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (HF name, float array) one at a time, dequantising FP8 / INT4 linears."""
        for name in self._where:
            if name.endswith(AUX_SUFFIXES):
                continue
            if name.endswith(".weight_packed"):
                base = name[: -len("_packed")]
                yield (
                    base,
                    dequant_int4(
                        self.raw(name), self.raw(base + "_scale"), self.raw(base + "_shape")
                    ),
                )
            elif name + "_scale_inv" in self._where:
                yield (
                    name,
                    dequant_fp8(self.raw(name), self.raw(name + "_scale_inv"), self.fp8_block),
                )
            else:
                yield name, self.raw(name)

    def __len__(self) -> int:
        return sum(not n.endswith(AUX_SUFFIXES) for n in self._where)
