"""A bad tensor request gets the same 4xx on the device and in the cloud: both tiers check ``inputs`` with one
validator before any model runs (the tiny zoo's digits classifier, real ONNX Runtime on both sides)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cloud.serving.tensor_models import TensorPool
from edge_agent.tensors import LocalClassifier
from shared.errors import ValidationError
from shared.tensor_rows import MAX_ROWS
from shared.zoo.registry import ZooLayout

pytestmark = pytest.mark.integration

MODEL = "tierline/digits-small"
BAD_ROWS: list[tuple[list[Any], str]] = [
    ([[0.0] * 64, [0.0] * 63], "inputs: rows must be equal-length lists of numbers"),
    ([["zero"] * 64], "inputs: rows must be equal-length lists of numbers"),
    ([[0.0] * 63 + [1e39]], "inputs: NaN or infinite values"),
    ([[0.0] * 64] * (MAX_ROWS + 1), f"inputs: at most {MAX_ROWS} rows per request"),
]


def _edge_error(zoo: Path, inputs: list[Any]) -> ValidationError:
    edge = LocalClassifier.load(MODEL, ZooLayout(zoo).artifact_dir("digits-small"), num_threads=1)
    with pytest.raises(ValidationError) as caught:
        edge.rows(inputs)
    return caught.value


async def _cloud_answers(zoo: Path, inputs: list[Any]) -> tuple[dict[str, Any] | None, ValidationError | None]:
    pool = TensorPool.from_zoo(zoo, num_threads=1)
    model = pool.get(MODEL)
    assert model is not None
    await pool.start()
    try:
        return await pool.infer(model, inputs), None
    except ValidationError as exc:
        return None, exc
    finally:
        await pool.close()


@pytest.mark.parametrize(("inputs", "message"), BAD_ROWS, ids=["ragged", "strings", "overflow", "too-many"])
def test_device_and_cloud_refuse_bad_rows_alike(tiny_zoo: Path, inputs: list[Any], message: str) -> None:
    edge = _edge_error(tiny_zoo, inputs)
    answer, cloud = asyncio.run(_cloud_answers(tiny_zoo, inputs))
    assert answer is None and cloud is not None
    assert (edge.message, edge.param) == (cloud.message, cloud.param) == (message, "inputs")


def test_good_rows_pass_on_both_tiers(tiny_zoo: Path) -> None:
    edge = LocalClassifier.load(MODEL, ZooLayout(tiny_zoo).artifact_dir("digits-small"), num_threads=1)
    rows = [[0.0] * 64, [1.0] * 64]
    assert edge.rows(rows).shape == (2, 64)
    answer, error = asyncio.run(_cloud_answers(tiny_zoo, rows))
    assert error is None and answer is not None and len(answer["outputs"]) == 2
