#!/usr/bin/env bash
# launch.sh: start `python -m app train` on one box or many nodes through the real `deepspeed`
# launcher. Everything after `--` goes to `app train` unchanged.
#
#   ./launch.sh -- --data DATA --out RUN                       # this box, every accelerator
#   ./launch.sh --procs-per-node 2 -- --data DATA --out RUN    # 2 ranks (CPU: 2 processes)
#   ./launch.sh --hostfile hosts --stage-to /local/nvme/ds -- --data /lustre/ds --out RUN
#   ./launch.sh --hostfile hosts --no-ssh --node-rank K --master-addr node0 -- ...  # every node
#
# The hostfile is DeepSpeed's (MPI style): one `hostname slots=N` per line. docs/launch.md says
# what is checked before anything starts, what reaches the other nodes, and how to run on Slurm.
set -euo pipefail

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --hostfile FILE        hosts and their slots (default: DeepSpeed's /job/hostfile, else this box)
  --nodes N              use the first N hosts of the hostfile
  --procs-per-node N     ranks per node (default: the hostfile's slots; without a hostfile one per
                         accelerator, on CPU one per NUMA node)
  --no-ssh               start only this node's ranks (run launch.sh on every node yourself, e.g.
                         from srun); needs --node-rank, --master-addr, and the same --hostfile on
                         every node or --nodes N with --procs-per-node P
  --node-rank K          this node's rank, 0..N-1 (with --no-ssh)
  --master-addr ADDR     address of node 0 (default: the hostfile's first host)
  --master-port P        rendezvous port (default 29500; on one box, a free port)
  --launcher NAME        multi-node backend of deepspeed: pdsh (default), openmpi, mpich, impi,
                         mvapich, slurm
  --ssh-port P           port of the hosts' sshd (default: ssh's own, ~/.ssh/config)
  --env NAME             forward variable NAME to the other nodes as well (repeatable)
  --log-dir DIR          one log file per rank in DIR (on each node) instead of prefixed lines
  --stage-to DIR         copy the dataset to node-local DIR first (passed to app train);
                         {node_rank} in DIR becomes the node's rank
  --dry-run              run the local checks, print the command instead of running it
EOF
}

die() { echo "launch.sh: error: $*" >&2; exit 2; }
is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
# One shell word for a POSIX shell on another host: single quotes, embedded ones spliced in.
shq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# ------------------------------------------------------------------------------------ one rank
# The deepspeed launcher starts `bash launch.sh --as-rank [--no-prefix] [--stage-to DIR] --
# PYTHON -u -m app train ARGS` for every rank (DeepSpeed's launch.py sets RANK and CROSS_RANK).
# It puts the node's rank into --stage-to, tags each output line with node and rank, then becomes
# the rank (exec: same pid, exit status and signals as the python process it runs).
as_rank() {
  local prefix=1 stage_to=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --no-prefix) prefix=0; shift ;;
      --stage-to) stage_to="$2"; shift 2 ;;
      --) shift; break ;;
      *) die "--as-rank: unexpected argument '$1'" ;;
    esac
  done
  # DeepSpeed's launch.py sets RANK and CROSS_RANK; MPI and Slurm launchers their own names
  local node="${CROSS_RANK:-${SLURM_NODEID:-}}"
  local rank="${RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-}}}}"
  [[ "$node" =~ ^[0-9]+$ ]] || node="?"
  [[ "$rank" =~ ^[0-9]+$ ]] || rank="?"
  if [ -n "$stage_to" ]; then
    if [[ "$stage_to" == *"{node_rank}"* ]]; then
      [ "$node" != "?" ] || die "--stage-to $stage_to: the launcher gave this rank no node rank"
      stage_to="${stage_to//"{node_rank}"/$node}"
    fi
    set -- "$@" --stage-to "$stage_to"
  fi
  [ "$prefix" = 1 ] || exec "$@"
  local tag="[node$node rank$rank] "
  # The taggers ignore the stop signals (a scheduler's reach them too): they end when the rank
  # closes its output, after its last line.
  exec "$@" > >(trap '' INT TERM HUP USR1; exec sed -u "s/^/$tag/") \
    2> >(trap '' INT TERM HUP USR1; exec sed -u "s/^/$tag/" >&2)
}
if [ "${1:-}" = "--as-rank" ]; then
  shift
  as_rank "$@"
fi

# ------------------------------------------------------------------------------------- options
hostfile="" nodes="" ppn="" no_ssh=0 node_rank="" master_addr="" master_port="" launcher=""
ssh_port="" log_dir="" stage_to="" dry_run=0 extra_env=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    --hostfile|--nodes|--procs-per-node|--node-rank|--master-addr|--master-port|--launcher|\
    --ssh-port|--env|--log-dir|--stage-to)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --hostfile) hostfile="$2" ;;
        --nodes) nodes="$2" ;;
        --procs-per-node) ppn="$2" ;;
        --node-rank) node_rank="$2" ;;
        --master-addr) master_addr="$2" ;;
        --master-port) master_port="$2" ;;
        --launcher) launcher="$2" ;;
        --ssh-port) ssh_port="$2" ;;
        --env) extra_env+=("$2") ;;
        --log-dir) log_dir="$2" ;;
        --stage-to) stage_to="$2" ;;
      esac
      shift 2 ;;
    --no-ssh) no_ssh=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) die "unknown option '$1' (app train arguments go after --)" ;;
  esac
done
[ $# -gt 0 ] || die "no app train arguments: use ./launch.sh [options] -- --data DIR --out RUN_DIR ..."
app_args=("$@")

[ -z "$nodes" ] || is_pos_int "$nodes" || die "--nodes must be a positive integer, got '$nodes'"
[ -z "$ppn" ] || is_pos_int "$ppn" || die "--procs-per-node must be a positive integer, got '$ppn'"
for port_opt in "--master-port:$master_port" "--ssh-port:$ssh_port"; do
  value="${port_opt#*:}"
  [ -z "$value" ] || { is_pos_int "$value" && [ "$value" -le 65535 ]; } ||
    die "${port_opt%%:*} must be a port number (1-65535), got '$value'"
done
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
launcher="${launcher:-pdsh}"
case "$launcher" in
  pdsh|openmpi|mpich|impi|mvapich|slurm) ;;
  *) die "--launcher $launcher: expected pdsh, openmpi, mpich, impi, mvapich or slurm" ;;
esac
for name in "${extra_env[@]}"; do
  [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env $name: expected a variable name"
  printenv "$name" >/dev/null || die "--env $name: not set in this environment"
done
for arg in "${app_args[@]}"; do
  [[ "$arg" != *"{node_rank}"* ]] ||
    die "app argument '$arg': {node_rank} is expanded only in launch.sh's own --stage-to"
done
if [ -n "$log_dir" ]; then
  [[ "$log_dir" == /* ]] || log_dir="$PWD/$log_dir"
fi

# ------------------------------------------------------------------------------------ hostfile
hosts=() slots=()
read_hostfile() {
  local file="$1" lineno=0 line host n
  local -A seen=()
  if [ ! -f "$file" ] || [ ! -r "$file" ]; then die "--hostfile $file: no such readable file"; fi
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line="${line%%#*}"
    [[ "$line" =~ ^[[:space:]]*$ ]] && continue
    [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+slots=([1-9][0-9]*)[[:space:]]*$ ]] ||
      die "$file:$lineno: expected 'hostname slots=N', got '$line'"
    host="${BASH_REMATCH[1]}" n="${BASH_REMATCH[2]}"
    # pdsh reads ',' '[' as host lists and ssh options start with '-': keep names plain
    [[ "$host" =~ ^([A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9_][A-Za-z0-9._-]*$ ]] ||
      die "$file:$lineno: '$host' is not a host name (letters, digits, '.', '-', '_', user@ allowed)"
    [ -z "${seen[$host]:-}" ] ||
      die "$file:$lineno: host '$host' is listed twice (also line ${seen[$host]}); give it one line with all its slots"
    seen[$host]="$lineno"
    hosts+=("$host") slots+=("$n")
  done < "$file"
  [ "${#hosts[@]}" -gt 0 ] || die "$file: no hosts in the hostfile (expected lines of 'hostname slots=N')"
}

if [ -z "$hostfile" ] && [ -f /job/hostfile ]; then
  hostfile=/job/hostfile  # DeepSpeed's own default: check the file it would use
fi
jobdir=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() { [ -z "$jobdir" ] || rm -rf "$jobdir"; }
trap cleanup EXIT
make_jobdir() {
  [ -n "$jobdir" ] && return 0
  jobdir="$(umask 077 && mktemp -d "${TMPDIR:-/tmp}/launch.sh.XXXXXX")" ||
    die "cannot create a private directory under ${TMPDIR:-/tmp}"
}
if [ -n "$hostfile" ]; then
  read_hostfile "$hostfile"
  if [ -n "$nodes" ] && [ "$nodes" -gt "${#hosts[@]}" ]; then
    die "--nodes $nodes: $hostfile lists only ${#hosts[@]} host(s)"
  fi
elif [ "$no_ssh" = 1 ]; then
  # every node's launcher needs the same world: all hosts and their slots
  if [ -z "$nodes" ] || [ -z "$ppn" ]; then
    die "--no-ssh needs --hostfile FILE (the same on every node), or --nodes N with --procs-per-node P"
  fi
  make_jobdir
  hostfile="$jobdir/hostfile"
  for ((i = 0; i < nodes; i++)); do
    hosts+=("node$i")
    echo "node$i slots=$ppn" >> "$hostfile"
  done
elif [ -n "$nodes" ] && [ "$nodes" -gt 1 ]; then
  die "--nodes $nodes needs a --hostfile listing the hosts (without one, launch.sh runs on this box)"
fi
active=("${hosts[@]:0:${nodes:-${#hosts[@]}}}")
if [ "$no_ssh" = 1 ] && [ "$node_rank" -ge "${#active[@]}" ]; then
  die "--node-rank $node_rank is outside 0..$((${#active[@]} - 1)) (${#active[@]} node(s) in $hostfile)"
fi
# A hostfile whose one host is this box: DeepSpeed's runner takes any hostfile for a multi-node
# launch and starts even this one host over ssh, so run on this box instead, with its slots. The
# hostfile handed on is then absent (DeepSpeed's own default, /job/hostfile, must not apply).
is_this_host() {
  case "$1" in localhost | 127.0.0.1 | ::1) return 0 ;; esac
  local name
  for name in "$(hostname 2>/dev/null)" "$(hostname -s 2>/dev/null)" \
              "$(timeout 5 hostname -f 2>/dev/null)"; do
    [ -z "$name" ] || [ "$1" != "$name" ] || return 0
  done
  return 1
}
if [ -n "$hostfile" ] && [ "$no_ssh" = 0 ] && [ "${#active[@]}" -eq 1 ] &&
   is_this_host "${active[0]}"; then
  ppn="${ppn:-${slots[0]}}"
  make_jobdir
  hostfile="$jobdir/no-hostfile"
fi
# DeepSpeed's rule: more than one host and ssh allowed = a multi-node launch from here
multi=0
[ "$no_ssh" = 1 ] || [ "${#active[@]}" -le 1 ] || multi=1
if [ "$multi" = 1 ]; then
  master_addr="${master_addr:-${active[0]#*@}}"  # a name every node resolves: it is in the hostfile
fi
if [ -n "$log_dir" ] && [ "$multi" = 1 ] && [ "$launcher" != pdsh ]; then
  die "--log-dir works with the pdsh launcher or --no-ssh (DeepSpeed's launch.py writes the files)"
fi
if [ "$multi" = 1 ] && [ "$launcher" != pdsh ] && [ "$launcher" != slurm ] &&
   { [ -n "$nodes" ] || [ -n "$ppn" ]; }; then
  die "--launcher $launcher runs every slot of the hostfile: edit it instead of --nodes/--procs-per-node"
fi

# ---------------------------------------------------------------------------- this host's python
PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found (set PYTHON=...)"
# What every host must agree on: interpreter, project (version and code), torch, deepspeed.
# Prints sys.executable (which the ranks run, as DeepSpeed's launcher does) and one summary line.
read -r -d '' VERSIONS_PY <<'PY' || true
import hashlib, importlib.metadata as md, importlib.util, pathlib, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"
code = hashlib.sha256()
for package in ("app", "data_tools"):
    spec = importlib.util.find_spec(package)
    for path in sorted(pathlib.Path(next(iter(spec.submodule_search_locations))).glob("*.py")):
        code.update(path.name.encode() + b"\0" + path.read_bytes())
print(sys.executable)
print(f"python {sys.version.split()[0]}, dspretrain {version('dspretrain')} "
      f"(code {code.hexdigest()[:12]}), torch {version('torch')}, deepspeed {version('deepspeed')}")
PY
local_info="$("$PYTHON" -c "$VERSIONS_PY" 2>/dev/null)" ||
  die "$PYTHON cannot import this project here: $("$PYTHON" -c "$VERSIONS_PY" 2>&1 | tail -n 1)"
py_exe="$(tail -n 2 <<< "$local_info" | head -n 1)"
local_versions="$(tail -n 1 <<< "$local_info")"
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

# Environment every rank inherits. Threads per rank: the node's cores shared by its ranks, unless
# the user set it (torch otherwise starts one thread per core in every rank and they fight). When
# the ranks per node are not known here (one per accelerator, counted by DeepSpeed), each rank
# divides its cores by LOCAL_WORLD_SIZE itself (app/runtime/device.py, set_cpu_threads).
cores=$(nproc 2>/dev/null || echo 1)
ranks_here=${ppn:-${slots[0]:-}}
if [ -z "${OMP_NUM_THREADS:-}" ] && [ -n "$ranks_here" ]; then
  per_rank=$(( cores / ranks_here ))
  export OMP_NUM_THREADS=$(( per_rank > 0 ? per_rank : 1 ))
fi
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export PYTHONUNBUFFERED=1

# ------------------------------------------------------------------ what reaches the other nodes
# DeepSpeed's runner forwards only MLFLOW*, PYTHON* (PYTHONPATH with this directory first), MV2*,
# UCX* and the accelerator's prefixes, plus the lines of its env file: ours is written per job
# (DS_ENV_FILE) and carries the user's own ~/.deepspeed_env and ./.deepspeed_env after it.
# What a cluster's fabric needs goes by default: the interface gloo and NCCL bind (GLOO_*,
# NCCL_*), libfabric's and UCX's settings (FI_* for EFA, UCX_*), torch's NCCL and rendezvous
# switches, CUDA's, and LD_LIBRARY_PATH (NCCL's network plugins): without them NCCL falls back
# to TCP sockets, silently. CUDA_VISIBLE_DEVICES stays: each node's launch.py sets it.
FORWARDED=('WANDB_*' 'HF_*' 'NCCL_*' 'GLOO_*' 'FI_*' 'UCX_*' 'TORCH_NCCL_*' 'TORCH_DISTRIBUTED_*'
           'CUDA_*' LD_LIBRARY_PATH OMP_NUM_THREADS TOKENIZERS_PARALLELISM PATH VIRTUAL_ENV)
forward=() secrets=() launch_id=""
env_file_lines=()
# pdsh hands the exports and arguments to a shell on every host: these characters would be
# interpreted there ('%' by pdsh itself)
unsafe_chars='["$`\\%;&|<>()*?'"'"'#~!]|\[|\]'
collect_forwarded_env() {
  local name value pattern listed=" "
  local -a names=()
  while IFS= read -r name; do
    [ "$name" != CUDA_VISIBLE_DEVICES ] || continue
    for pattern in "${FORWARDED[@]}"; do
      # shellcheck disable=SC2053  # a glob on purpose
      if [[ "$name" == $pattern ]]; then names+=("$name"); break; fi
    done
  done < <(compgen -e | sort)
  names+=("${extra_env[@]}")
  for name in "${names[@]}"; do
    [[ "$listed" != *" $name "* ]] || continue
    listed+="$name "
    value="${!name}"
    if [[ "$value" == *$'\n'* ]] || [[ "$value" =~ [\"\$\`\\%] ]]; then
      die "cannot forward $name to the other nodes: its value holds a character their shell would expand (\" \$ \` \\ % or a newline)"
    fi
    forward+=("$name")
    env_file_lines+=("$name=$value")
    case "$name" in
      *KEY*|*TOKEN*|*SECRET*|*PASSWORD*) [ "${#value}" -lt 6 ] || secrets+=("$value") ;;
    esac
  done
  # The ranks of this job carry its id: stopping the job on a host ends exactly those processes.
  launch_id="$(date +%Y%m%d%H%M%S)-$$-$RANDOM$RANDOM"
  env_file_lines+=("DSPRETRAIN_LAUNCH_ID=$launch_id")
  # the user's own files, read where and as DeepSpeed would (later lines win)
  local user_name="${DS_ENV_FILE:-.deepspeed_env}" file lineno line done_files=" "
  for file in "$HOME/$user_name" "$PWD/$user_name"; do
    [[ "$user_name" != /* ]] || file="$user_name"
    if [ ! -f "$file" ] || [[ "$done_files" == *" $file "* ]]; then continue; fi
    done_files+="$file "
    lineno=0
    while IFS= read -r line || [ -n "$line" ]; do
      lineno=$((lineno + 1))
      [[ "$line" =~ ^[[:space:]]*$ ]] && continue
      [[ "$line" =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] || die "$file:$lineno: expected NAME=VALUE"
      name="${BASH_REMATCH[1]}" value="${BASH_REMATCH[2]}"
      [[ ! "$value" =~ [\"\$\`\\%] ]] ||
        die "$file:$lineno: $name's value holds a character the remote shell would expand (\" \$ \` \\ %)"
      env_file_lines+=("$line")
      case "$name" in
        *KEY*|*TOKEN*|*SECRET*|*PASSWORD*) [ "${#value}" -lt 6 ] || secrets+=("$value") ;;
      esac
    done < "$file"
  done
}
remote_exits=""
if [ "$multi" = 1 ]; then
  collect_forwarded_env
  if [ "$launcher" = pdsh ]; then  # each rank's exit status, on its own host (collect_exits)
    remote_exits="/tmp/dspretrain-exits.$launch_id"
    env_file_lines+=("DSPRETRAIN_EXIT_DIR=$remote_exits")
  fi
  if [ "$launcher" != pdsh ]; then  # DeepSpeed's MPI and Slurm backends may not set these
    env_file_lines+=("MASTER_ADDR=$master_addr" "MASTER_PORT=${master_port:-29500}")
  fi
  if [ "$launcher" = pdsh ]; then
    # DeepSpeed puts these two into pdsh's command unquoted
    for arg in "$PWD" "$py_exe"; do
      [[ ! "$arg" =~ [[:space:]] ]] || die "'$arg' has a space, which DeepSpeed's pdsh command does not quote: use a path without one, or --no-ssh"
    done
    for arg in "${app_args[@]}" "$PWD" "$self" "$py_exe" "$stage_to" "$log_dir"; do
      [[ ! "$arg" =~ $unsafe_chars && "$arg" != *$'\n'* ]] ||
        die "'$arg' cannot pass through pdsh, which hands arguments to a shell on every host: rename it, or use --no-ssh"
    done
  fi
fi

# -------------------------------------------------------------------- pre-flight on every host
# The interfaces GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name ($2, $3), seen from this node:
# each must exist here, and reach the master ($1) unless the master is this node. Prints one line
# naming the interface and the master and returns 1 when not. Self-contained: check_hosts runs
# it on every host (declare -f).
iface_problem() {
  local master="$1" var given value exact name w w_addrs addr route here=() wanted=() matched=() reach
  for name in /sys/class/net/*; do here+=("${name##*/}"); done
  addr="$(getent ahostsv4 "$master" 2>/dev/null | awk 'NR == 1 { print $1 }')" || addr=""
  route="$(ip -o route get "$addr" 2>/dev/null)" || route=""
  for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
    if [ "$var" = GLOO_SOCKET_IFNAME ]; then given="$2"; else given="$3"; fi
    value="$given"
    if [ -z "$value" ] || [[ "$value" == ^* ]]; then continue; fi  # NCCL's "^x": all but x
    exact=0
    if [ "$var" = NCCL_SOCKET_IFNAME ] && [[ "$value" == =* ]]; then exact=1 value="${value#=}"; fi
    [ "$var" = NCCL_SOCKET_IFNAME ] || exact=1  # gloo takes names, NCCL prefixes
    IFS=, read -r -a wanted <<< "$value"
    matched=() reach=0
    for name in "${here[@]}"; do
      for w in "${wanted[@]}"; do
        if [ "$name" = "$w" ] || { [ "$exact" = 0 ] && [[ "$name" == "$w"* ]]; }; then
          matched+=("$name"); break
        fi
      done
    done
    for w in "${wanted[@]}"; do  # gloo uses every interface it is given: each must be here
      if [ "$var" = GLOO_SOCKET_IFNAME ] && [ ! -e "/sys/class/net/$w" ]; then matched=(); fi
    done
    if [ "${#matched[@]}" -eq 0 ]; then
      echo "$var=$given: no such network interface on $(hostname) (it has ${here[*]}), so its ranks cannot reach the master $master"
      return 1
    fi
    # gloo binds every rank's sockets to the address of each interface it is given: one
    # without an address passed the checks above and then failed every rank inside gloo
    if [ "$var" = GLOO_SOCKET_IFNAME ] && command -v ip >/dev/null 2>&1; then
      for w in "${wanted[@]}"; do
        # read whole, then matched: `ip ... | grep -q` under pipefail fails when grep stops at
        # the first of several address lines and ip dies of SIGPIPE on the next
        w_addrs="$(ip -o addr show dev "$w" 2>/dev/null || true)"
        if ! [[ "$w_addrs" =~ [[:space:]]inet6?[[:space:]] ]]; then
          echo "$var=$given: interface $w on $(hostname) has no address, so gloo cannot bind its ranks to it (interfaces with one: $(ip -o addr show 2>/dev/null | awk '{ print $2 }' | sort -u | paste -sd ' ' -))"
          return 1
        fi
      done
    fi
    # the master's address resolved, not on this node, and `ip` here: one interface must route
    if [ -z "$addr" ] || [ -z "$route" ] || [[ "$route" == local* ]]; then continue; fi
    for name in "${matched[@]}"; do
      (( ($(cat "/sys/class/net/$name/flags" 2>/dev/null || echo 0) & 8) == 0 )) || continue  # loopback
      ! ip -o route get "$addr" oif "$name" >/dev/null 2>&1 || { reach=1; break; }
    done
    if [ "$reach" = 0 ]; then
      echo "$var=$given: interface ${matched[*]} on $(hostname) has no route to the master $master ($addr)"
      return 1
    fi
  done
}
ifname_set=0
[ -z "${GLOO_SOCKET_IFNAME:-}${NCCL_SOCKET_IFNAME:-}" ] || ifname_set=1
backend_ok() {
  case "$launcher" in
    pdsh) command -v pdsh ;;
    openmpi) command -v ompi_info ;;
    mpich|impi) command -v mpirun ;;
    mvapich) command -v mpiname ;;
    slurm) command -v srun ;;
  esac
}
ssh_cmd=(ssh -o BatchMode=yes -o ConnectTimeout=10)
[ -z "$ssh_port" ] || ssh_cmd+=(-p "$ssh_port")
# pdsh's ssh module appends these to every ssh it runs: so do we
read -r -a pdsh_ssh_extra <<< "${PDSH_SSH_ARGS_APPEND:-}"
ssh_cmd+=("${pdsh_ssh_extra[@]}")

# One ssh per host, in parallel: reachable without a password, in the same directory, with the
# same interpreter and the same versions of everything (run in the environment the ranks get).
check_hosts() {
  local remote="" name i host rc out err running=0 python_path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  remote+="cd $(shq "$PWD") 2>/dev/null || exit 97; "
  remote+="test -x $(shq "$py_exe") || exit 98; test -r $(shq "$self") || exit 99; "
  if [ "$ifname_set" = 1 ]; then
    remote+="bash -c $(shq "$(declare -f iface_problem); iface_problem \"\$@\"") iface_problem"
    remote+=" $(shq "$master_addr") $(shq "${GLOO_SOCKET_IFNAME:-}") $(shq "${NCCL_SOCKET_IFNAME:-}")"
    remote+=" || exit 96; "
  fi
  for name in "${forward[@]}"; do
    case "$name" in *KEY*|*TOKEN*|*SECRET*|*PASSWORD*) continue ;; esac  # not on more argv
    remote+="export $name=$(shq "${!name}"); "
  done
  remote+="export PYTHONPATH=$(shq "$python_path"); exec $(shq "$py_exe") -c $(shq "$VERSIONS_PY")"
  for i in "${!active[@]}"; do
    if [ "$running" -ge 64 ]; then wait -n || true; running=$((running - 1)); fi
    (
      rc=0
      timeout 60 "${ssh_cmd[@]}" "${active[$i]}" "$remote" </dev/null \
        >"$jobdir/check.$i.out" 2>"$jobdir/check.$i.err" || rc=$?
      echo "$rc" > "$jobdir/check.$i.rc"
    ) &
    running=$((running + 1))
  done
  wait || true
  for i in "${!active[@]}"; do
    host="${active[$i]}"
    rc="$(cat "$jobdir/check.$i.rc")"
    out="$(tail -n 1 "$jobdir/check.$i.out")"
    err="$(tr -d '\r' < "$jobdir/check.$i.err" | grep -v '^Warning: Permanently added' | tail -n 1 || true)"
    case "$rc" in
      0) [ "$out" = "$local_versions" ] ||
           die "$host runs $out, but this host runs $local_versions: install the same environment (and checkout) on every node" ;;
      255) die "$host: not reachable by passwordless ssh${err:+ ($err)}: set up keys (ssh-copy-id $host) and accept its host key, or start every node yourself with --no-ssh" ;;
      124) die "$host: no answer over ssh within 60 s: check the host, or start every node yourself with --no-ssh" ;;
      96) die "$host: $out" ;;
      97) die "$host: no directory $PWD there: launch from a directory every node shares" ;;
      98) die "$host: no interpreter $py_exe there: install the same environment at the same path on every node" ;;
      99) die "$host: no $self there: the checkout must be at the same path on every node" ;;
      *) die "$host: $py_exe failed there (exit $rc)${err:+: $err}" ;;
    esac
  done
}

if [ "$multi" = 1 ]; then
  backend_ok >/dev/null || case "$launcher" in
    pdsh) die "the pdsh launcher needs pdsh on this host (apt-get install pdsh / dnf install pdsh), or start every node yourself with --no-ssh" ;;
    *) die "--launcher $launcher: its tools are not installed on this host" ;;
  esac
  if [ "$launcher" != slurm ]; then
    command -v ssh >/dev/null || die "multi-node launches need an ssh client on this host"
    if [ "$dry_run" = 0 ]; then
      make_jobdir
      check_hosts
    fi
  fi
fi

# This node's ranks (one box, or --no-ssh): the interfaces they are told to use are here and reach
# the master. Ranks started over ssh are checked on their hosts (check_hosts).
if [ "$multi" = 0 ] && [ "$ifname_set" = 1 ]; then
  problem="$(iface_problem "${master_addr:-127.0.0.1}" "${GLOO_SOCKET_IFNAME:-}" \
    "${NCCL_SOCKET_IFNAME:-}")" || die "$problem"
fi

# One box: a free rendezvous port unless one was given (two jobs on a box both taking 29500 fail
# with EADDRINUSE). Several nodes must agree on it, so they keep the default.
if [ "$multi" = 0 ] && [ "$no_ssh" = 0 ] && [ -z "$master_port" ]; then
  master_port=$("$py_exe" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

# -------------------------------------------------------------------------------- the command
# DeepSpeed's runner (`deepspeed`): its own main() and arguments, started with the collector paused
# for its imports (app/runtime/runner.py: ~0.6 CPU-s less a job)
cmd=("$py_exe" -m app.runtime.runner)
[ -z "$hostfile" ] || cmd+=(--hostfile "$hostfile")
[ -z "$nodes" ] || cmd+=(--num_nodes "$nodes")
[ -z "$ppn" ] || cmd+=(--num_gpus "$ppn")
[ -z "$master_port" ] || cmd+=(--master_port "$master_port")
[ -z "$master_addr" ] || cmd+=(--master_addr "$master_addr")
[ "$launcher" = pdsh ] || cmd+=(--launcher "$launcher")
[ -z "$ssh_port" ] || cmd+=(--ssh_port "$ssh_port")
[ "$no_ssh" = 0 ] || cmd+=(--no_ssh --node_rank "$node_rank")
[ "$multi" = 0 ] || cmd+=(--no_ssh_check)  # ours above also honours PDSH_SSH_ARGS_APPEND
[ -z "$log_dir" ] || cmd+=(--enable_each_rank_log "$log_dir")
if [ "$multi" = 1 ] && [ "$launcher" != pdsh ]; then
  # DeepSpeed's MPI and Slurm backends start python themselves (slurm's ignores --no_python):
  # ranks run as before, untagged, stopped and labelled by mpirun or srun
  [[ "$stage_to" != *"{node_rank}"* ]] ||
    die "--stage-to $stage_to: {node_rank} works with the pdsh launcher or --no-ssh"
  cmd+=(--no_local_rank --module app train "${app_args[@]}")
  [ -z "$stage_to" ] || cmd+=(--stage-to "$stage_to")
else
  rank_cmd=(bash "$self" --as-rank)
  [ -z "$log_dir" ] || rank_cmd+=(--no-prefix)
  [ -z "$stage_to" ] || rank_cmd+=(--stage-to "$stage_to")
  cmd+=(--no_python --no_local_rank "${rank_cmd[@]}" -- "$py_exe" -u -m app train "${app_args[@]}")
fi

if [ "$multi" = 1 ]; then
  shown=("${active[@]:0:4}")
  [ "${#active[@]}" -le 4 ] || shown+=("... ${active[-1]}")
  echo "launch.sh: ${#active[@]} nodes (${shown[*]}) via $launcher, master ${master_addr:-?}:${master_port:-29500}; forwarding ${forward[*]:-nothing} (values not shown)" >&2
fi
if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
if [ -n "$log_dir" ]; then
  mkdir -p "$log_dir" 2>/dev/null || die "--log-dir $log_dir: cannot create it"
fi
make_jobdir
if [ "$multi" = 1 ]; then
  printf '%s\n' "${env_file_lines[@]}" > "$jobdir/deepspeed_env"
  export DS_ENV_FILE="$jobdir/deepspeed_env"
else
  # The ranks here write their exit statuses into it (app/faults/preemption.py): DeepSpeed's
  # launch.py, signalled with them, reports only its own.
  mkdir "$jobdir/exits"
  export DSPRETRAIN_EXIT_DIR="$jobdir/exits"
fi

# ----------------------------------------------------------------------------------- run it
# The runner gets its own process group (set -m): a Ctrl-C reaches launch.sh only, which stops
# the job the precise way below. DeepSpeed's own handler would `pkill -f` every deepspeed
# launcher of this user on every host, other jobs' included.
redact() {
  local line="$1" secret
  for secret in "${secrets[@]}"; do line="${line//"$secret"/***}"; done
  printf '%s\n' "$line"
}
pass_stdout() {  # the runner's stdout: its log shows the exports, secrets included
  trap '' INT TERM HUP
  local line
  while IFS= read -r line || [ -n "$line" ]; do redact "$line"; done
  : 2>/dev/null > "$jobdir/stdout.eof" || true
}
watch_stderr() {  # pdsh says at once when a host's launcher fails: that stops the whole job
  trap '' INT TERM HUP
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    redact "$line" >&2
    # (once the job is being stopped, the hosts' failures are the stop's doing)
    if [[ "$line" =~ ^pdsh@[^:]*:\ ([^:]+):\ ssh\ exited\ with\ exit\ code\ ([0-9]+)$ ]] &&
       [ ! -e "$jobdir/failed" ] && [ ! -e "$jobdir/stopping" ]; then
      echo "${BASH_REMATCH[2]} ${BASH_REMATCH[1]}" > "$jobdir/failed"
      kill -USR1 "$$" 2>/dev/null || true
    fi
  done
  : 2>/dev/null > "$jobdir/stderr.eof" || true
}

# A shell command on every host, through pdsh as the job came; its lines come out "host: line".
# shellcheck disable=SC2317  # on_hosts .. on_failure: called from traps
on_hosts() {
  local workers
  workers="$(IFS=,; echo "${active[*]}")"
  PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND="${PDSH_SSH_ARGS_APPEND:-}${ssh_port:+ -p $ssh_port}" \
    timeout 60 pdsh -S -t 10 -u 30 -f 1024 -w "$workers" "$1" </dev/null 2>/dev/null || true
}
# Stop the job: on every host, TERM to the processes that carry this job's id (DeepSpeed's
# launch.py then ends its ranks).
stop_hosts() {
  local remote
  remote="for f in \$(grep -lzxF $(shq "DSPRETRAIN_LAUNCH_ID=$launch_id") /proc/[0-9]*/environ"
  remote+=" 2>/dev/null); do p=\${f#/proc/}; kill -TERM \"\${p%/environ}\" 2>/dev/null; done; true"
  on_hosts "$remote" >/dev/null
}
# The ranks' exit statuses, which each wrote on its own host (DSPRETRAIN_EXIT_DIR): into
# $jobdir/exits as on one box, the hosts' directories removed. launch.py reports only its own
# status through pdsh (1 when it was stopped, whatever its ranks did).
collect_exits() {
  local remote name code
  remote="cd $(shq "$remote_exits") 2>/dev/null || exit 0; for f in rank*; do"
  remote+=" c=\$(cat \"\$f\" 2>/dev/null) && echo \"\$f \$c\"; rm -f \"\$f\"; done;"
  remote+=" cd / && rmdir $(shq "$remote_exits") 2>/dev/null; true"
  mkdir -p "$jobdir/exits"
  while read -r _ name code; do  # "host: rankN status"
    if [[ "$name" =~ ^rank[0-9]+$ && "$code" =~ ^[0-9]+$ ]]; then
      echo "$code" > "$jobdir/exits/$name"
    fi
  done < <(on_hosts "$remote")
}
# Here, TERM to every process of the job, as a scheduler does: the ranks stop together with a
# checkpoint, launch.py ends them too (TERM, then KILL after 30 s), the loader workers ignore it.
# shellcheck disable=SC2317
stop_here() {
  kill -TERM -- "-$runner_pid" 2>/dev/null || true
}
runner_pid="" stopping=0 stop_status="" woke=0 deadline=0
# shellcheck disable=SC2317
stop_job() {  # $1: why, $2: the exit status unless a rank failed first
  stopping=1 stop_status="$2" deadline=$((SECONDS + 90))
  [ -z "$jobdir" ] || : > "$jobdir/stopping"
  echo "launch.sh: stopping the job ($1)" >&2
  if [ "$multi" = 1 ] && [ "$launcher" = pdsh ]; then stop_hosts; else stop_here; fi
}
# shellcheck disable=SC2317
on_signal() {  # $1: which, $2: exit status
  woke=1
  [ -n "$runner_pid" ] || exit "$2"
  if [ "$stopping" = 1 ]; then  # asked twice: end it here and now
    kill -KILL -- "-$runner_pid" 2>/dev/null || true
  else
    stop_job "$1" "$2"
  fi
}
# shellcheck disable=SC2317
on_failure() {  # USR1: a host failed (watch_stderr), or the scheduler's signal (Slurm --signal)
  woke=1
  if [ -z "$jobdir" ] || [ ! -e "$jobdir/failed" ]; then
    on_signal "user signal 1" 138
    return 0
  fi
  [ "$stopping" = 0 ] || return 0
  local code host
  read -r code host < "$jobdir/failed"
  stop_job "the launcher on $host exited with status $code" "$code"
}
# The stop's deadline passed and the job still runs here: KILL it (once; again in an hour).
kill_overdue() {
  [ "$SECONDS" -ge "$deadline" ] || return 0
  echo "launch.sh: the job outlived its stop by 90 s: killing what runs here" >&2
  kill -KILL -- "-$runner_pid" 2>/dev/null || true
  deadline=$((SECONDS + 3600))
}
# Whether a process of the job still runs here (zombies, which wait for init to reap them, do not).
job_alive() {
  ps -e -o pgid= -o stat= 2>/dev/null |
    awk -v g="$runner_pid" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}
# 75 when a rank stopped on a signal (exit 75) and none failed otherwise (1: it lost a peer that
# stopped; none: launch.py ended it), else nothing: the launcher's status stands. The ranks of
# this box wrote into $jobdir/exits; those of other hosts came with collect_exits.
ranks_verdict() {
  local file code stopped=0
  for file in "$jobdir"/exits/rank*; do
    [ -f "$file" ] || continue
    read -r code < "$file" || continue
    case "$code" in
      75) stopped=1 ;;
      0|1) ;;
      *) return 0 ;;
    esac
  done
  [ "$stopped" = 0 ] || echo 75
}
trap 'on_signal interrupted 130' INT
trap 'on_signal terminated 143' TERM
trap 'on_signal hang-up 129' HUP
trap on_failure USR1

set -m
if [ "$multi" = 1 ] && [ "$launcher" = pdsh ]; then
  "${cmd[@]}" </dev/null > >(pass_stdout) 2> >(watch_stderr) &
else
  "${cmd[@]}" </dev/null &
fi
runner_pid=$!
set +m
rc=""
while [ -z "$rc" ]; do
  if [ "$stopping" = 1 ] && kill -0 "$runner_pid" 2>/dev/null; then
    kill_overdue
    sleep 1
    continue
  fi
  woke=0 status=0
  wait "$runner_pid" || status=$?
  if [ "$woke" = 1 ] && [ "$status" -gt 128 ]; then
    kill -0 "$runner_pid" 2>/dev/null && continue  # a signal woke us; the runner is at work
    again=0
    wait "$runner_pid" 2>/dev/null || again=$?
    [ "$again" = 127 ] || status="$again"
  fi
  rc="$status"
done
# The runner ended, but launch.py or ranks may outlive it (the runner dies of a TERM, launch.py
# of a USR1): stop what is left and wait for it, the ranks' checkpoint included.
if [ "$multi" = 0 ]; then
  while job_alive; do
    if [ "$stopping" = 0 ]; then
      stop_job "DeepSpeed's launcher ended with status $rc while ranks still ran" "$rc"
    else
      kill_overdue
    fi
    sleep 0.2
  done
fi
if [ "$multi" = 1 ] && [ "$launcher" = pdsh ]; then
  for ((i = 0; i < 100; i++)); do  # the filters print the last lines and see pdsh's last words
    [ -e "$jobdir/stdout.eof" ] && [ -e "$jobdir/stderr.eof" ] && break
    sleep 0.05
  done
  collect_exits
  if [ -e "$jobdir/failed" ]; then
    read -r code host < "$jobdir/failed"
    [ "$code" != 75 ] || exit 75  # a host's ranks stopped on a signal first, with a checkpoint
    echo "launch.sh: the job failed: the launcher on $host exited with status $code" >&2
    exit "$code"
  fi
fi
# 75: the ranks saved a checkpoint on the stop (or stopped before there was anything to save)
# and want the same command again (app/faults/preemption.py)
[ "$(ranks_verdict)" != 75 ] || exit 75
[ "$stopping" = 0 ] || [ "$rc" = 0 ] || [ "$rc" = 75 ] || exit "$stop_status"
exit "$rc"
