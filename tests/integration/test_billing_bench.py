"""``tierline bench billing`` runs end to end on a tiny workload and reports the keys its JSON promises (speed is
what the benchmark measures, not what tests assert)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.cli import bench
from tests.conftest import PG_URL

pytestmark = pytest.mark.integration

TINY = ["billing", "--json", "--records", "300", "--batch-size", "50", "--naive-records", "50"]


def test_the_billing_bench_reports_both_databases_or_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERLINE_BENCH_DATABASE_URL", raising=False)
    result = CliRunner().invoke(bench, TINY)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["records"] == 300 and report["batch_size"] == 50
    assert report["ingest_records_per_s_sqlite"] > 0 and report["naive_records_per_s_sqlite"] > 0
    assert report["sqlite"]["stored"] + report["sqlite"]["duplicates_skipped"] == 300
    assert report["sqlite"]["duplicates_skipped"] > 0  # the workload has retried records, and they were skipped
    if PG_URL:
        assert report["ingest_records_per_s_postgres"] > 0 and report["naive_records_per_s_postgres"] > 0
        assert report["postgres"]["total_cost"] == report["sqlite"]["total_cost"]
    else:
        assert report["ingest_records_per_s_postgres"] is None and report["postgres_skipped"]


def test_a_postgres_that_does_not_answer_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERLINE_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:9/nothing?connect_timeout=2")
    result = CliRunner().invoke(bench, TINY)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ingest_records_per_s_postgres"] is None
    assert "does not answer" in report["postgres_skipped"]
    assert report["ingest_records_per_s_sqlite"] > 0
