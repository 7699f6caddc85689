"""The training loop: `engine(batch)`, `engine.backward(loss)`, `engine.step()`, and its named
calls (log, evaluate, save) at their intervals.

The loop never imports DeepSpeed: it sees the engine as an `nn.Module` with backward/step, and
uses app.runtime.dist for its cross-rank collectives. Time is kept by app.telemetry.timing, the
state by app.checkpoint.train_state, the console and files by app.telemetry.sinks; anomalies and
stop signals are handled by app.faults.recovery. Built by app.build.

Host syncs and collectives, and when. A training step has no host sync, DeepSpeed's included
outside fp16 (app.runtime.patches `sync_free_steps`; tests/test_gpu_path.py,
tests/test_host_syncs.py):
- every step: the stop-flag all-reduce (app.faults.preemption), one integer on the job's group,
  started at one step boundary and read LAG boundaries later: it never waits for the device;
- at a log step (`gather`, then `log`): one device synchronize (the clock), one copy of the
  device values (the step losses since the last check point, which the anomaly monitor then
  judges on the host, the loss sum, the gradient norm) to the host, one all-gather of every
  rank's row (the anomaly marks and the window's figures; read back row by row), which the
  anomaly check and the log both read; where DeepSpeed keeps the gradient norm (ZeRO 1-3, bf16,
  fp16), reading it is one more copy;
- at a save that is not a log step, and on a stop signal: one copy of the step losses since the
  last check point and one all-gather of the marks (the save itself then syncs, in DeepSpeed and
  app.checkpoint.store);
- at an eval step: one all-reduce of the eval sums and their copy to the host.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from app import rundir
from app.checkpoint import store as checkpoint
from app.checkpoint.train_state import TrainState
from app.data.loader import DataFault
from app.data.masking import IGNORE_INDEX
from app.faults import anomaly
from app.faults.preemption import StopRequests
from app.faults.recovery import Recovery
from app.faults.watchdog import Watchdog
from app.runtime.device import ComputeClock, memory_gb, synchronize, to_device
from app.runtime.dist import World, all_reduce_sum, gather_rows
from app.runtime.engine import (
    apply_lr_schedule,
    global_batch,
    grad_norm_before_step,
    loss_scale,
    model_state_bytes,
    optimizer_step,
    reported_grad_norm,
)
from app.telemetry import figures as telemetry
from app.telemetry.sinks import MetricsLogger
from app.telemetry.timing import Window

# A rank's row of a log step's `gather`: the anomaly marks, the loss sum, the micro steps and the
# gradient norm, then from FIGURES on telemetry.interval's columns (wall time, data wait, ...)
LOSS_SUM, MICRO_STEPS, GRAD_NORM, FIGURES = 2, 3, 4, 5
REAL_TOKENS = FIGURES + telemetry.ROW.index("real_tokens")


@dataclass(frozen=True)
class Schedule:
    """When things happen, in optimizer steps."""

    total_steps: int
    """End of the LR schedule (and of training, unless stop_step is earlier)."""
    stop_step: int
    log_every: int
    eval_every: int
    save_every: int
    keep_last: int
    skip_failed_saves: bool = False
    """A save that fails is skipped with a warning instead of stopping the run."""


@dataclass
class Guards:
    """What keeps a run alive (docs/design.md, "Faults"): anomaly recovery (the rules, this
    rank's loss monitor, the skipped batches), the agreed stop requests (signals), the hang
    watchdog."""

    recovery: Recovery
    stops: StopRequests
    watchdog: Watchdog


@dataclass(frozen=True)
class EvalSet:
    """A validation pass: the dataset's (name None), or one source's of a mixture."""

    name: str | None
    weight: float
    """Its weight in the overall eval/loss (a mixture's source weight)."""
    batches: Callable[[], Iterable]


class Trainer:
    def __init__(self, *, engine, world: World, device: torch.device, schedule: Schedule,
                 state: TrainState, seq_len: int, objective: str,
                 train_batches: Callable[[int, frozenset[int]], Iterable],
                 eval_sets: list[EvalSet], logger: MetricsLogger, run_dir: Path,
                 shape: telemetry.RunShape, compute_clock: ComputeClock, guards: Guards,
                 data_figures: Callable[[int], dict[str, float]] = lambda position: {}):
        self.engine, self.world, self.device = engine, world, device
        self.schedule, self.state = schedule, state
        self.seq_len, self.objective = seq_len, objective
        self.train_batches, self.eval_sets = train_batches, eval_sets
        self.data_figures = data_figures  # per-source epochs of a mixture, at a stream position
        self.logger, self.run_dir = logger, run_dir
        self.ckpt_dir = run_dir / rundir.CHECKPOINTS
        self.shape, self.guards = shape, guards
        self.global_batch = global_batch(engine)  # read back: the engine owns batch sizes
        self.grad_accum = engine.gradient_accumulation_steps()
        self.batches: Iterator = iter(train_batches(state.consumed_samples,
                                                    guards.recovery.skip))
        self.window = Window(state.step, sync=synchronize, clock=compute_clock,
                             step_clock=compute_clock.another())
        self._reset_window()
        self.last_eval: dict[str, float] = {}
        self.eval_empty_said = False  # the warning of an eval with no token to predict, once
        self.intervals: list[dict[str, Any]] = []  # the logged figures, for summary.json
        self.train_seconds = 0.0
        self.session_steps = 0
        self.session_real_tokens = 0.0  # over the logged windows, all ranks
        self._real_pending = 0  # this rank's, since the last check point (real_tokens_seen)
        self._last_save = state.step if state.step else None

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        s, sched, recovery = self.state, self.schedule, self.guards.recovery
        self.engine.train()
        self.logger.start_progress(total=sched.stop_step, done=s.step)
        outer = getattr(self.engine, "app_outer", None)  # --dp-mode diloco (app.runtime.outer)
        while s.step < sched.stop_step:
            try:
                self.train_step()
            except DataFault as e:  # a shard cut short or corrupt: the run stops, saved first
                raise DataFault(f"{e}{self.save_on_fault()}") from None
            if outer is not None and (outer.due(s.step) or s.step == sched.total_steps):
                with self.window.optimizer():  # the islands' sync: the round's last step
                    outer.sync(s.step)
            self.logger.advance()
            last = s.step == sched.stop_step
            log_due = s.step % sched.log_every == 0 or last
            save_due = (sched.save_every and s.step % sched.save_every == 0) or last
            if log_due or save_due:  # a check point: saves only ever follow a clean check
                rows = self.gather(figures=log_due)
                if recovery.check(rows, self.rewind):
                    self.restart()
                    continue  # rolled back: the state is the checkpoint's
                if log_due:
                    self.log(rows)
            if (sched.eval_every and s.step % sched.eval_every == 0) or last:
                self.evaluate()
            if save_due:
                self.save()
            if self.guards.stops.agreed():
                recovery.stop_for_signal(self.gather(figures=False), self.rewind,
                                         None if self._last_save == s.step else self.save)
        self.logger.end_progress()
        return self.summary()

    def train_step(self) -> None:
        """One optimizer step: grad_accum micro steps; DeepSpeed steps at the boundary."""
        s, beat = self.state, self.guards.watchdog.beat
        upcoming = s.step + 1
        log_now = upcoming % self.schedule.log_every == 0 or upcoming == self.schedule.stop_step
        self._lr = self.engine.get_lr()[0]  # the LR this step applies
        batch_index = s.consumed_samples // self.global_batch
        step_loss = None  # the micro losses' sum, on the device: no sync per micro step
        for micro in range(self.grad_accum):
            beat("waiting for data")
            with self.window.waiting_for_data():
                batch = next(self.batches)
            real = real_tokens(batch, self.seq_len)
            self._real_tokens += real
            self._real_pending += real
            beat("in forward/backward (and the gradient all-reduce)")
            with self.window.forward():
                loss = self.engine(**to_device(batch, self.device)).loss
            self.engine.backward(loss)
            if log_now and micro == self.grad_accum - 1:
                self._grad_norm = grad_norm_before_step(self.engine)
                self._state_bytes = model_state_bytes(self.engine)  # while gradients exist
            beat("in the optimizer step")
            with self.window.optimizer():
                skipped = optimizer_step(self.engine)  # the boundary's: was it applied?
            loss = loss.detach().float()  # no copy when it is fp32 already
            step_loss = loss if step_loss is None else step_loss + loss
        self._loss_sum += step_loss
        self._micro_steps += self.grad_accum
        mean = step_loss if self.grad_accum == 1 else step_loss / self.grad_accum
        self.guards.recovery.observe(upcoming, batch_index, mean, skipped)
        s.advance(self.global_batch, self.seq_len, self.guards.recovery.skip)
        self.session_steps += 1
        beat("training")

    # -- check points -------------------------------------------------------------------------

    def gather(self, figures: bool) -> list[list[float]]:
        """Every rank's row at a check point, in rank order, in one all-gather: its anomaly
        marks, then at a log step (`figures`) its window's figures. At a log step this is the
        host sync of training: the clock syncs the device, the device values come to the host
        in one copy, and the all-gather carries them with the host figures."""
        monitor = self.guards.recovery.monitor
        if not figures:
            row = list(monitor.judge(monitor.pending().tolist()))
        else:
            wall = self.window.elapsed()  # syncs the device first
            norm = (self._grad_norm if self._grad_norm is not None
                    else torch.tensor(math.nan, device=self.device))
            *losses, loss_sum, norm = torch.cat([monitor.pending(),
                                                 self._loss_sum.double().view(1),
                                                 norm.double().view(1)]).tolist()
            row = [*monitor.judge(losses), loss_sum, float(self._micro_steps), norm, wall,
                   self.window.data_wait, self.window.forward_seconds(), *memory_gb(),
                   self._state_bytes / 2**30, float(self._real_tokens),
                   self.window.optimizer_seconds()]
        rows = gather_rows([*row, float(self._real_pending)], self.device)
        return self._count_real_tokens(rows)

    def _count_real_tokens(self, rows: list[list[float]]) -> list[list[float]]:
        """Every rank's real tokens since the last check point (the rows' last column, taken
        off) into the state's real_tokens_seen: the same sum on every rank, saved with the
        state; a rollback then loads the checkpoint's."""
        self.state.real_tokens_seen += int(sum(r.pop() for r in rows))
        self._real_pending = 0
        return rows

    def rewind(self, tag: str) -> None:
        """The engine, the train state (its cool-down too) and the RNG from checkpoint `tag`:
        a rollback (app.faults.recovery), which then moves the state past skipped batches."""
        self.state.load_state_dict(checkpoint.load(self.engine, self.ckpt_dir, tag))
        checkpoint.restore_rng(self.ckpt_dir, tag, rank=self.world.rank)

    def restart(self) -> None:
        """After a rollback: the LR from the schedule (and cool-down) at the state's step, the
        data from the state's position without the skipped batches, a new timing window."""
        apply_lr_schedule(self.engine)
        self.batches = iter(self.train_batches(self.state.consumed_samples,
                                               self.guards.recovery.skip))
        self._reset_window()

    # -- named calls ----------------------------------------------------------------------------

    def log(self, rows: list[list[float]]) -> None:
        """Log this window's figures, from every rank's row of the log step's `gather`."""
        s = self.state
        mine = rows[self.world.rank]
        wall = mine[FIGURES]
        norm = mine[GRAD_NORM] if self._grad_norm is not None else reported_grad_norm(self.engine)
        record = {"step": s.step, "consumed_samples": s.consumed_samples,
                  "tokens_seen": s.tokens_seen, "real_tokens_seen": s.real_tokens_seen,
                  "train/loss": (sum(r[LOSS_SUM] for r in rows)
                                 / max(sum(r[MICRO_STEPS] for r in rows), 1)),
                  "train/lr": self._lr, "train/grad_norm": norm,
                  "train/loss_scale": loss_scale(self.engine),
                  "train/skipped_steps": self.engine.skipped_steps + s.skipped_updates,
                  **self.data_figures(s.consumed_samples), **self._outer_figures(),
                  **telemetry.interval([r[FIGURES:] for r in rows], s.step - self.window.first_step,
                                       self.shape)}
        self.logger.log(record)
        self.train_seconds += wall
        self.session_real_tokens += sum(r[REAL_TOKENS] for r in rows)
        if not self.intervals:
            self.logger.note(telemetry.expected_time(record["perf/step_time_ms"],
                                                     self.schedule.stop_step - s.step))
        self.intervals.append(record)
        self._reset_window()

    def _outer_figures(self) -> dict[str, float]:
        """A low-communication run's syncs: the last one's wall time, how many, and the bytes
        each rank has sent across islands an optimizer step (this session)."""
        outer = getattr(self.engine, "app_outer", None)
        if outer is None:
            return {}
        return {"outer/sync_ms": outer.last_ms, "outer/syncs": outer.syncs,
                "outer/bytes_per_step": outer.bytes_sent / max(self.session_steps, 1)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and MLM accuracy) over the val pass, token-weighted across ranks; for a mixture
        per source too (`eval_figures`)."""
        if not self.eval_sets:
            return {}
        self.guards.watchdog.beat("evaluating")
        with self.window.paused():  # evaluation is not training time
            result = self._evaluate()
        self.guards.watchdog.beat("training")
        s = self.state
        if "eval/loss" not in result:  # not one token to predict: no figure, never a perfect 0
            if self.world.is_main and not self.eval_empty_said:
                self.eval_empty_said = True
                print("warning: eval: the validation split holds no token to predict (its "
                      "documents are empty or special tokens only): no eval figures",
                      file=sys.stderr, flush=True)
            return result
        if s.best_eval_loss is None or result["eval/loss"] < s.best_eval_loss:
            s.best_eval_loss = result["eval/loss"]
        self.last_eval = result
        self.logger.log({"step": s.step, "consumed_samples": s.consumed_samples,
                         "tokens_seen": s.tokens_seen, **result})
        return result

    def _evaluate(self) -> dict[str, float]:
        self.engine.eval()
        totals = torch.zeros(len(self.eval_sets), 3, dtype=torch.float64, device=self.device)
        with torch.random.fork_rng(devices=[]):  # evaluation must not shift training randomness
            for i, eval_set in enumerate(self.eval_sets):
                for batch in eval_set.batches():
                    real_tokens(batch, self.seq_len)  # not the model's
                    batch = to_device(batch, self.device)
                    # MLM: logits at the masked positions only; CLM: the loss is ours, in chunks
                    labels = (batch["mlm_labels"] if self.objective == "mlm"
                              else batch.pop("labels"))
                    logits = self.engine(**batch).logits
                    totals[i] += token_sums(logits, labels, self.objective)
        all_reduce_sum(totals)  # one reduction for every set
        self.engine.train()
        return eval_figures(self.eval_sets, totals.tolist(), self.objective)  # host sync

    def save(self) -> Path | None:
        self.guards.watchdog.beat("saving a checkpoint")
        self._last_save = self.state.step
        state = self.state.state_dict()
        outer = getattr(self.engine, "app_outer", None)
        if outer is not None:  # where the round stands: an export takes the global weights
            state["outer"] = {"every": outer.every, "synced_at": outer.synced_at}
        with self.window.paused():  # saving is not training time
            path = checkpoint.save(self.engine, self.ckpt_dir, step=self.state.step,
                                   state=state, rank=self.world.rank,
                                   keep_last=self.schedule.keep_last,
                                   skip_errors=self.schedule.skip_failed_saves)
        if path is not None:
            self.logger.note(f"saved {path}")
        self.guards.watchdog.beat("training")
        return path

    def save_on_fault(self) -> str:
        """Before a data fault stops the run: in a world of one (no other rank waits in a
        collective) the steps since the last save are saved, when the anomaly check is clean;
        what to say about it ('' when nothing was saved). The weights are the last whole
        step's: the failed step's micro batches never reached the optimizer."""
        s = self.state
        if self.world.world_size > 1 or s.step == 0 or self._last_save == s.step:
            return ""
        rows = self.gather(figures=False)
        if anomaly.earliest([(r[0], r[1]) for r in rows]) is not None:
            return ""
        path = self.save()
        return (f"; saved {path} (step {s.step}) first: once the data is whole, the same "
                f"command resumes from it") if path is not None else ""

    def close(self) -> None:
        self.guards.watchdog.close()
        self.guards.stops.close()
        self.logger.close()

    def summary(self) -> dict[str, Any]:
        s = self.state
        trained_tokens = self.session_real_tokens
        return {"steps": s.step, "consumed_samples": s.consumed_samples,
                "tokens_seen": s.tokens_seen, "real_tokens_seen": s.real_tokens_seen,
                "session_steps": self.session_steps,
                "train_seconds": round(self.train_seconds, 3),
                "tokens_per_sec": trained_tokens / max(self.train_seconds, 1e-9),
                "samples_per_sec": self.session_steps * self.global_batch
                / max(self.train_seconds, 1e-9),
                "best_eval_loss": s.best_eval_loss, "final_eval": self.last_eval,
                **telemetry.run_figures(self.intervals)}

    def _reset_window(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._micro_steps = 0
        self._real_tokens = 0  # this rank's, in the window's micro batches
        self.window.restart(self.state.step)
        self._grad_norm = None
        self._state_bytes = 0
        self._lr = 0.0


def real_tokens(batch: dict[str, torch.Tensor], seq_len: int) -> int | torch.Tensor:
    """The real (not padding) tokens of a micro batch, taken out of it: the loader's count of
    each sample's ("doc", "doc-packed"; app.data.loader.BatchLayout) summed on the host where the
    loader left it (a 0-d host tensor, read at the log step, not per micro step), else every
    token of the batch ("concat")."""
    tokens = batch.pop("tokens", None)
    if tokens is None:
        return int(batch["input_ids"].shape[0]) * seq_len
    return tokens.sum()


def eval_figures(sets: list[EvalSet], totals: list[list[float]], objective: str
                 ) -> dict[str, float]:
    """eval/loss, eval/perplexity (and MLM eval/accuracy) from each set's [loss sum, tokens,
    correct]. One set: token-weighted, as ever. A mixture: `eval/<name>/loss` per source, and
    the overall figures weighted by the sources' weights (the loss expected on the training
    mix, whatever the sizes of the val splits)."""
    # a set with no token to predict has no loss (0 / 0), never a perfect 0: left out
    counted = [(s, t) for s, t in zip(sets, totals) if t[1] > 0]
    if not counted:
        return {}
    sets, totals = [s for s, _ in counted], [t for _, t in counted]
    loss = [t[0] / t[1] for t in totals]
    accuracy = [t[2] / t[1] for t in totals]
    weights = [s.weight for s in sets]

    def mean(xs: list[float]) -> float:
        return sum(w * x for w, x in zip(weights, xs)) / sum(weights)

    result = {f"eval/{s.name}/loss": x for s, x in zip(sets, loss) if s.name is not None}
    overall = mean(loss)
    result.update({"eval/loss": overall, "eval/perplexity": math.exp(min(overall, 50.0))})
    if objective == "mlm":
        result["eval/accuracy"] = mean(accuracy)
    return result


def token_sums(logits: torch.Tensor, labels: torch.Tensor, objective: str,
               chunk_rows: int = 4096) -> torch.Tensor:
    """[summed cross-entropy, predicted tokens, correct predictions] of one batch (float64).

    CLM predicts token t+1 from position t (Hugging Face's shift); MLM the labelled positions.
    Rows go through fp32 `chunk_rows` at a time: a [batch x seq x vocab] fp32 copy of a large
    vocabulary's logits would not fit next to the model.
    """
    if objective == "clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_labels = labels.reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64, device=logits.device)
    for start in range(0, flat_labels.numel(), chunk_rows):
        rows = flat_logits[start:start + chunk_rows].float()
        target = flat_labels[start:start + chunk_rows]
        keep = target != IGNORE_INDEX
        sums[0] += F.cross_entropy(rows, target, ignore_index=IGNORE_INDEX, reduction="sum")
        sums[1] += keep.sum()
        sums[2] += ((rows.argmax(-1) == target) & keep).sum()
    return sums
