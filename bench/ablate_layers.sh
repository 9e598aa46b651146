#!/usr/bin/env bash
# Layer-count ablation of the SmolLM2-135M-Instruct DFlash drafter on one GPU, in one call:
# for each depth, `kdj train-drafter --config configs/train/smollm2-b16-ablate.yaml
# --num-layers N` from random weights on the same regenerated data for the same steps, then
# its held-out DFlash tau (T=0, 32 ShareGPT prompts x 128 tokens: summary.json's final_eval).
# One JSON line per depth goes to OUT/ablation.jsonl (layers, parameters, tau, train seconds;
# or the error, and the next depth still runs); the drafters stay on the machine
# ($HOME/kdj-ablate/L*) and do not come back.
#
# Time: per depth ~15 s target load, ~25 s compile, the steps (4 layers: ~14 steps/s), ~30 s
# export + held-out evaluation. 2/4/6 layers x 1,000 steps fit one 10-minute call.
#
# Usage, from the repository root on the GPU machine:
#   bench/ablate_layers.sh --target GGUF --data DIR --prompts DIR --out OUT
#       [--layers "2 4 6"] [--steps 1000]
#   --data     folder of data.tar.gz.part* from an earlier training call (run 3's responses:
#              .traincache/regen-all-turns), unpacked once and shared by every depth
#   --prompts  folder with prompts.npz + eval_prompts.json of the same data settings
#              (.traincache/data-turns-all)
set -euo pipefail
TARGET= DATA= PROMPTS= OUT= LAYERS="2 4 6" STEPS=1000
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target) TARGET=$2 ;;
    --data) DATA=$2 ;;
    --prompts) PROMPTS=$2 ;;
    --out) OUT=$2 ;;
    --layers) LAYERS=$2 ;;
    --steps) STEPS=$2 ;;
    *) echo "unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
: "${TARGET:?--target is required}" "${DATA:?--data is required}" "${PROMPTS:?--prompts is required}" "${OUT:?--out is required}"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
ROOT=$HOME/kdj-ablate
mkdir -p "$ROOT/data" "$OUT"
cat "$DATA"/data.tar.gz.part* | tar -xzf - -C "$ROOT/data"
cp "$PROMPTS"/prompts.npz "$PROMPTS"/eval_prompts.json "$ROOT/data/"
for L in $LAYERS; do
  RUN=$ROOT/L$L
  rm -rf "$RUN" && mkdir -p "$RUN/data"
  ln -s "$ROOT"/data/* "$RUN/data/"  # read-only shards and prompts, shared
  python -m kdj.cli train-drafter --config configs/train/smollm2-b16-ablate.yaml \
    --target "$TARGET" --out-dir "$RUN" --steps "$STEPS" --num-layers "$L" 2>&1 \
    | tr '\r' '\n' | grep -v -e 'tensor/s' -e 'step/s' || true
  python - "$RUN" "$L" >> "$OUT/ablation.jsonl" <<'PY' || true
import json, math, sys
from pathlib import Path
from safetensors import safe_open
run, layers = Path(sys.argv[1]), int(sys.argv[2])
if not (run / "summary.json").exists():
    print(json.dumps({"layers": layers, "error": "no summary.json: training failed (see log)"}))
    sys.exit(0)
s = json.loads((run / "summary.json").read_text())
with safe_open(str(run / "drafter" / "model.safetensors"), "numpy") as f:  # shapes only (bf16)
    params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
print(json.dumps({"layers": layers, "parameters": int(params), "steps": s["steps"],
                  "train_s": s["train_s"], "held_out_tau": s["final_eval"]["tau"],
                  "eval_tokens_per_s": s["final_eval"]["tokens_per_s"]}))
PY
  tail -1 "$OUT/ablation.jsonl"
done
