"""Multi-host: the same code on 2 processes x 4 CPU devices through jax.distributed (JAX's own
runtime, one global 8-device mesh) gives the same tokens as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import kdj
from tests.hf_models import build

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    build("deepseek_v3", tmp_path / "ckpt", vocab_size=16, num_attention_heads=8,
          num_key_value_heads=8)  # fmt: skip
    single = kdj.load_target(tmp_path / "ckpt", dtype="float32")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    want = kdj.generate(single, prompts, method="ar", max_new_tokens=16, stop_tokens=[]).tokens
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}  # fmt: skip
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), port, str(i), str(tmp_path / "ckpt"),
                          str(tmp_path / f"out{i}.json")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    for i in range(2):
        got = json.loads((tmp_path / f"out{i}.json").read_text())
        assert got["tokens"] == want, f"process {i}"
