"""`tierline demo traffic` against a real edge agent (tiny zoo, not enrolled, a local API key): every kind of
request is answered and counted, the progress and the summary say so; bad flags, a wrong key and a missing
agent are one-line errors. (With the whole connected platform: test_up_connected.py.)"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.e2e
LOCAL_KEY = "a-local-agent-key"


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path
) -> Iterator[tuple[str, Path]]:
    d = seed_data_dir(tmp_path_factory.mktemp("traffic"), tiny_zoo, session_data_dir)
    env = base_env(d, TIERLINE_EDGE_ZOO_DIR=str(d / "zoo" / "tiny"), TIERLINE_EDGE_API_KEY=LOCAL_KEY)
    with run_server(["edge", "run"], env, free_port()) as url:
        yield url, d


def _traffic(data: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_tierline("demo", "traffic", *args, env=base_env(data, **env), timeout=120)


def test_every_kind_is_answered_and_counted(agent: tuple[str, Path]) -> None:
    url, data = agent
    zoo = str(data / "zoo" / "tiny")
    args = ["--agent", url, "--zoo", zoo, "--duration", "6", "--rate", "4/s", "--json"]
    proc = _traffic(data, *args, TIERLINE_EDGE_API_KEY=LOCAL_KEY)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["sent"] >= 5 and summary["answered"] == summary["sent"] and summary["errors"] == {}, summary
    # Not enrolled: the device answers everything, quality "high" included, and says so up front.
    assert set(summary["tiers"]) == {"edge"} and summary["edge_share"] == 1.0
    assert summary["tiers"]["edge"]["p95_ms"] > 0
    assert sum(sum(c.values()) for c in summary["by_kind"].values()) == summary["sent"]
    assert "not enrolled" in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if " sent " in line]
    assert progress and f"sent {summary['sent']}" in progress[-1] and "edge" in progress[-1]
    if "digits" in summary["by_kind"]:
        assert summary["digits_accuracy"]["edge"] > 0.5  # held-out digits: the small classifier gets most right

    # Without --json: a readable report on stdout, the plain progress lines before it.
    proc = _traffic(data, "--agent", url, "--zoo", zoo, "--duration", "2", "--mix", "digits=1", "--key", LOCAL_KEY)
    assert proc.returncode == 0, proc.stderr
    assert "edge share 100.0%" in proc.stdout and "digits right on edge" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mix", "easy=1,bogus=2"], "--mix: unknown kind 'bogus'"),
        (["--rate", "fast"], "--rate: 'fast' is not a number"),
        (["--duration", "0"], "--duration: must be above 0"),
        (["--concurrency", "2.5"], "--concurrency: a whole number"),
        (["--key", "wrong"], "wants its local API key"),
    ],
)
def test_bad_input_is_one_line(agent: tuple[str, Path], args: list[str], message: str) -> None:
    url, data = agent
    proc = _traffic(data, "--agent", url, *args)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr


def test_no_agent_is_one_line(tmp_path: Path) -> None:
    proc = _traffic(tmp_path, "--agent", f"http://127.0.0.1:{free_port()}", "--duration", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "is `tierline up` running?" in proc.stderr, proc.stderr
