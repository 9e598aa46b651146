"""One process of the 2-process x 4-CPU-device test (tests/test_multihost.py starts two).

Usage: python tests/multihost_worker.py PORT PROCESS_ID CHECKPOINT_DIR OUT_JSON
Joins JAX's distributed runtime on localhost, builds one 8-device mesh spanning both
processes (expert=4 x model=2 over ep rules), loads the checkpoint onto it and generates.
"""

from __future__ import annotations

import json
import sys

import jax

port, pid, ckpt, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()

import kdj  # noqa: E402

target = kdj.load_target(ckpt, dtype="float32", mesh={"mesh": {"expert": 4, "model": 2},
                                                      "rules": "ep"})  # fmt: skip
prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
res = kdj.generate(target, prompts, method="ar", max_new_tokens=16, stop_tokens=[])
with open(out, "w") as f:
    json.dump({"process": pid, "tokens": res.tokens}, f)
jax.distributed.shutdown()
