"""The cloud's own ids are keyed with a secret kept 0600 in the data dir: stable across restarts, unknown to others."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from cloud.gateway.ids import ID_SECRET_FILE, CloudIds, load_or_create_id_secret
from shared.errors import ConfigurationError


def test_the_secret_is_made_once_owner_only_and_kept(tmp_path: Path) -> None:
    first = CloudIds.from_keys_dir(tmp_path / "keys")
    path = tmp_path / "keys" / ID_SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = CloudIds.from_keys_dir(tmp_path / "keys")  # a restart (or a replica on the same dir): the same ids
    assert again.usage_id(7, "k") == first.usage_id(7, "k") and again.job_id(7, "k") == first.job_id(7, "k")
    other = CloudIds.from_keys_dir(tmp_path / "other")
    assert other.usage_id(7, "k") != first.usage_id(7, "k")


def test_ids_are_not_the_old_predictable_hash(tmp_path: Path) -> None:
    ids = CloudIds.from_keys_dir(tmp_path)
    assert ids.usage_id(7, "k") != "idem-" + hashlib.sha256(b"7:k").hexdigest()[:40]
    assert ids.job_id(7, "k") != "job_" + hashlib.sha256(b"7:k").hexdigest()[:32]
    assert ids.usage_id(7, "k") != ids.usage_id(8, "k") and len(ids.usage_id(7, "x" * 255)) <= 64


def test_a_secret_others_can_read_or_a_short_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / ID_SECRET_FILE
    load_or_create_id_secret(path)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match="owner only"):
        load_or_create_id_secret(path)
    path.write_text("abcd\n")
    path.chmod(0o600)
    with pytest.raises(ConfigurationError, match="at least 32 bytes"):
        load_or_create_id_secret(path)
