"""The device protocol's compatibility rules: strict on what a device sends, tolerant of what a newer cloud answers."""

from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import ValidationError

from shared.edge_protocol import EnrollRequest, SyncRequest, SyncResponse


def test_an_agent_reads_a_sync_answer_from_a_newer_cloud() -> None:
    """A cloud upgraded before its fleet adds fields (this release added ``policies`` and ``allowance.budget``);
    an agent of the previous release must still read the answer, not fail every sync."""
    answer = {
        "accepted": 2,
        "duplicates": 0,
        "desired": [{"name": "lm-edge", "version": "3", "sha256": "ab" * 32, "manifest_url": "/m", "channel": "beta"}],
        "server_time": 1.0,
        "allowance": {"remaining": "0.50", "currency": "USD", "period": "2026-12", "resets_at": "2027-01-01"},
        "a_field_from_the_future": {"x": 1},
    }
    parsed = SyncResponse.model_validate(answer)
    assert parsed.accepted == 2 and parsed.desired[0].version == "3"
    assert parsed.allowance is not None and parsed.allowance.remaining == Decimal("0.50")


def test_what_a_device_sends_is_still_strict() -> None:
    with pytest.raises(ValidationError, match="tokn"):
        EnrollRequest.model_validate({"token": "tle-12345678", "tokn": "typo"})
    with pytest.raises(ValidationError, match="extra"):
        SyncRequest.model_validate({"records": [], "extra": 1})
