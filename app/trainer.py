"""The training loop: `engine(batch)`, `engine.backward(loss)`, `engine.step()`, and its named
calls (log, evaluate, save) at their intervals.

The loop never imports DeepSpeed: it sees the engine as an `nn.Module` with backward/step, and
uses app.engine for the handful of cross-rank reductions, only at log and eval intervals. Time is
kept by app.timing, the state by app.train_state, the console and files by app.metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from app import checkpoint
from app.device import ComputeClock, memory_gb, synchronize, to_device
from app import telemetry
from app.engine import (World, all_reduce_sum, gather_rows, grad_norm_before_step, loss_scale,
                        reported_grad_norm)
from app.masking import IGNORE_INDEX
from app.metrics import MetricsLogger
from app.timing import Window
from app.train_state import TrainState


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


class Trainer:
    def __init__(self, *, engine, world: World, device: torch.device, schedule: Schedule,
                 state: TrainState, seq_len: int, objective: str,
                 train_batches: Callable[[int], Iterable],
                 eval_batches: Callable[[], Iterable] | None,
                 logger: MetricsLogger, ckpt_dir: Path, shape: telemetry.RunShape,
                 compute_clock: ComputeClock):
        self.engine, self.world, self.device = engine, world, device
        self.schedule, self.state = schedule, state
        self.seq_len, self.objective = seq_len, objective
        self.eval_batches = eval_batches
        self.logger, self.ckpt_dir = logger, ckpt_dir
        self.global_batch = engine.train_batch_size()  # read back: the engine owns batch sizes
        self.grad_accum = engine.gradient_accumulation_steps()
        self.batches: Iterator = iter(train_batches(state.consumed_samples))
        self.shape = shape
        self.window = Window(state.step, sync=synchronize, clock=compute_clock)
        self._reset_window()
        self.last_eval: dict[str, float] = {}
        self.intervals: list[dict[str, Any]] = []  # the logged figures, for summary.json
        self.train_seconds = 0.0
        self.session_steps = 0

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        s, sched = self.state, self.schedule
        self.engine.train()
        self.logger.start_progress(total=sched.stop_step, done=s.step)
        last_eval_step = last_save_step = s.step if s.step else None
        session = Window(s.step, sync=synchronize)
        while s.step < sched.stop_step:
            self.train_step()
            self.logger.advance()
            if s.step % sched.log_every == 0 or s.step == sched.stop_step:
                self.log()
            if sched.eval_every and s.step % sched.eval_every == 0:
                self.evaluate()
                last_eval_step = s.step
            if sched.save_every and s.step % sched.save_every == 0:
                self.save()
                last_save_step = s.step
        self.logger.end_progress()
        self.train_seconds = session.elapsed()
        if last_eval_step != s.step:
            self.evaluate()
        if last_save_step != s.step:
            self.save()
        return self.summary()

    def train_step(self) -> None:
        """One optimizer step: grad_accum micro steps; DeepSpeed steps at the boundary."""
        s = self.state
        upcoming = s.step + 1
        log_now = upcoming % self.schedule.log_every == 0 or upcoming == self.schedule.stop_step
        self._lr = self.engine.get_lr()[0]  # the LR this step applies
        for micro in range(self.grad_accum):
            with self.window.waiting_for_data():
                batch = next(self.batches)
            with self.window.forward():
                loss = self.engine(**to_device(batch, self.device)).loss
            self.engine.backward(loss)
            if log_now and micro == self.grad_accum - 1:
                self._grad_norm = grad_norm_before_step(self.engine)
            skipped = self.engine.skipped_steps  # a host counter: reading it costs nothing
            self.engine.step()
            if self.engine.skipped_steps != skipped:
                # fp16 overflow: DeepSpeed skipped the update and held the LR schedule back; the
                # schedule follows the step counter (and the data), so it advances all the same
                self.engine.lr_scheduler.step()
            self._loss_sum += loss.detach().float()  # stays on device: no sync per micro step
            self._micro_steps += 1
        s.advance(self.global_batch, self.seq_len)
        self.session_steps += 1

    # -- named calls ----------------------------------------------------------------------------

    def log(self) -> None:
        """Gather this window's figures from every rank (the only host sync of training: one
        small all-gather) and log them."""
        s = self.state
        wall = self.window.elapsed()  # syncs the device first
        loss_sum = self._loss_sum.double().item()  # log-time host sync
        rows = gather_rows([loss_sum, float(self._micro_steps), wall, self.window.data_wait,
                            self.window.forward_seconds(), *memory_gb()], self.device)
        norm = (float(self._grad_norm) if self._grad_norm is not None
                else reported_grad_norm(self.engine))
        record = {"step": s.step, "consumed_samples": s.consumed_samples,
                  "tokens_seen": s.tokens_seen,
                  "train/loss": sum(r[0] for r in rows) / max(sum(r[1] for r in rows), 1),
                  "train/lr": self._lr, "train/grad_norm": norm,
                  "train/loss_scale": loss_scale(self.engine),
                  "train/skipped_steps": self.engine.skipped_steps,
                  **telemetry.interval([r[2:] for r in rows], s.step - self.window.first_step,
                                       self.shape)}
        self.logger.log(record)
        if not self.intervals:
            self.logger.note(telemetry.expected_time(record["perf/step_time_ms"],
                                                     self.schedule.stop_step - s.step))
        self.intervals.append(record)
        self._reset_window()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and MLM accuracy) over the val pass, token-weighted across ranks."""
        if self.eval_batches is None:
            return {}
        with self.window.paused():  # evaluation is not training time
            result = self._evaluate()
        s = self.state
        if s.best_eval_loss is None or result["eval/loss"] < s.best_eval_loss:
            s.best_eval_loss = result["eval/loss"]
        self.last_eval = result
        self.logger.log({"step": s.step, "consumed_samples": s.consumed_samples,
                         "tokens_seen": s.tokens_seen, **result})
        return result

    def _evaluate(self) -> dict[str, float]:
        self.engine.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with torch.random.fork_rng(devices=[]):  # evaluation must not shift training randomness
            for batch in self.eval_batches():
                batch = to_device(batch, self.device)
                # MLM: logits at the masked positions only; CLM: the loss is ours, in chunks
                labels = batch["mlm_labels"] if self.objective == "mlm" else batch.pop("labels")
                logits = self.engine(**batch).logits
                totals += token_sums(logits, labels, self.objective)
        all_reduce_sum(totals)
        loss_sum, count, correct = totals.tolist()  # eval-time host sync
        self.engine.train()
        loss = loss_sum / max(count, 1)
        result = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
        if self.objective == "mlm":
            result["eval/accuracy"] = correct / max(count, 1)
        return result

    def save(self) -> Path | None:
        with self.window.paused():  # saving is not training time
            path = checkpoint.save(self.engine, self.ckpt_dir, step=self.state.step,
                                   state=self.state.state_dict(), rank=self.world.rank,
                                   keep_last=self.schedule.keep_last,
                                   skip_errors=self.schedule.skip_failed_saves)
        if path is not None:
            self.logger.note(f"saved {path}")
        return path

    def summary(self) -> dict[str, Any]:
        s = self.state
        trained_tokens = self.session_steps * self.global_batch * self.seq_len
        return {"steps": s.step, "consumed_samples": s.consumed_samples,
                "tokens_seen": s.tokens_seen, "session_steps": self.session_steps,
                "train_seconds": round(self.train_seconds, 3),
                "tokens_per_sec": trained_tokens / max(self.train_seconds, 1e-9),
                "samples_per_sec": self.session_steps * self.global_batch
                / max(self.train_seconds, 1e-9),
                "best_eval_loss": s.best_eval_loss, "final_eval": self.last_eval,
                **telemetry.run_figures(self.intervals)}

    def _reset_window(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._micro_steps = 0
        self.window.restart(self.state.step)
        self._grad_norm = None
        self._lr = 0.0


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
