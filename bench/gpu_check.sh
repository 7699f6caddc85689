#!/usr/bin/env bash
# bench/gpu_check.sh: the first run on a GPU node as a check, not a surprise. First which of
# flash-attn and DeepSpeed's FusedAdam op can run here, and bench/gpu_mfu.py --quick (the app's
# trainer against a plain bf16 loop on bert-120m: ratio, MFU, busy %, host-sync sites; with 2+
# GPUs the NCCL bus bandwidth and transport). Then on a small corpus (Python's standard library),
# through launch.sh and the real deepspeed launcher:
#   bf16 at ZeRO 0, 1, 2 and 3 (2 ranks when the node has 2+ GPUs), each exported and loaded;
#   flash-attention 2 when transformers finds it; torch.compile (compiled / eager tokens/s over
#   40 steps on a GPU); a resume equal to the uninterrupted run (both in deterministic mode).
# Prints one PASS/FAIL/SKIP/INFO line per check with tokens/s (and MFU where the run logs it),
# and exits 1 if any check failed.
#
#   bash bench/gpu_check.sh [--cpu] [--steps N] [--keep DIR] [--only LIST]
#
#   --cpu       run the same checks on this machine's CPU (bf16 through DeepSpeed's CPU
#               accelerator; flash-attention is skipped); what CI runs
#   --steps N   optimizer steps per training check (default 20; 6 with --cpu)
#   --keep DIR  work in DIR and keep it (default: a temporary directory, removed at the end)
#   --only LIST run only these checks, comma-separated, from: probe, mfu, zero, resume, flash,
#               compile (e.g. --only resume,compile to rerun what a short GPU lease cut off)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
checks=probe,mfu,zero,resume,flash,compile
cpu=0 steps="" keep="" only=$checks
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1; shift ;;
    --steps) steps=${2:?--steps needs a number}; shift 2 ;;
    --keep) keep=${2:?--keep needs a directory}; shift 2 ;;
    --only) only=${2:?--only needs a list of checks}; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: error: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -n "$steps" ] || steps=$([ "$cpu" = 1 ] && echo 6 || echo 20)
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: error: --steps $steps: a positive number" >&2; exit 2; }
for c in ${only//,/ }; do
  [[ ",$checks," == *",$c,"* ]] || { echo "gpu_check.sh: error: --only: unknown check '$c' (one of $checks)" >&2; exit 2; }
done
want() { [[ ",$only," == *",$1,"* ]]; }
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
result() {  # result PASS|FAIL|SKIP|INFO NAME DETAIL
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
cpu_flag=()
[ "$cpu" = 1 ] && cpu_flag=(--cpu)
# what can run here (review C1, C2): one line each, informative
if want probe; then
  if "$PYTHON" bench/gpu_mfu.py --probe ${cpu_flag[@]+"${cpu_flag[@]}"} >"$work/probe.log" 2>&1; then
    result INFO "flash-attn" "$(sed -n 's/^flash-attn: *//p' "$work/probe.log")"
    result INFO "FusedAdam op" "$(sed -n 's/^FusedAdam: *//p' "$work/probe.log")"
  else
    result FAIL "op probe" "$(last_error "$work/probe.log")"
  fi
fi
# the app against a plain loop (on CPU tiny models; its verdicts there are informative)
if want mfu; then
  if "$PYTHON" bench/gpu_mfu.py --quick ${cpu_flag[@]+"${cpu_flag[@]}"} --out "$work/gpu_mfu" >"$work/gpu_mfu.log" 2>&1; then
    result PASS "gpu_mfu --quick" "$(grep -v '^[[:space:]]*$' "$work/gpu_mfu.log" | tail -1)"
  else
    result FAIL "gpu_mfu --quick" "$(grep -v '^[[:space:]]*$' "$work/gpu_mfu.log" | tail -1 | cut -c1-160)"
  fi
  grep -E '^  (app|plain) |^  (PASS|FAIL) |^    sync |^NCCL ' "$work/gpu_mfu.log" | sed 's/^/     /' || true
fi
if want zero || want resume || want flash || want compile; then
  corpus=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  "$PYTHON" -m data_tools tokenizer --input "$corpus/json" "$corpus/email" --include '*.py' \
    --out "$work/tok" --vocab-size 4000 --overwrite >"$work/tok.log" 2>&1 || { result FAIL tokenizer "$(last_error "$work/tok.log")"; exit 1; }
  "$PYTHON" -m data_tools prepare --input "$corpus/json" "$corpus/email" --include '*.py' \
    --tokenizer "$work/tok" --out "$work/data" --val-fraction 0.05 --overwrite >"$work/prep.log" 2>&1 \
    || { result FAIL prepare "$(last_error "$work/prep.log")"; exit 1; }
fi

seq=$([ "$cpu" = 1 ] && echo 64 || echo 128)
common=(--data "$work/data" --model bert-tiny --seq-len "$seq" --micro-batch 8 --precision bf16
        --log-every 2 --save-every 2 --dropout 0 --wandb disabled)
train() {  # train NAME PROCS ARGS... -> run dir $work/NAME
  local name=$1 n=$2; shift 2
  bash launch.sh --procs-per-node "$n" -- --out "$work/$name" "${common[@]}" "$@" >"$work/$name.log" 2>&1
}

if want zero; then
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
fi

# resume: stop halfway, resume, and compare with an uninterrupted ZeRO-1 run step by step. All
# three runs in torch's deterministic mode (review m4: a sitecustomize on PYTHONPATH, which
# launch.sh passes to the ranks; cuBLAS needs its workspace setting for it): equal to 1e-5, or
# else within a bf16 tolerance (5e-3), said so (kernels that have no deterministic version warn
# in the logs: GPU resume is exact in data and state, not bitwise in floats).
if want resume; then
  mkdir -p "$work/det"
  printf 'import torch\ntorch.use_deterministic_algorithms(True, warn_only=True)\n' >"$work/det/sitecustomize.py"
  det_train() { PYTHONPATH="$work/det${PYTHONPATH:+:$PYTHONPATH}" CUBLAS_WORKSPACE_CONFIG=:4096:8 train "$@"; }
  half=$(( (steps / 4) * 2 ))  # on a log step (--log-every 2): the logged losses average the same steps
  if [ "$half" -ge 1 ] && det_train resume-ref "$procs" --zero 1 --max-steps "$steps" --resume never --overwrite \
     && det_train resume "$procs" --zero 1 --max-steps "$steps" --stop-at-step "$half" --resume never --overwrite \
     && det_train resume "$procs" --zero 1 --max-steps "$steps" --resume auto; then
    if verdict=$("$PYTHON" - "$work" <<'PY'
import json, sys
def losses(run):
    return {r["step"]: r["train/loss"] for r in map(json.loads, open(f"{sys.argv[1]}/{run}/metrics.jsonl"))
            if "train/loss" in r}
a, b = losses("resume-ref"), losses("resume")
if not a or a.keys() != b.keys():
    sys.exit(f"logged steps differ: {sorted(a)} vs {sorted(b)}")
worst = max(abs(a[s] - b[s]) / max(1, abs(a[s])) for s in a)
if worst <= 1e-5:
    print("per-step losses equal the uninterrupted run's (deterministic mode)")
elif worst <= 5e-3:
    print(f"per-step losses within bf16 tolerance of the uninterrupted run's (max {worst:.1e}; not bitwise)")
else:
    sys.exit(f"per-step losses differ from the uninterrupted run's by up to {worst:.1e}")
PY
    ); then result PASS "resume (ZeRO-1)" "$verdict"
    else result FAIL "resume (ZeRO-1)" "per-step losses differ from the uninterrupted run's"
    fi
  else
    result FAIL "resume (ZeRO-1)" "$(last_error "$work/resume.log")"
  fi
fi

if want flash; then
  if [ "$cpu" = 0 ] && "$PYTHON" -c 'from transformers.utils import is_flash_attn_2_available as a; raise SystemExit(not a())'; then
    if train flash "$procs" --zero 1 --max-steps "$steps" --attn flash_attention_2 --resume never --overwrite; then
      result PASS "flash-attention 2" "$(figures "$work/flash")"
    else
      result FAIL "flash-attention 2" "$(last_error "$work/flash.log")"
    fi
  else
    result SKIP "flash-attention 2" "$([ "$cpu" = 1 ] && echo "GPU only" || echo "not installed (or a version transformers does not take)")"
  fi
fi

# torch.compile: 2 steps on CPU; on a GPU 40, against an eager run of the same, as tokens/s of the
# logged windows after the first half (compilation left out)
if want compile; then
  csteps=$([ "$cpu" = 1 ] && echo 2 || echo 40)
  speed() {  # the median tokens/s of a run's logged windows in its second half
    "$PYTHON" - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
rows = [r for r in rows if r.get("perf/tokens_per_sec")]
print(statistics.median(r["perf/tokens_per_sec"] for r in rows[len(rows) // 2:]))
PY
  }
  if train compiled 1 --zero 0 --max-steps "$csteps" --compile --resume never --overwrite; then
    detail=$(figures "$work/compiled")
    if [ "$cpu" = 0 ] && train eager 1 --zero 0 --max-steps "$csteps" --resume never --overwrite; then
      ratio=$("$PYTHON" -c 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.2f}")' \
        "$(speed "$work/compiled")" "$(speed "$work/eager")")
      detail="$detail; compiled / eager tokens/s = $ratio x over steps $((csteps / 2))-$csteps"
    fi
    result PASS "torch.compile" "$detail"
  else
    result FAIL "torch.compile" "$(last_error "$work/compiled.log")"
  fi
fi

[ "$failed" = 0 ] && echo "gpu_check: all checks passed" || echo "gpu_check: some checks FAILED (logs in $work; --keep DIR keeps them)"
exit "$failed"
