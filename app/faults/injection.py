"""Switches that make a run misbehave on purpose, for the tests that show the app copes
(docs/design.md, "Faults"): read from the environment, off unless a test sets them. They are
applied once at start-up (`slow_loaders` and `install`, called by app.build; `die_in_save` by
app.checkpoint.store), so the training loop's source holds no test lines.

    DSPRETRAIN_TEST_SLOW_LOADER=RANK:SECONDS   that rank waits SECONDS more for every micro batch
                                               (a starved loader: telemetry must name the rank)
    DSPRETRAIN_TEST_POISON=G:KIND              KIND spike|nan: global batch G's loss is a spike, or
                                               NaN; nangrad: one element of rank 0's gradient is
                                               NaN, the loss finite (the step guard skips it)
    DSPRETRAIN_TEST_HANG=RANK:STEP             that rank hangs at that step (the watchdog)
    DSPRETRAIN_TEST_DIE_IN_SAVE=STEP           the process dies halfway through that step's save
    DSPRETRAIN_TEST_DAMAGE_SAVE=STEP           that step's first save is damaged once complete
    DSPRETRAIN_TEST_NO_TRAINING=1              a run that passed its checks stops before it writes
                                               or trains (the tests' fast subset: tests/conftest.py)
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping


def slow_loaders(loaders: Callable[..., Iterable], rank: int,
                 env: Mapping[str, str] = os.environ) -> Callable[..., Iterable]:
    """`loaders` (a factory of train loaders), its loaders delayed on the rank
    DSPRETRAIN_TEST_SLOW_LOADER names (unchanged otherwise)."""
    seconds = _aimed_at(env, "DSPRETRAIN_TEST_SLOW_LOADER", rank)
    if seconds is None:
        return loaders
    return lambda *args, **kwargs: _delayed(loaders(*args, **kwargs), float(seconds))


def _aimed_at(env: Mapping[str, str], name: str, key: int) -> str | None:
    """The rest of `name=KEY:REST` when KEY is `key`; None when unset or aimed elsewhere."""
    spec = env.get(name)
    if not spec:
        return None
    first, rest = spec.split(":", 1)
    return rest if int(first) == key else None


def _delayed(batches: Iterable, seconds: float) -> Iterator:
    for batch in batches:
        time.sleep(seconds)
        yield batch


def install(trainer, env: Mapping[str, str] = os.environ) -> None:
    """Apply DSPRETRAIN_TEST_POISON and DSPRETRAIN_TEST_HANG to a built app.trainer.Trainer:
    the engine's forward poisons the loss of the global batch being trained on, and the hung
    rank's `train_step` stops at its step."""
    if env.get("DSPRETRAIN_TEST_POISON", "").endswith(":nangrad"):
        nan_gradient(trainer, env)
    elif env.get("DSPRETRAIN_TEST_POISON"):
        forward, state = trainer.engine.forward, trainer.state

        def poisoned_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            if out.loss is not None:  # the global batch of the step being trained
                out.loss = poisoned(out.loss, state.consumed_samples // trainer.global_batch,
                                    env)
            return out

        trainer.engine.forward = poisoned_forward  # an nn.Module calls its instance's forward
    if env.get("DSPRETRAIN_TEST_HANG"):
        train_step = trainer.train_step

        def hanging_step() -> None:
            hang_here(trainer.world.rank, trainer.state.step + 1, env)
            train_step()

        trainer.train_step = hanging_step


def nan_gradient(trainer, env: Mapping[str, str] = os.environ) -> None:
    """DSPRETRAIN_TEST_POISON=G:nangrad: while global batch G trains, rank 0's gradient of the
    model's first weight gets a NaN in its first element as it arrives in backward (a tensor
    hook, before the gradient is accumulated and reduced: as a backward overflow or a bad device
    would put it there). The loss stays finite; the reduction spreads the NaN to every rank."""
    if trainer.world.rank != 0:
        return
    weight = next(p for p in trainer.engine.module.parameters() if p.requires_grad)

    def poison(grad):
        batch = trainer.state.consumed_samples // trainer.global_batch
        if _aimed_at(env, "DSPRETRAIN_TEST_POISON", batch) != "nangrad":
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    weight.register_hook(poison)


def poisoned(loss, global_batch: int, env: Mapping[str, str] = os.environ):
    """DSPRETRAIN_TEST_POISON=G:spike|nan: the loss of global batch G is made 1000x larger, or
    NaN (a poisoned batch: the anomaly monitor must catch it, and skipping G must cure it)."""
    kind = _aimed_at(env, "DSPRETRAIN_TEST_POISON", global_batch)
    if kind is None:
        return loss
    return loss * 1000.0 if kind == "spike" else loss * float("nan")


def hang_here(rank: int, step: int, env: Mapping[str, str] = os.environ) -> None:
    """DSPRETRAIN_TEST_HANG=RANK:STEP: that rank stops making progress at that step."""
    at = _aimed_at(env, "DSPRETRAIN_TEST_HANG", rank)
    if at is not None and int(at) == step:
        while True:
            time.sleep(1)


def die_in_save(step: int, env: Mapping[str, str] = os.environ) -> None:
    """DSPRETRAIN_TEST_DIE_IN_SAVE=STEP: the process dies (SIGKILL-like) in the middle of that
    step's save, after DeepSpeed wrote its files and before `latest` moved."""
    if env.get("DSPRETRAIN_TEST_DIE_IN_SAVE") == str(step):
        os._exit(137)


_damaged: set[str] = set()


def damage_after_save(step: int, tag_dir: Path, env: Mapping[str, str] = os.environ) -> None:
    """DSPRETRAIN_TEST_DAMAGE_SAVE=STEP: once that step's first save is complete (its manifest
    and `latest` written), 4 KB in the middle of its model states are inverted, the size kept:
    damage under a finished checkpoint, which a rollback must find by the manifest."""
    if env.get("DSPRETRAIN_TEST_DAMAGE_SAVE") != str(step) or str(step) in _damaged:
        return
    _damaged.add(str(step))
    flip(next(tag_dir.glob("mp_rank_*_model_states.pt")))


def flip(path: Path, n: int = 4096) -> None:
    """Invert n bytes in the middle of a file, its size kept: damage only its checksum tells."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2 - n // 2)
        data = f.read(n)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


class TrainingInFastTest(RuntimeError):
    """A run got past its checks in a test the fast subset runs (not marked slow)."""


def refuse_training(env: Mapping[str, str] = os.environ) -> None:
    """DSPRETRAIN_TEST_NO_TRAINING=1: the run has passed every check of its plan and would now
    write its run directory and train, which no test of the fast subset may do (tests/conftest.py
    sets it for every test not marked slow): stop with a traceback that says so."""
    if env.get("DSPRETRAIN_TEST_NO_TRAINING"):
        raise TrainingInFastTest("a test not marked slow started a training run "
                                 "(DSPRETRAIN_TEST_NO_TRAINING): mark it slow (tests/README.md)")


def slow_start(env: Mapping[str, str] = os.environ) -> None:
    """DSPRETRAIN_TEST_SLOW_START=SECONDS: start-up waits up to that long once the run is planned,
    so a test's signal surely lands before the loop; a stop signal (which only sets a flag) ends
    the wait, and the start-up's next safe point stops the run."""
    seconds = env.get("DSPRETRAIN_TEST_SLOW_START")
    if seconds:
        from app.faults import preemption

        end = time.monotonic() + float(seconds)
        while time.monotonic() < end and not preemption.requested():
            time.sleep(0.05)
