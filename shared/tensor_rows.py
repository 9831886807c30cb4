"""The ``inputs`` of a tensor ``/v1/inference`` request (rows of numbers), checked the same way on both tiers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shared.errors import ValidationError

MAX_ROWS = 4096


def tensor_rows(inputs: Sequence[Any], *, model_id: str, num_features: int | None = None) -> np.ndarray:
    """``inputs`` as a float32 ``[rows, features]`` array, or a ``ValidationError`` on ``inputs`` naming the problem.

    Args:
        inputs: the request's rows (a single row is taken as one row).
        model_id: the model asked for, named in the error when the rows do not fit it.
        num_features: the row length the model takes; ``None`` leaves the shape to the model's own input check
            (the cloud's runners check every dimension against the model).
    """
    if len(inputs) > MAX_ROWS:
        raise ValidationError(f"inputs: at most {MAX_ROWS} rows per request", param="inputs")
    try:
        with np.errstate(over="ignore"):  # a number past float32's range becomes inf and is refused below
            rows = np.asarray(inputs, dtype=np.float32)
    except (ValueError, TypeError):
        raise ValidationError("inputs: rows must be equal-length lists of numbers", param="inputs") from None
    if rows.ndim == 1:
        rows = rows[None, :]
    if num_features is not None and (rows.ndim != 2 or rows.shape[1] != num_features):
        raise ValidationError(
            f"inputs: {model_id} takes rows of {num_features} numbers, got shape {list(rows.shape)}", param="inputs"
        )
    if not np.isfinite(rows).all():
        raise ValidationError("inputs: NaN or infinite values", param="inputs")
    return rows
