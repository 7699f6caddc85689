"""Each message says what happened (issue 24, "Words that say what happened")."""
import os
from types import SimpleNamespace

from data_tools import errors


def _statvfs(favail):
    real = os.statvfs

    def fake(path):
        st = real(path)
        return SimpleNamespace(**{k: getattr(st, k) for k in dir(st) if k.startswith("f_")}
                               | {"f_favail": favail})
    return fake


def test_disk_full_without_inodes_says_inodes(tmp_path, monkeypatch):
    monkeypatch.setattr(errors.os, "statvfs", _statvfs(0))
    msg = errors.disk_full_message(tmp_path / "x.bin")
    assert msg.startswith("out of inodes (no free file entries) on /")
    assert "disk space" not in msg


def test_disk_full_with_inodes_says_disk_space(tmp_path, monkeypatch):
    monkeypatch.setattr(errors.os, "statvfs", _statvfs(100))
    msg = errors.disk_full_message(tmp_path / "x.bin", needed=10 << 20)
    assert msg.startswith(f"out of disk space writing {tmp_path / 'x.bin'}")
