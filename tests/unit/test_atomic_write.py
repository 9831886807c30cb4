"""The one atomic write: the new content or the old, the mode asked for from the first byte, nothing left over."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.cloud_link import CREDENTIALS_FILE, Credentials
from shared.atomic import write_atomic
from tests.conftest import REPO


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_replaces_the_content_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, b'{"a": 1}')
    write_atomic(target, b'{"a": 2}\n')
    assert target.read_bytes() == b'{"a": 2}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_mode_is_exact_whatever_the_umask_and_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "secret.json"
    target.write_text("old")
    target.chmod(0o644)
    old_umask = os.umask(0)
    try:
        write_atomic(target, b"token", mode=0o600)
        assert _mode(target) == 0o600
        write_atomic(target, b"public", mode=0o644)
        assert _mode(target) == 0o644
    finally:
        os.umask(old_umask)
    os.umask(0o077)
    try:
        write_atomic(tmp_path / "plain", b"x")
        write_atomic(tmp_path / "shared", b"x", mode=0o644)
    finally:
        os.umask(old_umask)
    assert _mode(tmp_path / "shared") == 0o644
    assert _mode(tmp_path / "plain") == 0o600  # no mode asked: a new file's default under the umask


def test_a_failed_rename_leaves_the_target_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "index.json"
    target.mkdir()  # a directory where the file should go: the rename fails after the data is written
    (target / "keep").write_text("mine")
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]
    assert (target / "keep").read_text() == "mine"


_FULL_DISK = r"""
import resource, signal, sys
from pathlib import Path
from shared.atomic import write_atomic

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_atomic(Path(sys.argv[1]), b"x" * 1_000_000)
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


def test_a_write_that_runs_out_of_space_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old state")
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(target)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["OSError", str(errno.EFBIG)], proc.stdout
    assert target.read_bytes() == b"old state"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_device_credentials_are_saved_0600_and_read_back(tmp_path: Path) -> None:
    creds = Credentials("http://cloud", "dev-1", "secret-token", "acme", ["-----BEGIN PUBLIC KEY-----"], 15.0)
    old_umask = os.umask(0)
    try:
        path = creds.save(tmp_path / "state")
    finally:
        os.umask(old_umask)
    assert path == tmp_path / "state" / CREDENTIALS_FILE
    assert _mode(path) == 0o600
    assert Credentials.load(tmp_path / "state") == creds
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]
