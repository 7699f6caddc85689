"""The training loop: `engine(batch)`, `engine.backward(loss)`, `engine.step()`, and its named
calls (log, evaluate, save) at their intervals.

The loop never imports DeepSpeed: it sees the engine as an `nn.Module` with backward/step, and
uses app.engine for the handful of cross-rank reductions, only at log and eval intervals.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from app import checkpoint
from app.device import memory_gb, to_device
from app.engine import (World, all_reduce_max, all_reduce_sum, grad_norm_before_step, loss_scale,
                        reported_grad_norm)
from app.metrics import MetricsLogger
from app.rundir import REFERENCE
from data_tools.output import writing

IGNORE_INDEX = -100


@dataclass
class TrainState:
    """What a checkpoint must carry besides the engine's states (one integer per counter)."""

    step: int = 0
    """Optimizer steps done."""
    consumed_samples: int = 0
    """Global samples trained on: where the loader restarts."""
    tokens_seen: int = 0
    best_eval_loss: float | None = None


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


class Trainer:
    def __init__(self, *, engine, world: World, device: torch.device, schedule: Schedule,
                 state: TrainState, seq_len: int, objective: str,
                 train_batches: Callable[[int], Iterable],
                 eval_batches: Callable[[], Iterable] | None,
                 logger: MetricsLogger, ckpt_dir: Path, checkpoint_extra: dict[str, Any],
                 run_dir: Path, skip_failed_saves: bool = False):
        self.engine, self.world, self.device = engine, world, device
        self.schedule, self.state = schedule, state
        self.seq_len, self.objective = seq_len, objective
        self.eval_batches = eval_batches
        self.logger, self.ckpt_dir, self.run_dir = logger, ckpt_dir, run_dir
        self.checkpoint_extra = checkpoint_extra
        self.skip_failed_saves = skip_failed_saves
        self.global_batch = engine.train_batch_size()  # read back: the engine owns batch sizes
        self.grad_accum = engine.gradient_accumulation_steps()
        # the loaders draw from a private generator (app.data), so this leaves dropout's RNG alone
        self.batches: Iterator = iter(train_batches(state.consumed_samples))
        self._reset_window()
        self.last_eval: dict[str, float] = {}
        self.train_seconds = 0.0
        self.session_steps = 0

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        s, sched = self.state, self.schedule
        self.engine.train()
        bar = tqdm(total=sched.stop_step, initial=s.step, desc="train", unit="step",
                   file=sys.stderr, disable=not self.world.is_main, dynamic_ncols=True)
        last_eval_step = last_save_step = s.step if s.step else None
        started = time.perf_counter()
        while s.step < sched.stop_step:
            self.train_step()
            bar.update(1)
            if s.step % sched.log_every == 0 or s.step == sched.stop_step:
                self.log()
            if sched.eval_every and s.step % sched.eval_every == 0:
                self.evaluate()
                last_eval_step = s.step
            if sched.save_every and s.step % sched.save_every == 0:
                self.save()
                last_save_step = s.step
        bar.close()
        self.train_seconds = time.perf_counter() - started
        if last_eval_step != s.step:
            self.evaluate()
        if last_save_step != s.step:
            self.save()
        self.write_reference()
        return self.summary()

    def train_step(self) -> None:
        """One optimizer step: grad_accum micro steps; DeepSpeed steps at the boundary."""
        s = self.state
        upcoming = s.step + 1
        log_now = upcoming % self.schedule.log_every == 0 or upcoming == self.schedule.stop_step
        self._lr = self.engine.get_lr()[0]  # the LR this step applies
        for micro in range(self.grad_accum):
            t0 = time.perf_counter()
            batch = next(self.batches)
            self._data_wait += time.perf_counter() - t0
            loss = self.engine(**to_device(batch, self.device)).loss
            self.engine.backward(loss)
            if log_now and micro == self.grad_accum - 1:
                self._grad_norm = grad_norm_before_step(self.engine)
            self.engine.step()
            self._loss_sum += loss.detach().float()  # stays on device: no sync per micro step
            self._micro_steps += 1
        s.step += 1
        s.consumed_samples += self.global_batch
        s.tokens_seen += self.global_batch * self.seq_len
        self.session_steps += 1

    # -- named calls ----------------------------------------------------------------------------

    def log(self) -> None:
        """Reduce this window's figures across ranks (the only host sync of training) and log."""
        s = self.state
        now = time.perf_counter()
        elapsed = now - self._window_start
        steps = s.step - self._window_step
        sums = torch.stack([self._loss_sum.to(torch.float64).cpu(),
                            torch.tensor(float(self._micro_steps), dtype=torch.float64),
                            torch.tensor(self._data_wait, dtype=torch.float64),
                            torch.tensor(elapsed, dtype=torch.float64)]).to(self.device)
        all_reduce_sum(sums)
        mem, peak = memory_gb()
        mems = all_reduce_max(torch.tensor([mem, peak], dtype=torch.float64, device=self.device))
        loss_sum, micro, wait, busy = sums.tolist()  # .item(): log-time host sync
        norm = (float(self._grad_norm) if self._grad_norm is not None
                else reported_grad_norm(self.engine))
        tokens = steps * self.global_batch * self.seq_len
        wall = max(busy / self.world.world_size, 1e-9)
        record = {"step": s.step, "consumed_samples": s.consumed_samples,
                  "tokens_seen": s.tokens_seen, "train/loss": loss_sum / max(micro, 1),
                  "train/lr": self._lr, "train/grad_norm": norm,
                  "train/loss_scale": loss_scale(self.engine),
                  "perf/tokens_per_sec": tokens / wall,
                  "perf/samples_per_sec": steps * self.global_batch / wall,
                  "perf/step_time_ms": 1000.0 * wall / max(steps, 1),
                  "perf/data_wait_pct": 100.0 * wait / max(busy, 1e-9),
                  "sys/mem_gb": mems[0].item(), "sys/max_mem_gb": mems[1].item()}
        self.logger.log(record)
        self._reset_window()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and MLM accuracy) over the val pass, token-weighted across ranks."""
        if self.eval_batches is None:
            return {}
        t0 = time.perf_counter()
        self.engine.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with torch.random.fork_rng(devices=[]):  # evaluation must not shift training randomness
            for batch in self.eval_batches():
                batch = to_device(batch, self.device)
                logits = self.engine(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"]).logits
                totals += token_sums(logits, batch["labels"], self.objective)
        all_reduce_sum(totals)
        loss_sum, count, correct = totals.tolist()  # eval-time host sync
        self.engine.train()
        loss = loss_sum / max(count, 1)
        result = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
        if self.objective == "mlm":
            result["eval/accuracy"] = correct / max(count, 1)
        s = self.state
        if s.best_eval_loss is None or loss < s.best_eval_loss:
            s.best_eval_loss = loss
        self.last_eval = result
        self.logger.log({"step": s.step, "consumed_samples": s.consumed_samples,
                         "tokens_seen": s.tokens_seen, **result})
        self._window_start += time.perf_counter() - t0  # evaluation is not training time
        return result

    def save(self) -> Path | None:
        state = {**asdict(self.state), **self.checkpoint_extra}
        t0 = time.perf_counter()
        path = checkpoint.save(self.engine, self.ckpt_dir, step=self.state.step, state=state,
                               rank=self.world.rank, keep_last=self.schedule.keep_last,
                               skip_errors=self.skip_failed_saves)
        self._window_start += time.perf_counter() - t0  # saving is not training time
        if self.world.is_main and path is not None:
            tqdm.write(f"saved {path}", file=sys.stderr)
        return path

    @torch.no_grad()
    def write_reference(self) -> None:
        """A tiny fixed batch and the final model's logits on it, so an export can be checked."""
        vocab = self.engine.module.config.vocab_size
        gen = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, vocab, (2, min(16, self.seq_len)), generator=gen)
        mask = torch.ones_like(ids)
        self.engine.eval()
        logits = self.engine(input_ids=ids.to(self.device),
                             attention_mask=mask.to(self.device)).logits
        self.engine.train()
        if self.world.is_main:
            with writing(self.run_dir / REFERENCE):
                torch.save({"input_ids": ids, "attention_mask": mask,
                            "logits": logits.float().cpu(), "step": self.state.step},
                           self.run_dir / REFERENCE)

    def summary(self) -> dict[str, Any]:
        s = self.state
        trained_tokens = self.session_steps * self.global_batch * self.seq_len
        return {"steps": s.step, "consumed_samples": s.consumed_samples,
                "tokens_seen": s.tokens_seen, "session_steps": self.session_steps,
                "train_seconds": round(self.train_seconds, 3),
                "tokens_per_sec": trained_tokens / max(self.train_seconds, 1e-9),
                "samples_per_sec": self.session_steps * self.global_batch
                / max(self.train_seconds, 1e-9),
                "best_eval_loss": s.best_eval_loss, "final_eval": self.last_eval}

    def _reset_window(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._micro_steps = 0
        self._data_wait = 0.0
        self._window_start = time.perf_counter()
        self._window_step = self.state.step
        self._grad_norm = None
        self._lr = 0.0


def token_sums(logits: torch.Tensor, labels: torch.Tensor, objective: str) -> torch.Tensor:
    """[summed cross-entropy, predicted tokens, correct predictions] of one batch (float64).

    CLM predicts token t+1 from position t (Hugging Face's shift); MLM the labelled positions.
    """
    if objective == "clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    flat_logits = logits.reshape(-1, logits.size(-1)).float()
    flat_labels = labels.reshape(-1)
    keep = flat_labels != IGNORE_INDEX
    loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((flat_logits.argmax(-1) == flat_labels) & keep).sum()
    return torch.stack([loss.double(), keep.sum().double(), correct.double()])
