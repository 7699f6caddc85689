#!/usr/bin/env bash
# bench/gpu_check.sh: the first run on a GPU node as a check, not a surprise. On a small corpus
# (Python's standard library), through launch.sh and the real deepspeed launcher:
#   bf16 at ZeRO 0, 1, 2 and 3 (2 ranks when the node has 2+ GPUs), each exported and loaded;
#   flash-attention 2 when transformers finds it; torch.compile; an exact resume.
# Prints one PASS/FAIL/SKIP line per check with tokens/s (and MFU where the run logs it), and
# exits 1 if any check failed.
#
#   bash bench/gpu_check.sh [--cpu] [--steps N] [--keep DIR]
#
#   --cpu       run the same checks on this machine's CPU (bf16 through DeepSpeed's CPU
#               accelerator; flash-attention is skipped); what CI runs
#   --steps N   optimizer steps per training check (default 20; 6 with --cpu)
#   --keep DIR  work in DIR and keep it (default: a temporary directory, removed at the end)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cpu=0 steps="" keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1; shift ;;
    --steps) steps=${2:?--steps needs a number}; shift 2 ;;
    --keep) keep=${2:?--keep needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: error: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -n "$steps" ] || steps=$([ "$cpu" = 1 ] && echo 6 || echo 20)
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: error: --steps $steps: a positive number" >&2; exit 2; }
PYTHON=${PYTHON:-python}
if [ -n "$keep" ]; then work=$keep; mkdir -p "$work"; else work=$(mktemp -d -t gpu_check.XXXXXX); trap 'rm -rf "$work"' EXIT; fi
cd "$here"
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

procs=1
if [ "$cpu" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${gpus:-0}" -ge 1 ] || { echo "gpu_check.sh: error: no GPU found (nvidia-smi); use --cpu to check on the CPU" >&2; exit 2; }
  [ "$gpus" -ge 2 ] && procs=2
fi

failed=0
result() {  # result PASS|FAIL|SKIP NAME DETAIL
  printf '%-4s %-24s %s\n' "$1" "$2" "$3"
  [ "$1" != FAIL ] || failed=1
}
figures() {  # tokens/s (and MFU) of a run, from its summary and last metrics line
  "$PYTHON" - "$1" <<'PY'
import json, sys
run = sys.argv[1]
s = json.load(open(f"{run}/summary.json"))
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
mfu = [r["perf/mfu"] for r in rows if r.get("perf/mfu") is not None]
print(f"{s['tokens_per_sec']:,.0f} tokens/s" + (f", MFU {100 * mfu[-1]:.1f}%" if mfu else ""))
PY
}
last_error() { grep -v '^\[20' "$1" | grep -E 'error|Error' | tail -1 | cut -c1-160; }

echo "gpu_check: $([ "$cpu" = 1 ] && echo "CPU" || echo "$procs GPU rank(s)"), $steps steps a run, in $work"
corpus=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
"$PYTHON" -m data_tools tokenizer --input "$corpus/json" "$corpus/email" --include '*.py' \
  --out "$work/tok" --vocab-size 4000 --overwrite >"$work/tok.log" 2>&1 || { result FAIL tokenizer "$(last_error "$work/tok.log")"; exit 1; }
"$PYTHON" -m data_tools prepare --input "$corpus/json" "$corpus/email" --include '*.py' \
  --tokenizer "$work/tok" --out "$work/data" --val-fraction 0.05 --overwrite >"$work/prep.log" 2>&1 \
  || { result FAIL prepare "$(last_error "$work/prep.log")"; exit 1; }

seq=$([ "$cpu" = 1 ] && echo 64 || echo 128)
common=(--data "$work/data" --model bert-tiny --seq-len "$seq" --micro-batch 8 --precision bf16
        --log-every 2 --save-every 2 --dropout 0 --wandb disabled)
train() {  # train NAME PROCS ARGS... -> run dir $work/NAME
  local name=$1 n=$2; shift 2
  bash launch.sh --procs-per-node "$n" -- --out "$work/$name" "${common[@]}" "$@" >"$work/$name.log" 2>&1
}

for zero in 0 1 2 3; do
  name="bf16-zero$zero"
  if train "$name" "$procs" --zero "$zero" --max-steps "$steps" --resume never --overwrite; then
    if "$PYTHON" -m app export "$work/$name" --out "$work/$name-hf" --overwrite >"$work/$name-export.log" 2>&1; then
      result PASS "$name + export" "$(figures "$work/$name"); $(grep -o 'max |logits.*' "$work/$name-export.log" || true)"
    else
      result FAIL "$name export" "$(last_error "$work/$name-export.log")"
    fi
  else
    result FAIL "$name" "$(last_error "$work/$name.log")"
  fi
done

# exact resume: stop halfway, resume, and compare with the uninterrupted ZeRO-1 run step by step
half=$(( steps / 2 ))
if [ "$half" -ge 1 ] && train resume "$procs" --zero 1 --max-steps "$steps" --stop-at-step "$half" --resume never --overwrite \
   && train resume "$procs" --zero 1 --max-steps "$steps" --resume auto; then
  if "$PYTHON" - "$work" <<'PY'
import json, sys
def losses(run):
    return {r["step"]: r["train/loss"] for r in map(json.loads, open(f"{sys.argv[1]}/{run}/metrics.jsonl"))
            if "train/loss" in r}
a, b = losses("bf16-zero1"), losses("resume")
assert a and a.keys() == b.keys() and all(abs(a[s] - b[s]) <= 1e-5 * max(1, abs(a[s])) for s in a), (a, b)
PY
  then result PASS "resume (ZeRO-1)" "per-step losses equal the uninterrupted run's"
  else result FAIL "resume (ZeRO-1)" "per-step losses differ from the uninterrupted run's"
  fi
else
  result FAIL "resume (ZeRO-1)" "$(last_error "$work/resume.log")"
fi

if [ "$cpu" = 0 ] && "$PYTHON" -c 'from transformers.utils import is_flash_attn_2_available as a; raise SystemExit(not a())'; then
  if train flash "$procs" --zero 1 --max-steps "$steps" --attn flash_attention_2 --resume never --overwrite; then
    result PASS "flash-attention 2" "$(figures "$work/flash")"
  else
    result FAIL "flash-attention 2" "$(last_error "$work/flash.log")"
  fi
else
  result SKIP "flash-attention 2" "$([ "$cpu" = 1 ] && echo "GPU only" || echo "not installed (or a version transformers does not take)")"
fi

if train compiled 1 --zero 0 --max-steps 2 --compile --resume never --overwrite; then
  result PASS "torch.compile" "$(figures "$work/compiled")"
else
  result FAIL "torch.compile" "$(last_error "$work/compiled.log")"
fi

[ "$failed" = 0 ] && echo "gpu_check: all checks passed" || echo "gpu_check: some checks FAILED (logs in $work; --keep DIR keeps them)"
exit "$failed"
