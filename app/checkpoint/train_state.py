"""The train state: what a checkpoint carries besides the engine's own states (docs/design.md,
"Samples, order, resume").

Counters are loaded back on resume; the run's facts (world size, global batch, dataset, model,
configs) are written with them so a resume can be checked, and refused, before any process group
starts. `state_dict()`/`load_state_dict()` are the whole interface, as with any stateful part.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from app.data.order import skip_ahead
from app.faults.anomaly import Cooldown
from data_tools.schema import NonNegativeInt, PositiveInt, Schema

COUNTERS = ("step", "consumed_samples", "tokens_seen", "real_tokens_seen", "best_eval_loss",
            "phase_step", "skipped_updates")


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    consumed_samples: int = 0
    """Global samples trained on: where the loader restarts (the whole data state)."""
    tokens_seen: int = 0
    """Window tokens trained on, padding included (global batch x seq_len a step): the stream's
    measure, which the phase arithmetic uses."""
    real_tokens_seen: int = 0
    """Real (not padding) tokens trained on, all ranks: the loader's count, added at each check
    point (app.trainer.Trainer.gather; exact, with no sync of its own). Equal to tokens_seen
    with --packing concat."""
    best_eval_loss: float | None = None
    phase_step: int = 0
    """The step the run's sequence-length phase began after (0: the first phase): the global
    batches skipped before it index another stream (rundir.read_skipped)."""
    skipped_updates: int = 0
    """Steps whose update the app's step guard skipped on the device (non-finite gradients:
    app.runtime.step_guard); DeepSpeed counts its own skips (`engine.skipped_steps`)."""
    cooldown: Cooldown = field(default_factory=Cooldown)
    """The LR cool-down after a rollback (app.faults.anomaly): part of the schedule, so it
    resumes."""
    facts: dict[str, Any] = field(default_factory=dict)
    """What the run is (world_size, global_batch, dataset_fingerprint, model_config, run_config,
    ds_config): saved for checks, never loaded back."""

    def state_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in COUNTERS},
                "cooldown": self.cooldown.state_dict(), **self.facts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's counters; its stream position mapped into this run's sample layout
        when the run changed --seq-len since (a sequence-length phase: `phase_position`)."""
        self.step, self.consumed_samples, self.tokens_seen = (
            int(state[k]) for k in ("step", "consumed_samples", "tokens_seen"))
        # a checkpoint from before the counter: its window tokens (exact with concat)
        self.real_tokens_seen = int(state.get("real_tokens_seen", self.tokens_seen))
        self.best_eval_loss = state.get("best_eval_loss")
        self.phase_step = int(state.get("phase_step") or 0)
        self.skipped_updates = int(state.get("skipped_updates") or 0)
        saved, now = state.get("run_config") or {}, self.facts.get("run_config") or {}
        if saved.get("seq_len") and now.get("seq_len") and saved["seq_len"] != now["seq_len"]:
            self.phase_step = self.step
            self.consumed_samples = phase_position(
                self.consumed_samples, old_seq_len=int(saved["seq_len"]),
                new_seq_len=int(now["seq_len"]), packing=str(now.get("packing")),
                global_batch=int(self.facts.get("global_batch") or state["global_batch"]))
        self.cooldown.load_state_dict(state.get("cooldown"))

    def advance(self, global_batch: int, seq_len: int, skip: frozenset[int] = frozenset()) -> None:
        """One optimizer step of `global_batch` samples of `seq_len` tokens; the stream position
        then moves past any global batch in `skip`."""
        self.step += 1
        self.consumed_samples = skip_ahead(self.consumed_samples + global_batch, global_batch,
                                           skip)
        self.tokens_seen += global_batch * seq_len


# Layouts whose sample is one document whatever --seq-len (longer ones truncated): a sequence-
# length phase keeps the stream position. Every other layout cuts the token stream into windows.
ONE_DOCUMENT_A_SAMPLE = ("doc",)


def phase_position(consumed_samples: int, *, old_seq_len: int, new_seq_len: int, packing: str,
                   global_batch: int) -> int:
    """Where a run that changes --seq-len (a phase: BERT's 128 then 512) continues in the stream
    of the new samples (docs/recipes.md, "Sequence-length phases").

    With one document a sample (--packing doc) a position is a document at either length: the
    position stays. Windows of the token stream (concat and every packed layout) hold
    `seq_len` tokens each, so the phase starts as many window tokens into the new stream as the
    run consumed: position ceil(consumed x old / new), rounded up to a whole global batch of this
    run, so phase 2's first step is global batch position / global_batch of the new stream. The
    fraction of an epoch consumed carries over (up to the windows' rounding); the new windows
    come from their own permutation, so within the epoch of the change some text is seen twice
    and some not, as with any re-cut of the stream."""
    if packing in ONE_DOCUMENT_A_SAMPLE or old_seq_len == new_seq_len:
        return consumed_samples
    tokens = consumed_samples * old_seq_len
    position = -(-tokens // new_seq_len)
    return -(-position // global_batch) * global_batch


class TrainStateFile(Schema):
    """`state_dict()` as saved (global_step{N}/train_state.json and DeepSpeed's client state)."""

    step: NonNegativeInt
    consumed_samples: NonNegativeInt
    tokens_seen: NonNegativeInt
    real_tokens_seen: NonNegativeInt | None = None
    best_eval_loss: float | None = None
    phase_step: NonNegativeInt = 0
    skipped_updates: NonNegativeInt = 0
    world_size: PositiveInt
    global_batch: PositiveInt
    dataset_fingerprint: str
    saved_model_config: dict[str, Any] = Field(alias="model_config")  # pydantic's own name
    run_config: dict[str, Any]
    ds_config: dict[str, Any]
