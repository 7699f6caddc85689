"""Shared session fixtures: a real corpus (Python's own stdlib sources), tokenizers trained on it
through the real CLI, and datasets prepared with them. Small, so the session builds them in
seconds; tests that change data make their own copies."""
from __future__ import annotations

import gc
import os
import sys

# Collection imports torch, DeepSpeed and transformers (~500k objects that live as long as the
# worker): the automatic collections walking them while they are made, and again in every full
# collection of the tests after, are pure cost. Off until collection ends, then what it made is
# frozen out of the collector's way (pytest_collection_finish), as app/__main__.py does for a run.
gc.disable()
# pytest keeps the test modules it rewrote for their asserts as .pyc files beside them, unless
# the environment says never to write bytecode (PYTHONDONTWRITEBYTECODE, set by some container
# images, this box's too): then every collecting process (each pytest-xdist worker, each run)
# parses and rewrites the ~190 modules again, ~5 CPU-s of the ~15 a collection takes here.
sys.dont_write_bytecode = False
# Before anything imports wandb, transformers or tokenizers.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Before torch loads: one thread for the tests' own tensors (a model's forward in a test, an
# in-process build). Each pytest worker shares the cores with the other and with the runs it
# starts; a second OpenMP thread spins at every barrier for a core that is busy elsewhere: 17
# forwards of bert-tiny took 2.6-4.5 s with 2 threads against 0.37 s with 1, on this 2-core box
# under load. Runs started in a clean environment (tests/helpers.py clean_env) get 1 too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from data_tools.__main__ import main as data_tools_main  # noqa: E402
from tests import file_seconds  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# ~1.6 MB of .py: four packages and some big top-level modules, copied in a fixed order.
STDLIB_PACKAGES = ("json", "email", "http", "logging")
STDLIB_MODULES = ("argparse", "dataclasses", "typing", "pathlib", "shutil", "textwrap",
                  "string", "tarfile", "inspect", "ast", "functools", "enum")


PROGRESS_PREFIXES = ("reading corpus:", "prepare:", "verify:", "adopt:")


NO_TRAINING = "DSPRETRAIN_TEST_NO_TRAINING"


def _workers() -> int:
    """TEST_WORKERS, else one per core up to 8: the one rule of tests/run.sh and of whole-suite
    pytest runs."""
    if os.environ.get("TEST_WORKERS"):
        return int(os.environ["TEST_WORKERS"])
    return min(len(os.sched_getaffinity(0)), 8)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A run of the whole suite or a marked part of it (`python -m pytest`, `-m "not slow"`: no
    file or test named) takes one pytest-xdist worker per core, each taking whole files (their
    module fixtures train once), as tests/run.sh does. `-n N` or TEST_WORKERS=N chooses (0: this
    process); a run that names files or tests stays in this process, which starts faster."""
    # whole files to the workers in the order collection leaves them (heaviest first), not
    # xdist's (most tests first): tests/run.sh passes -n and --dist itself
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if (config.option.numprocesses is not None or os.environ.get("PYTEST_XDIST_WORKER")
            or not config.pluginmanager.hasplugin("xdist")
            or config.args_source == pytest.Config.ArgsSource.ARGS
            or config.option.collectonly or config.getoption("usepdb", False)):
        return
    workers = _workers()
    if workers > 1:
        config.option.numprocesses = workers
        if config.option.dist == "no":
            config.option.dist = "loadfile"


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """pytest-xdist's controller never collects (its workers do): its collector goes back on."""
    if config.pluginmanager.has_plugin("dsession"):
        gc.enable()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test not marked slow may not train: any run it starts, its fixtures' included (a fork of
    the warm process, a real process, or `build` in this one), stops once its checks pass
    (app/faults/injection.py `refuse_training`), so the test fails and names the mark it needs."""
    if item.get_closest_marker("slow"):
        os.environ.pop(NO_TRAINING, None)
    else:
        os.environ[NO_TRAINING] = "1"


def pytest_runtest_teardown(item):
    os.environ.pop(NO_TRAINING, None)


def pytest_collection_modifyitems(items):
    """`multirank` implies `slow`: a test that starts ranks through the launcher, or reads a
    fixture that does, takes tens of seconds; `-m "not slow"` leaves it out without a second mark
    on every such test. The files run heaviest first (tests/file_seconds.py; a file not measured
    yet last), each in its own order: whole files go to the pytest-xdist workers in this order."""
    for item in items:
        if item.get_closest_marker("multirank") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    seconds = file_seconds.load()
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0.0), order[item]))


@pytest.fixture
def one_line_error(capsys):
    """Check a user error: one line on stderr (progress bars aside) naming each given needle."""
    def check(*needles: str) -> str:
        raw = capsys.readouterr().err
        assert "Traceback" not in raw, raw
        lines = [line for line in raw.replace("\r", "\n").splitlines()
                 if line.strip() and not line.startswith(PROGRESS_PREFIXES)]
        assert len(lines) == 1, lines
        for needle in needles:
            assert needle in lines[0], lines[0]
        return lines[0]
    return check


def run_data_tools(*argv: str) -> None:
    """Run `python -m data_tools ...` in-process; a non-zero exit fails the calling fixture."""
    rc = data_tools_main([str(a) for a in argv])
    assert rc == 0, f"data_tools {' '.join(map(str, argv))} exited {rc}"


@pytest.fixture(scope="session")
def stdlib_dir(tmp_path_factory) -> Path:
    """A deterministic subset of the running Python's stdlib sources (use --include '*.py')."""
    root = tmp_path_factory.mktemp("stdlib")
    for pkg in STDLIB_PACKAGES:
        for src in sorted((STDLIB / pkg).rglob("*.py")):
            if "__pycache__" in src.parts:
                continue
            dst = root / src.relative_to(STDLIB)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    for mod in STDLIB_MODULES:
        shutil.copyfile(STDLIB / f"{mod}.py", root / f"{mod}.py")
    return root


def _tokenizer(kind: str, stdlib_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / kind
    run_data_tools("tokenizer", "--input", stdlib_dir, "--include", "*.py", "--out", out,
                   "--kind", kind, "--vocab-size", "2000")
    return out


def _dataset(name: str, stdlib_dir: Path, tokenizer: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / name
    run_data_tools("prepare", "--input", stdlib_dir, "--include", "*.py",
                   "--tokenizer", tokenizer, "--out", out, "--val-fraction", "0.05")
    return out


@pytest.fixture(scope="session")
def wordpiece_tokenizer(stdlib_dir, tmp_path_factory) -> Path:
    return _tokenizer("wordpiece", stdlib_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def bpe_tokenizer(stdlib_dir, tmp_path_factory) -> Path:
    return _tokenizer("bpe", stdlib_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def mlm_dataset(stdlib_dir, wordpiece_tokenizer, tmp_path_factory) -> Path:
    """WordPiece ids of stdlib_dir, [SEP] after each document, val fraction 0.05."""
    return _dataset("mlm", stdlib_dir, wordpiece_tokenizer, tmp_path_factory)


@pytest.fixture(scope="session")
def clm_dataset(stdlib_dir, bpe_tokenizer, tmp_path_factory) -> Path:
    """Byte-level BPE ids of stdlib_dir, <|endoftext|> after each document, val fraction 0.05."""
    return _dataset("clm", stdlib_dir, bpe_tokenizer, tmp_path_factory)
