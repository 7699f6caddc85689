"""Where metrics go: RUN_DIR/metrics.jsonl, the console, and a wandb run (rank 0 only).

wandb is imported lazily on rank 0, so the other ranks and `--wandb disabled` never pay for it.
Metric names follow docs/design.md, "Metrics" (`train/loss`, `perf/tokens_per_sec`, ...).
"""
from __future__ import annotations

import json
import math
import netrc
import os
import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from tqdm import tqdm

from app import rundir
from data_tools.errors import UserError
from data_tools.output import to_json, write_text_atomic

if TYPE_CHECKING:
    from app.config import TrainConfig

CONSOLE_KEYS = (("train/loss", "loss {:.4f}"), ("eval/loss", "eval_loss {:.4f}"),
                ("eval/accuracy", "eval_acc {:.3f}"), ("eval/perplexity", "ppl {:.2f}"),
                ("train/lr", "lr {:.2e}"), ("train/grad_norm", "gnorm {:.3f}"),
                ("perf/tokens_per_sec", "{:,.0f} tok/s"), ("perf/step_time_ms", "{:.0f} ms/step"),
                ("perf/data_wait_pct", "data wait {:.1f}%"), ("sys/mem_gb", "mem {:.2f} GB"))


def wandb_mode(requested: str | None, env: Mapping[str, str] = os.environ) -> str:
    """online with an API key, else offline (a real local run, syncable later)."""
    if requested:
        return requested
    if env.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return env["WANDB_MODE"]
    return "online" if env.get("WANDB_API_KEY") else "offline"


def truncate_after(path: Path, step: int) -> None:
    """Drop records past `step` (logged by a run that died before its next checkpoint), and
    lines a crash cut short."""
    if not path.is_file():
        return
    kept = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw.decode("utf-8"))
                keep = isinstance(record, dict) and int(record.get("step", 0)) <= step
            except (ValueError, TypeError):
                continue  # a line cut by a crash, or not a record of ours
            if keep:
                kept.append(raw.decode("utf-8").rstrip("\n") + "\n")
    write_text_atomic(path, "".join(kept), fsync=False)


@dataclass(frozen=True)
class WandbSettings:
    """Where the rank-0 wandb run goes (`app train --wandb*`, `--run-name`)."""

    mode: str
    """online, offline or disabled (app.telemetry.sinks.wandb_mode)."""
    project: str
    name: str
    group: str | None = None
    tags: tuple[str, ...] = ()


def wandb_settings(cfg: TrainConfig) -> WandbSettings:
    """The run's wandb settings from its config: one place for settle's check and build's run."""
    return WandbSettings(mode=wandb_mode(cfg.wandb), project=cfg.wandb_project,
                         name=cfg.run_name or cfg.out.resolve().name, group=cfg.wandb_group,
                         tags=tuple(cfg.wandb_tags))


PROJECT_FORBIDDEN = "/\\#?%:"
"""Characters wandb refuses in a project name (wandb.Settings.validate_project)."""


def check_wandb(settings: WandbSettings, env: Mapping[str, str] = os.environ) -> None:
    """What wandb.init would refuse with a traceback after the run directory exists: a project
    name or tag it rejects, or an online run with no API key. Nothing here touches the network."""
    if settings.mode == "disabled":
        return
    bad = sorted(set(PROJECT_FORBIDDEN) & set(settings.project))
    if bad or not settings.project or len(settings.project) > 128:
        raise UserError(f"--wandb-project {settings.project!r}: wandb takes 1 to 128 characters, "
                        f"none of {' '.join(PROJECT_FORBIDDEN)}")
    for tag in settings.tags:
        if not 1 <= len(tag) <= 64:
            raise UserError(f"--wandb-tags {tag[:70]!r}: wandb takes tags of 1 to 64 characters")
    if settings.mode == "online" and not _has_wandb_key(env):
        raise UserError("--wandb online: no wandb API key (set WANDB_API_KEY or run `wandb login`)"
                        "; or use --wandb offline and `wandb sync` the run later")


def _has_wandb_key(env: Mapping[str, str]) -> bool:
    """An API key where wandb looks for one: WANDB_API_KEY (or an identity token file), else the
    .netrc entry for its host (WANDB_BASE_URL), which `wandb login` writes."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = env.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    host = re.sub(r"^[a-z]+://", "", base).split("/")[0]
    if env.get("NETRC"):
        paths = [Path(env["NETRC"]).expanduser()]
    else:
        home = Path(env.get("HOME") or Path.home())
        paths = [p for p in (home / ".netrc", home / "_netrc") if p.exists()][:1]
    for path in paths:
        try:
            creds = netrc.netrc(str(path)).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            return False  # wandb warns and goes on without a key
        return bool(creds and creds[2])
    return False


class MetricsLogger:
    """Writes every record to metrics.jsonl and wandb, and a short line to the console (main rank
    only; the others are silent). On a terminal the lines scroll above a progress bar (step, ETA,
    loss, tokens/s); elsewhere (Slurm and launcher logs) there is no bar, and no carriage return:
    one plain line per log interval."""

    def __init__(self, run_dir: Path, *, enabled: bool, wandb: WandbSettings, run_config: dict,
                 resumed_step: int | None = None):
        self.enabled = enabled
        self.wandb_run = None
        self._file = None
        self._bar = None
        if not enabled:
            return
        path = run_dir / rundir.METRICS
        if resumed_step is not None:
            truncate_after(path, resumed_step)
        elif path.exists():
            path.unlink()
        self._file = open(path, "a", buffering=1)
        if wandb.mode != "disabled":
            self.wandb_run = _start_wandb(run_dir, wandb, run_config)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items() if v is not None}
        self._file.write(to_json(clean, indent=None) + "\n")
        parts = [fmt.format(clean[k]) for k, fmt in CONSOLE_KEYS if clean.get(k) is not None]
        if clean.get("event"):
            parts.append(f"{clean['event']}: {clean.get('event/reason', '')}")
        self.note(f"step {clean['step']:>6} | " + " | ".join(parts))
        if self._bar is not None and "train/loss" in clean:
            self._bar.set_postfix_str(f"loss {clean['train/loss']:.4f}, "
                                      f"{clean.get('perf/tokens_per_sec', 0):,.0f} tok/s",
                                      refresh=False)
        if self.wandb_run is not None:  # wandb's own step: after a rollback ours goes back
            self.wandb_run.log(clean)

    def start_progress(self, *, total: int, done: int) -> None:
        if self.enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=done, desc="train", unit="step",
                             file=sys.stderr, dynamic_ncols=True)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def end_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def note(self, text: str) -> None:
        """A line on the console (above the progress bar, if there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            tqdm.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def alert(self, title: str, text: str) -> None:
        """A line on the console and, in wandb, an alert (an event a dashboard shows)."""
        self.note(f"{title}: {text}")
        if self.wandb_run is not None:
            self.wandb_run.alert(title=title, text=text)

    def close(self) -> None:
        self.end_progress()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _start_wandb(run_dir: Path, settings: WandbSettings, run_config: dict):
    import wandb  # lazily: slow to import, rank 0 only

    id_file = run_dir / rundir.WANDB_ID
    id_file.parent.mkdir(parents=True, exist_ok=True)
    run_id = id_file.read_bytes().decode("utf-8", "replace").strip() if id_file.is_file() else ""
    if not re.fullmatch(r"[0-9a-z]{1,64}", run_id):  # missing, or not an id we wrote
        run_id = secrets.token_hex(4)  # wandb's id alphabet; kept so a resume continues it
        id_file.write_text(run_id + "\n")
    run = wandb.init(project=settings.project, name=settings.name, id=run_id, resume="allow",
                     dir=str(run_dir), mode=settings.mode, config=run_config,
                     group=settings.group, tags=list(settings.tags) or None,
                     settings=wandb.Settings(init_timeout=120, console="off"))
    run.define_metric("tokens_seen")  # an x-axis for every chart, besides the optimizer step
    run.define_metric("step")
    for prefix in ("train", "eval", "perf", "sys", "data"):
        run.define_metric(f"{prefix}/*", step_metric="tokens_seen", step_sync=True)
    return run
