from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import ConfigurationError
from shared.settings import CoreSettings, DatabaseSettings, SecretSettings


def test_defaults_live_in_the_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TIERLINE_DATABASE_URL", raising=False)
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path))
    assert CoreSettings().zoo_dir == tmp_path / "zoo"
    assert DatabaseSettings().url == f"sqlite:///{tmp_path.resolve() / 'tierline.db'}"


def test_database_url_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERLINE_DATABASE_URL", "postgresql://u@db/x")
    assert DatabaseSettings().url == "postgresql://u@db/x"


@pytest.mark.parametrize("secret", ["change-me", "secret", ""])
def test_placeholder_secret_refused_in_production(monkeypatch: pytest.MonkeyPatch, secret: str) -> None:
    monkeypatch.setenv("TIERLINE_ENV", "production")
    monkeypatch.setenv("TIERLINE_SECRET_KEY", secret)
    with pytest.raises(ConfigurationError, match="TIERLINE_SECRET_KEY is a placeholder"):
        SecretSettings()


def test_short_secret_refused_and_value_not_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERLINE_ENV", "production")
    monkeypatch.setenv("TIERLINE_SECRET_KEY", "hunter2-but-longer")
    with pytest.raises(ConfigurationError) as info:
        SecretSettings()
    assert "hunter2" not in str(info.value)


def test_placeholder_allowed_in_dev_and_real_secret_in_production(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERLINE_ENV", "dev")
    monkeypatch.delenv("TIERLINE_SECRET_KEY", raising=False)
    assert SecretSettings().secret_key.get_secret_value() == "change-me"
    monkeypatch.setenv("TIERLINE_ENV", "production")
    monkeypatch.setenv("TIERLINE_SECRET_KEY", "x" * 40)
    assert SecretSettings().secret_key.get_secret_value() == "x" * 40
