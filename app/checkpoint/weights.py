"""The weights and model config of a run directory, read from its files: what `app export` writes
out and what `--init-from RUN_DIR` starts from (app/init_from.py), so the two read a run the same
way. No process group, no engine: the weights are the fp32 ones of one checkpoint tag, whatever
ZeRO stage wrote it (app.checkpoint.store.consolidated_state_dict).

It lives here, below the commands, because a library module (the warm start) needs it too: kept
in the export command, it had the model module importing a command, and so an import cycle
(docs/design.md, "Where things live").
"""
from __future__ import annotations

import json
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from app import rundir
from app.checkpoint import manifest, tags, universal
from app.checkpoint import store as checkpoint
from app.models.presets import config_from_dict
from data_tools.errors import UserError

_noted: set[str] = set()  # tags said to be unverified, once a process


def check_tag(tag_dir: Path) -> None:
    """The one check of a run's tag before its weights are read (`app export`, `--init-from
    RUN_DIR`, through `run_weights`), the same as a resume's: its files against its manifest
    (UserError naming the file that differs; an empty or partial manifest verifies nothing),
    or, with none, their structure, said in a note."""
    if not tags.check_files(tag_dir) and str(tag_dir) not in _noted:
        _noted.add(str(tag_dir))
        print(tags.unverified_note(tag_dir), file=sys.stderr)


def check_export(directory: Path, flag: str) -> None:
    """The one check of a Hugging Face model directory before its weights are read
    (`--init-from DIR`): against its manifest where `app export` wrote one (as a checkpoint
    tag's), and in any case each weights file's structure, so that a file cut short is one
    line naming it: a safetensors file's header and the data it promises against the file's
    size, a torch `.bin` as a zip archive."""
    manifest.verify(directory)
    for f in sorted(directory.glob("*.safetensors")):
        _check_safetensors(f)
    for f in sorted(directory.glob("*.bin")):
        try:
            with zipfile.ZipFile(f):
                pass
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise UserError(f"{flag} {directory}: {f.name}: corrupt or truncated ({e})") from None


def _check_safetensors(path: Path) -> None:
    """A safetensors file whole: an 8-byte header length, a JSON header, and the tensors' data
    (the largest end offset) within the file; UserError naming the file otherwise."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError("its header is cut short")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
        raise UserError(f"{path}: not a whole safetensors file ({e}): corrupt or "
                        f"truncated") from None
    if 8 + n + end > size:
        raise UserError(f"{path}: {size} bytes, its header promises {8 + n + end}: the file is "
                        f"truncated")


def run_weights(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of one checkpoint tag, whatever ZeRO stage wrote it (the tag's own: a
    run that switched stage keeps checkpoints of each, app/checkpoint/universal.py). A
    low-communication run's tag (each island's files in `islandK/`): the global weights, which
    every island holds right after a sync; a tag saved mid-round holds only the islands'
    diverged weights, and is refused in one line. The tag is verified first (`check_tag`)."""
    check_tag(ckpt_dir / tag)
    state = tags.read_state(ckpt_dir, tag)
    stage = universal.saved_layout(state).zero_stage
    outer = state.get("outer")
    if outer is None:
        return checkpoint.consolidated_state_dict(ckpt_dir, tag, stage)
    if int(outer["synced_at"]) != int(state["step"]):
        raise UserError(f"{ckpt_dir / tag}: saved at step {state['step']}, in the middle of a "
                        f"--dp-mode diloco round (the islands last agreed at step "
                        f"{outer['synced_at']}; each syncs every {outer['every']} steps): take "
                        f"a checkpoint saved at a round's end (--save-every a multiple of "
                        f"--outer-every; the run's last step always syncs)")
    return checkpoint.consolidated_state_dict(ckpt_dir / tag, f"{checkpoint.ISLAND_DIR}0", stage,
                                              state=state)


def latest_of(run_dir: Path) -> tuple[Path, str]:
    """(checkpoint dir, latest tag) of a run directory; UserError when it has none."""
    ckpt_dir = run_dir / rundir.CHECKPOINTS
    tag = tags.latest_tag(ckpt_dir)
    if tag is None:
        raise UserError(f"{ckpt_dir}: no checkpoint to take weights from")
    return ckpt_dir, tag


def config_from_run(run_dir: Path, run_config: dict[str, Any] | None = None) -> PretrainedConfig:
    """The model config a run trained (its config.json's "model.config"), with SDPA attention:
    an export is loaded anywhere, without the run's kernels. `run_config`: that config.json when
    the caller has read it already."""
    if run_config is None:
        run_config = rundir.read_run_config(run_dir)
    try:
        model_cfg = config_from_dict(run_config["model"]["config"])
    except Exception as e:  # noqa: BLE001 - a config transformers cannot rebuild
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise UserError(f"{run_dir / rundir.RUN_CONFIG}: key 'model.config' is not a usable "
                        f"model config ({first.strip()})") from None
    model_cfg._attn_implementation = "sdpa"
    return model_cfg
