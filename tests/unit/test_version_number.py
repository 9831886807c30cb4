"""Version strings from agents and rollouts: cloud versions are ASCII numbers, anything else is a name."""

from __future__ import annotations

import pytest

from shared.edge_protocol import version_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3", 3), ("042", 42), ("tiny-2", None), ("", None), (None, None), ("²", None), ("٣", None), ("-1", None)],
)
def test_only_ascii_digits_are_version_numbers(text: str | None, expected: int | None) -> None:
    assert version_number(text) == expected
