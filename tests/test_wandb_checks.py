"""wandb settings wandb.init would refuse with a traceback once the run directory exists: refused
in one line at settle time (app.telemetry.sinks.check_wandb), with no network call. wandb's own
validators are asked too, so the rules here stay wandb's."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.telemetry.sinks import WandbSettings, check_wandb
from data_tools.errors import UserError
from tests.helpers import TINY, clean_env, error_lines, run_app


def settings(mode: str = "offline", project: str = "dspretrain", tags=()) -> WandbSettings:
    return WandbSettings(mode=mode, project=project, name="run", tags=tuple(tags))


BAD_PROJECTS = ["team/proj", "a\\b", "p#1", "what?", "100%", "a:b", "x" * 129, ""]


@pytest.mark.parametrize("project", BAD_PROJECTS)
def test_a_project_wandb_refuses_is_one_line(project):
    with pytest.raises(UserError, match="--wandb-project"):
        check_wandb(settings(project=project), env={"WANDB_API_KEY": "k"})


@pytest.mark.parametrize("project", BAD_PROJECTS[:-1])
def test_wandb_refuses_those_projects_too(project):
    wandb = pytest.importorskip("wandb")
    with pytest.raises(Exception, match="project"):
        wandb.Settings(project=project)


@pytest.mark.parametrize("tag", ["", "t" * 65])
def test_a_tag_wandb_refuses_is_one_line(tag):
    with pytest.raises(UserError, match="--wandb-tags"):
        check_wandb(settings(tags=["ok", tag]), env={})
    wandb = pytest.importorskip("wandb")
    with pytest.raises(Exception, match="64 characters"):
        wandb.Settings(run_tags=("ok", tag))


def test_good_settings_and_disabled_pass():
    check_wandb(settings(project="x" * 128, tags=["t" * 64, "ci"]), env={})
    check_wandb(settings(mode="disabled", project="bad/name", tags=[""]), env={})


def test_online_needs_a_key(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(UserError, match="--wandb online: no wandb API key"):
        check_wandb(settings(mode="online"), env={"HOME": str(home)})
    check_wandb(settings(mode="offline"), env={"HOME": str(home)})  # offline needs none
    check_wandb(settings(mode="online"), env={"HOME": str(home), "WANDB_API_KEY": "k"})


def test_online_finds_the_key_wandb_login_wrote(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    check_wandb(settings(mode="online"), env={"HOME": str(home)})
    # another host's key is not the one wandb would use
    with pytest.raises(UserError, match="no wandb API key"):
        check_wandb(settings(mode="online"),
                    env={"HOME": str(home), "WANDB_BASE_URL": "https://wandb.example.org"})
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.example.org login user password k\n")
    check_wandb(settings(mode="online"), env={"HOME": str(home), "NETRC": str(netrc),
                                               "WANDB_BASE_URL": "https://wandb.example.org/"})
    with pytest.raises(UserError, match="no wandb API key"):  # NETRC replaces ~/.netrc
        check_wandb(settings(mode="online"), env={"HOME": str(home), "NETRC": str(netrc)})


def test_train_online_without_a_key_is_refused_before_the_run_dir(tmp_path, mlm_dataset):
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        env.pop(name, None)
    out = tmp_path / "run"
    args = [a for a in TINY if a not in ("--wandb", "disabled")]
    r = run_app("train", "--data", mlm_dataset, "--out", out, *args, "--max-steps", "2",
                "--wandb", "online", env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "--wandb online: no wandb API key" in lines[0], lines
    assert not Path(out).exists()
