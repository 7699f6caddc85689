#!/usr/bin/env bash
# launch.sh: start `python -m app train` on one box or many nodes through the real `deepspeed`
# launcher. Everything after `--` goes to `app train` unchanged.
#
#   ./launch.sh -- --data DATA --out RUN                       # this box, every accelerator
#   ./launch.sh --procs-per-node 2 -- --data DATA --out RUN    # 2 ranks (CPU: 2 processes)
#   ./launch.sh --hostfile hosts --stage-to /local/nvme/ds -- --data /lustre/ds --out RUN
#   ./launch.sh --no-ssh --node-rank 1 --master-addr node0 --nodes 4 -- ...   # run on each node
#
# The hostfile is DeepSpeed's (MPI style): one `hostname slots=N` per line.
set -euo pipefail

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --hostfile FILE        hosts and their slots (default: DeepSpeed's /job/hostfile, else localhost)
  --nodes N              use the first N hosts of the hostfile
  --procs-per-node N     ranks per node (default: one per accelerator; on CPU, one per NUMA node)
  --no-ssh               start only this node's ranks (run launch.sh on every node yourself,
                         e.g. from srun); needs --node-rank and --master-addr
  --node-rank K          this node's rank, 0..N-1 (with --no-ssh)
  --master-addr ADDR     address of node 0
  --master-port P        rendezvous port (default 29500)
  --launcher NAME        multi-node backend of deepspeed: pdsh (default), openmpi, slurm, mpich...
  --stage-to DIR         copy the dataset to node-local DIR first (passed to app train)
  --dry-run              print the command instead of running it
EOF
}

die() { echo "launch.sh: error: $*" >&2; exit 2; }
is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

hostfile="" nodes="" ppn="" no_ssh=0 node_rank="" master_addr="" master_port="" launcher=""
stage_to="" dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    --hostfile|--nodes|--procs-per-node|--node-rank|--master-addr|--master-port|--launcher|--stage-to)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --hostfile) hostfile="$2" ;;
        --nodes) nodes="$2" ;;
        --procs-per-node) ppn="$2" ;;
        --node-rank) node_rank="$2" ;;
        --master-addr) master_addr="$2" ;;
        --master-port) master_port="$2" ;;
        --launcher) launcher="$2" ;;
        --stage-to) stage_to="$2" ;;
      esac
      shift 2 ;;
    --no-ssh) no_ssh=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) die "unknown option '$1' (app train arguments go after --)" ;;
  esac
done
[ $# -gt 0 ] || die "no app train arguments: use ./launch.sh [options] -- --data DIR --out RUN_DIR ..."

if [ -n "$hostfile" ]; then
  [ -f "$hostfile" ] && [ -r "$hostfile" ] || die "--hostfile $hostfile: no such readable file"
  lineno=0
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line="${line%%#*}"
    [[ "$line" =~ ^[[:space:]]*$ ]] && continue
    [[ "$line" =~ ^[[:space:]]*[^[:space:]]+[[:space:]]+slots=[1-9][0-9]*[[:space:]]*$ ]] ||
      die "$hostfile:$lineno: expected 'hostname slots=N', got '$line'"
  done < "$hostfile"
fi
[ -z "$nodes" ] || is_pos_int "$nodes" || die "--nodes must be a positive integer, got '$nodes'"
[ -z "$ppn" ] || is_pos_int "$ppn" || die "--procs-per-node must be a positive integer, got '$ppn'"
if [ -n "$master_port" ]; then
  is_pos_int "$master_port" && [ "$master_port" -le 65535 ] ||
    die "--master-port must be a port number (1-65535), got '$master_port'"
fi
if [ "$no_ssh" = 1 ]; then
  [ -n "$node_rank" ] || die "--no-ssh needs --node-rank K"
  [ -n "$master_addr" ] || die "--no-ssh needs --master-addr ADDR"
  [[ "$node_rank" =~ ^[0-9]+$ ]] || die "--node-rank must be an integer >= 0, got '$node_rank'"
  if [ -n "$nodes" ] && [ "$node_rank" -ge "$nodes" ]; then
    die "--node-rank $node_rank is outside 0..$((nodes - 1)) for --nodes $nodes"
  fi
elif [ -n "$node_rank" ]; then
  die "--node-rank only makes sense with --no-ssh"
fi

PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found (set PYTHON=...)"

# Environment every rank inherits. Threads per rank: the node's cores shared by its ranks, unless
# the user set it (torch otherwise starts one thread per core in every rank and they fight).
cores=$(nproc 2>/dev/null || echo 1)
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  per_rank=$(( cores / ${ppn:-1} ))
  export OMP_NUM_THREADS=$(( per_rank > 0 ? per_rank : 1 ))
fi
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export PYTHONUNBUFFERED=1

cmd=("$PYTHON" -m deepspeed.launcher.runner)
[ -z "$hostfile" ] || cmd+=(--hostfile "$hostfile")
[ -z "$nodes" ] || cmd+=(--num_nodes "$nodes")
[ -z "$ppn" ] || cmd+=(--num_gpus "$ppn")
[ -z "$master_port" ] || cmd+=(--master_port "$master_port")
[ -z "$master_addr" ] || cmd+=(--master_addr "$master_addr")
[ -z "$launcher" ] || cmd+=(--launcher "$launcher")
[ "$no_ssh" = 0 ] || cmd+=(--no_ssh --node_rank "$node_rank")
cmd+=(--no_local_rank --module app train "$@")
[ -z "$stage_to" ] || cmd+=(--stage-to "$stage_to")

if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
