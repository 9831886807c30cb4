"""The tensor ``inputs`` validator both tiers use: rows of numbers in, a float32 matrix out, a 4xx naming the
problem otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared.errors import ValidationError
from shared.tensor_rows import MAX_ROWS, tensor_rows


def test_rows_become_a_float32_matrix_and_one_row_is_one_row() -> None:
    rows = tensor_rows([[1, 2.5, True], [0, -1, 3]], model_id="m", num_features=3)
    assert rows.dtype == np.float32 and rows.tolist() == [[1.0, 2.5, 1.0], [0.0, -1.0, 3.0]]
    assert tensor_rows([1, 2, 3], model_id="m", num_features=3).shape == (1, 3)


@pytest.mark.parametrize(
    ("inputs", "num_features", "message"),
    [
        ([[0.0]] * (MAX_ROWS + 1), 1, f"inputs: at most {MAX_ROWS} rows per request"),
        ([[1, 2], [3]], None, "inputs: rows must be equal-length lists of numbers"),
        ([["a", "b"]], 2, "inputs: rows must be equal-length lists of numbers"),
        ([{"x": 1}], None, "inputs: rows must be equal-length lists of numbers"),
        ([[1.0, 2.0]], 3, "inputs: digits takes rows of 3 numbers, got shape [1, 2]"),
        ([[[1.0, 2.0, 3.0]]], 3, "inputs: digits takes rows of 3 numbers, got shape [1, 1, 3]"),
        ([], 3, "inputs: digits takes rows of 3 numbers, got shape [1, 0]"),
        ([[1.0, None, 3.0]], 3, "inputs: NaN or infinite values"),
        ([[1e39, 0.0, 0.0]], 3, "inputs: NaN or infinite values"),  # past float32's range
        ([[float("inf")]], None, "inputs: NaN or infinite values"),
    ],
)
def test_bad_rows_get_a_validation_error_on_inputs(inputs: list[Any], num_features: int | None, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        tensor_rows(inputs, model_id="digits", num_features=num_features)
    assert caught.value.message == message
    assert caught.value.param == "inputs"


def test_without_a_feature_count_the_shape_is_left_to_the_model() -> None:
    assert tensor_rows([[[1.0], [2.0]]], model_id="m").shape == (1, 2, 1)
    assert tensor_rows([[1.0, 2.0]], model_id="m").shape == (1, 2)
