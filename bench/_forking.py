"""A benchmark's measured side in a forked child of the script (bench_engine_build,
bench_scaling_ceiling, gpu_mfu on CPU): the script has imported only what the child should not
time, so the child starts where a fresh interpreter would after those imports, without paying
them again (and, run from a test's warm process, without the ~6 CPU-s of torch, DeepSpeed and
transformers). Not for a GPU: CUDA state does not survive a fork."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable


def fork_call(fn: Callable[[], object], output: int | None = None) -> int:
    """`fn()` in a forked child, its stdout and stderr to the file descriptor `output` when
    given; the child's pid (`wait_exit`). The child exits 0 when `fn` returns, with a SystemExit's
    code, or 1 after printing the traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if output is not None:
            os.dup2(output, 1)
            os.dup2(output, 2)
        fn()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_exit(pid: int) -> int:
    """The exit status of the child `pid`, as a process's (-N: killed by signal N)."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
