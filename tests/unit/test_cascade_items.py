"""How many held-out token positions ``bench cascade`` draws per LM next-token task: 4,000 for
``lm-micro-next8`` (enough for issue 24's APGR interval), 400 for ``lm-next8``, unless ``--next-items`` says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import bench.cascade_bench as cascade_bench


class _DrawnError(Exception):
    """Stops the bench once a task has been asked for its items (nothing is generated)."""


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}

    def runner(task: str) -> Any:
        def run(layout: Any, num_items: int, seed: int) -> None:
            counts[task] = num_items
            raise _DrawnError

        return run

    monkeypatch.setattr(cascade_bench, "run_lm_next", runner("lm-next8"))
    monkeypatch.setattr(cascade_bench, "run_lm_micro_next", runner("lm-micro-next8"))
    monkeypatch.setattr(cascade_bench, "zoo_root", lambda preset, zoo_dir: tmp_path)
    monkeypatch.setattr(cascade_bench, "_embedder", lambda: (None, "not evaluated: test"))
    return counts


@pytest.mark.parametrize(
    ("task", "args", "expected"),
    [
        ("lm-micro-next8", [], 4000),
        ("lm-next8", [], 400),
        ("lm-micro-next8", ["--next-items", "24"], 24),
        ("lm-next8", ["--next-items", "24"], 24),
    ],
)
def test_each_next_token_task_draws_its_default_unless_next_items_is_given(
    drawn: dict[str, int], task: str, args: list[str], expected: int
) -> None:
    result = CliRunner().invoke(cascade_bench.cascade_command, ["--preset", "tiny", "--tasks", task, *args])
    assert isinstance(result.exception, _DrawnError), result.output
    assert drawn == {task: expected}


def test_the_help_states_both_defaults() -> None:
    result = CliRunner().invoke(cascade_bench.cascade_command, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "400 for lm-next8" in text and "4000 for lm-micro-next8" in text
