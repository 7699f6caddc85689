#!/usr/bin/env bash
# The tests' one command, on a fresh machine as on a used one: installs what the tests need, then
# runs ruff and mypy, then pytest with the arguments given (none: the whole suite; `-m "not slow"`:
# the fast subset). COVERAGE=1 measures line coverage of app/ and data_tools/ as it goes.
#
#   bash tests/run.sh [PYTEST ARGS...]
#
# Installs, each only when missing: the Debian packages of the multi-node tests (sshd, ssh and pdsh
# for launch.sh over real ssh to loopback addresses, `ip` for those addresses) and shellcheck, which
# lints launch.sh and bench/gpu_check.sh (apt-get: root, or sudo); torch's CPU build where no torch
# is installed (a GPU machine keeps its own CUDA build); the project with its dev extra at the
# versions the tests passed with (constraints.txt), and with it DeepSpeed's CPU ops the runs load
# (built once per installation). .ci/run calls this script; so can anyone.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
command -v pdsh >/dev/null || missing+=(pdsh)
command -v shellcheck >/dev/null || missing+=(shellcheck)
command -v ip >/dev/null || missing+=(iproute2)
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "tests/run.sh: installing ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi
shellcheck launch.sh bench/gpu_check.sh
# An unpinned torch would pull the CUDA wheels; the CPU build is the one the tests ran with. (Is
# it there: find_spec, not an import of torch, ~2 s here.)
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" ||
  python -m pip install -q torch==2.13.0
# The project, once per environment and checkout while setup.cfg, pyproject.toml and constraints.txt
# stay as they were (pip takes ~11 s to find nothing to do): a stamp in the environment says which.
stamp="$(python -c 'import sys; print(sys.prefix)')/.dspretrain-tests-installed"
want="$PWD $(cat setup.cfg pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q -c constraints.txt -e ".[dev]"
  # DeepSpeed's CPU ops the runs load, JIT-built once per installation (~1-2 min each): here,
  # with the install, not inside the suite by its first run that needs one (tests/zygote.py)
  python -c "from tests.zygote import build_cpu_ops; build_cpu_ops()" >/dev/null 2>&1 ||
    echo "tests/run.sh: DeepSpeed's CPU ops not built now; the first runs that need them will" >&2
  echo "$want" 2>/dev/null > "$stamp" || true
fi
# Lint and types first: seconds, and a failure there says more than a test would.
ruff check .
mypy  # setup.cfg [mypy]: app/runtime, app/checkpoint, app/data
# Never talk to wandb's servers from the tests.
export WANDB_MODE=offline
# One pytest worker per core, up to 8 (pytest-xdist; TEST_WORKERS=N to choose, 0 for none), each
# taking whole test files (their module fixtures train once). Most tests spend their time starting
# processes and waiting on them: two workers on 2 cores took 0.62 of one's time (README).
workers="$(python -c 'from tests.conftest import _workers; print(_workers())')"  # one rule
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
if [ "${COVERAGE:-0}" != 1 ]; then
  exec python -m pytest "${parallel[@]}" "$@"
fi
# COVERAGE=1: line coverage of app/ and data_tools/, every process the tests start included
# (setup.cfg [coverage:run]: subprocesses, the warm process's forks, os._exit)
rm -rf .coverage-data
mkdir -p .coverage-data
export COVERAGE_FILE="$PWD/.coverage-data/coverage" COVERAGE_RCFILE="$PWD/setup.cfg"
set +e
python -m coverage run -m pytest "${parallel[@]}" "$@"
rc=$?
set -e
python -m coverage combine -q
python -m coverage report | grep '^TOTAL'  # the last line may be "N empty files skipped."
exit "$rc"
