"""Checkpoint tags: their names, `latest`, which tag a resume or a rollback takes, and what is
done with the others (an interrupted save deleted, a damaged tag set aside, old tags pruned).

Layout under RUN_DIR/checkpoints/ (what a tag holds and who writes it: app/checkpoint/store.py):

    global_step{N}/             one tag, the save at step N (`tag_for`, `step_of`)
    global_step{N}/train_state.json   its train state (`read_state`)
    global_step{N}/manifest.json      every file's size and checksum, written last
                                      (app/checkpoint/manifest.py)
    global_step{N}/.saving      a save this app began: gone once its manifest is written
    global_step{N}.damaged      a tag set aside, its files kept (also .unverified; .2, .3, ...
                                when the name is taken: `set_aside`)
    latest                      the newest complete tag, written by a save (store.py) or a
                                rollback; read by `latest_tag`, judged by `latest_problem`

A tag is complete when its manifest matches its files: an interrupted save is known by what it
lacks (no manifest), a damaged one by the file that differs, never by its age (`tag_problem`).
`--resume auto` takes the newest complete tag (whatever `latest` says, or when it is gone) and
clears the tags after it: interrupted ones are removed, damaged ones set aside as TAG.damaged.
A rollback does the same among the tags at or before its step (`choose_rollback`). After a save,
`prune` keeps the newest tags (never the one `latest` names).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any, cast

import torch

from app.checkpoint import manifest, universal
from app.checkpoint.train_state import TrainStateFile
from app.rundir import CHECKPOINTS
from app.runtime.dist import any_rank, barrier
from data_tools import output
from data_tools.errors import UserError
from data_tools.schema import read_json

LATEST = "latest"
STATE = "train_state.json"
TAG_RE = re.compile(r"^global_step(\d+)$")


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int | None:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def latest_tag(ckpt_dir: Path) -> str | None:
    path = ckpt_dir / LATEST
    if not path.is_file():
        return None
    tag = path.read_bytes().decode("utf-8", errors="replace").strip()
    return tag if TAG_RE.match(tag) and (ckpt_dir / tag).is_dir() else None


def tags_after(ckpt_dir: Path, tag: str) -> list[str]:
    """Tags in `ckpt_dir` of later steps than `tag` (none when `tag` is not ours)."""
    m = TAG_RE.match(tag)
    if m is None or not ckpt_dir.is_dir():
        return []
    step = int(m.group(1))
    return sorted((p.name for p in ckpt_dir.iterdir()
                   if p.is_dir() and (t := TAG_RE.match(p.name)) and int(t.group(1)) > step),
                  key=lambda name: int(cast("re.Match[str]", TAG_RE.match(name)).group(1)))


def all_tags(ckpt_dir: Path) -> list[str]:
    """Every tag directory in `ckpt_dir`, newest (highest step) first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name)),
                  key=lambda name: cast(int, step_of(name)), reverse=True)


def latest_problem(ckpt_dir: Path) -> str | None:
    """What is wrong with `latest` (None when it names a tag directory)."""
    path = ckpt_dir / LATEST
    if not path.is_file():
        return (f"{path} is missing" if not os.path.lexists(path) else
                f"{path} is not a regular file" if path.exists() else f"{path} is a dangling link")
    text = path.read_bytes().decode("utf-8", errors="replace").strip()
    if not text:
        return f"{path} is empty"
    return None if latest_tag(ckpt_dir) else f"{path} names no checkpoint ({text[:40]!r})"


def tag_problem(ckpt_dir: Path, tag: str) -> tuple[str, str] | None:
    """Why tag `tag` cannot be resumed, naming the file (None: it can). Completeness and
    integrity are separate facts:
    ("interrupted", why): a save this app began and did not finish (its `.saving` mark and no
    manifest): the one kind that is deleted;
    ("unverified", why): no manifest and no such mark, and its files fail the structure check
    (a file cut short or missing): set aside, kept;
    ("damaged", why): its files differ from its manifest, or the manifest does not cover them
    (an empty or partial one verifies nothing); set aside, kept.
    A tag without a manifest whose files pass the structure check (made before manifests, or
    its manifest deleted since) is complete as far as can be known: resumed, said to be
    unverified (`unverified_note`)."""
    tag_dir = ckpt_dir / tag
    has_manifest = (tag_dir / manifest.NAME).is_file()
    if (tag_dir / manifest.SAVING).is_file() and not has_manifest:
        return "interrupted", f"{tag_dir}: a save that did not finish (no {manifest.NAME})"
    try:
        read_state(ckpt_dir, tag)
        check_files(tag_dir)
    except UserError as e:
        return ("damaged" if has_manifest else "unverified"), str(e)
    return None


def choose_auto(ckpt_dir: Path, notes: list[str]) -> str | None:
    """The newest complete tag (None when there are no tags); each tag passed over, and a
    `latest` not followed, is said in `notes`. UserError when no tag is complete."""
    tags, named = all_tags(ckpt_dir), latest_tag(ckpt_dir)
    problems = []
    for tag in tags:
        problem = tag_problem(ckpt_dir, tag)
        if problem is None:
            if tag != named:
                why = latest_problem(ckpt_dir) or f"{ckpt_dir / LATEST} names {named}"
                notes.append(f"resume: {why}; resuming from {tag}, the newest complete "
                             f"checkpoint")
            return tag
        notes.append(f"resume: skipping {tag}, {problem[0]}: {problem[1]}")
        problems.append(f"{tag} {problem[0]} ({problem[1]})")
    if tags:
        raise UserError(f"{ckpt_dir}: no complete checkpoint to resume: {'; '.join(problems)}; "
                        f"nothing was changed: resume one with --resume PATH once fixed, or "
                        f"start over with --resume never --overwrite")
    return None


def find_resume(resume: str, run_dir: Path,
                notes: list[str] | None = None) -> tuple[Path, str] | None:
    """(checkpoint dir, tag) to resume from, or None to start fresh.

    `auto`: RUN_DIR's newest complete checkpoint if there is one (`choose_auto`; what it passed
    over goes to `notes`). `never`: None. A path: a run directory, its checkpoints/ directory
    or one tag directory; UserError when it holds no checkpoint.
    """
    if resume == "never":
        return None
    if resume == "auto":
        ckpt_dir = run_dir / CHECKPOINTS
        tag = choose_auto(ckpt_dir, notes if notes is not None else [])
        return (ckpt_dir, tag) if tag else None
    return find_at(Path(resume), "--resume")


def find_at(path: Path, flag: str) -> tuple[Path, str]:
    """(checkpoint dir, tag) in a run directory, its checkpoints/ directory or one tag
    directory; a UserError naming `flag` (the argument that gave `path`) when there is none."""
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file or directory")
    for ckpt_dir in (path / CHECKPOINTS, path):
        tag = latest_tag(ckpt_dir)
        if tag:
            return ckpt_dir, tag
    if (path / STATE).is_file():
        return path.parent, path.name
    tags = [t for d in (path / CHECKPOINTS, path) for t in all_tags(d)]
    if tags:
        raise UserError(f"{flag} {path}: no '{LATEST}' naming a checkpoint there; its tags: "
                        f"{', '.join(tags)}: pass one tag directory")
    raise UserError(f"{flag} {path}: no checkpoint there (no '{LATEST}' file, no {STATE})")


def read_state(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    path = ckpt_dir / tag / STATE
    return read_json(path, TrainStateFile, missing=f"{path}: missing (an incomplete checkpoint, "
                                                   f"or not one of this app's)")


def check_files(tag_dir: Path) -> bool:
    """Refuse a checkpoint whose files differ from its manifest (app/checkpoint/manifest.py) or,
    without one, are cut short (a zip's central directory sits at its end, so opening each one
    is a cheap check that catches truncation); names the file. True: verified by its manifest;
    False: a tag made before manifests (or a converted one), checked for structure only."""
    if manifest.verify(tag_dir):
        return True
    files = sorted(tag_dir.glob("*.pt"))
    if universal.is_universal(tag_dir):
        universal.read_info(tag_dir)
        if not (tag_dir / universal.STATE_FILE).is_file():
            raise UserError(f"{tag_dir}: no {universal.STATE_FILE} (an incomplete conversion)")
    elif not any(f.name.endswith("model_states.pt") for f in files):
        raise UserError(f"{tag_dir}: no *model_states.pt (an incomplete checkpoint)")
    for f in files:
        try:
            with zipfile.ZipFile(f):
                pass
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise UserError(f"{f}: corrupt or truncated checkpoint file ({e})") from None
    return False


def unverified_note(tag_dir: Path) -> str:
    """The line for a tag resumed or read without a manifest to verify it against."""
    try:
        due = "manifest" in read_state(tag_dir.parent, tag_dir.name)
    except UserError:
        due = False
    why = (f"its {manifest.NAME} is missing (the save wrote one: deleted since?)" if due else
           f"made before checkpoint manifests (no {manifest.NAME})")
    return f"note: {tag_dir}: {why}; its files are checked for structure only, not verified"


def remove_partial_saves(ckpt_dir: Path) -> list[str]:
    """Clear the tags after the one `--resume auto` takes (`choose_auto`), which a resume would
    otherwise save over: interrupted saves (`tag_problem`) are deleted (returned), every other
    tag is set aside as TAG.damaged or TAG.unverified, its files kept (said here). A complete
    tag is never among them, whatever `latest` says."""
    tag = choose_auto(ckpt_dir, [])
    if tag is None:
        return []
    removed = []
    for name in tags_after(ckpt_dir, tag):
        kind, why = tag_problem(ckpt_dir, name) or ("unverified", "")
        aside = set_aside(ckpt_dir, name, kind)
        if aside is None:
            removed.append(name)
            continue
        print(f"moved {ckpt_dir / name} aside to {aside.name}: {kind} ({why.split(': ')[0]}); "
              f"its files are kept: delete it once looked at", file=sys.stderr, flush=True)
    return removed


def set_aside(ckpt_dir: Path, name: str, kind: str) -> Path | None:
    """Clear tag `name`, which a later save would write into: an interrupted save (one this app
    began and did not finish) is deleted (None); any other tag is kept for a look as TAG.KIND
    (TAG.KIND.2, ... when that name is taken: nothing set aside is ever deleted), returned."""
    if kind == "interrupted":
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
        return None
    aside, n = ckpt_dir / f"{name}.{kind}", 1
    while os.path.lexists(aside):
        n += 1
        aside = ckpt_dir / f"{name}.{kind}.{n}"
    (ckpt_dir / name).rename(aside)
    return aside


def choose_rollback(ckpt_dir: Path, step: int, device: torch.device,
                    is_main: bool) -> tuple[str | None, list[str]]:
    """The tag a rollback at step `step` loads: the newest complete, verified tag at or before
    it, as `choose_auto` picks one for a resume; (None, ...) when no tag is good. Each tag
    passed over is said in the list (kind, why, where it went); the main rank sets it aside
    (`set_aside`: the run would save over it) and points `latest` at the tag taken. Every rank
    checks each tag and they agree (a collective: every rank calls it), so all load the same."""
    candidates = [t for t in all_tags(ckpt_dir) if cast(int, step_of(t)) <= step]
    passed: list[str] = []
    for tag in candidates:
        problem = tag_problem(ckpt_dir, tag)
        if not any_rank(problem is not None, device):
            if passed and is_main:
                output.write_text_atomic(ckpt_dir / LATEST, tag)
            barrier()  # the tags passed over are aside before any rank reads on
            return tag, passed
        kind, why = problem or ("damaged", "unreadable on another rank")
        where = "deleted" if kind == "interrupted" else f"moved aside to TAG.{kind}"
        if is_main:
            aside = set_aside(ckpt_dir, tag, kind)
            where = f"moved aside to {aside.name}" if aside else "deleted"
        passed.append(f"{tag} {kind} ({why}; {where})")
    barrier()
    return None, passed


def prune(ckpt_dir: Path, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` tags (never the one `latest` names)."""
    tags = sorted((int(m.group(1)), p.name) for p in ckpt_dir.iterdir()
                  if p.is_dir() and (m := TAG_RE.match(p.name)))
    keep = {name for _, name in tags[-keep_last:]} | {latest_tag(ckpt_dir)}
    removed = [name for _, name in tags if name not in keep]
    for name in removed:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
        shutil.rmtree(universal.path_for(ckpt_dir, name), ignore_errors=True)  # converted
    return removed
