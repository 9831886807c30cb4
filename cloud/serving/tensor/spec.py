"""What a tensor model takes and returns (name, shape, dtype), and the input checks every runner shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import ValidationError


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output. ``None`` in ``shape`` is a dynamic dimension (any size)."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype[Any]

    @property
    def is_batchable(self) -> bool:
        """Whether the first dimension is dynamic, so rows of several requests can be stacked into one run."""
        return len(self.shape) >= 1 and self.shape[0] is None

    @property
    def num_features(self) -> int | None:
        """The size of the last dimension when it is fixed (a classifier's feature count), else ``None``."""
        return self.shape[-1] if len(self.shape) >= 2 else None

    def shape_str(self) -> str:
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"

    def check(self, value: object) -> np.ndarray:
        """Return ``value`` if it is an array this input accepts, else raise ``ValidationError`` naming the input.

        Dtypes must match exactly (no silent casts: float64 pixels are an error, not a truncation), every fixed
        dimension must match, and no dimension may be empty.
        """
        where = f"input {self.name!r}"
        got_shape = f"got shape {list(value.shape)}" if isinstance(value, np.ndarray) else ""
        if not isinstance(value, np.ndarray):
            raise ValidationError(f"{where} must be a numpy array, got {type(value).__name__}", param=self.name)
        if value.dtype != self.dtype:
            raise ValidationError(f"{where} expects dtype {self.dtype}, got {value.dtype}", param=self.name)
        if value.ndim != len(self.shape):
            raise ValidationError(
                f"{where} expects {len(self.shape)} dimensions, shape {self.shape_str()}, {got_shape}",
                param=self.name,
            )
        for axis, (want, got) in enumerate(zip(self.shape, value.shape, strict=True)):
            if got == 0:
                raise ValidationError(f"{where} has an empty dimension {axis}, {got_shape}", param=self.name)
            if want is not None and want != got:
                what = f"{want} features per row" if axis == len(self.shape) - 1 and axis > 0 else f"size {want}"
                raise ValidationError(
                    f"{where} expects {what} (shape {self.shape_str()}), {got_shape}",
                    param=self.name,
                )
        return value


def check_inputs(specs: tuple[TensorSpec, ...], inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Check a name -> array mapping against a model's inputs: every input present, no unknown names.

    Batchable inputs must also agree on the number of rows.
    """
    known = {s.name for s in specs}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ValidationError(
            f"unknown input {unknown[0]!r}; the model's inputs are {sorted(known)}", param=str(unknown[0])
        )
    missing = [s.name for s in specs if s.name not in inputs]
    if missing:
        raise ValidationError(f"missing input {missing[0]!r}", param=missing[0])
    checked = {s.name: s.check(inputs[s.name]) for s in specs}
    rows = {s.name: checked[s.name].shape[0] for s in specs if s.is_batchable}
    if len(set(rows.values())) > 1:
        raise ValidationError(f"inputs disagree on the number of rows: {rows}", param=next(iter(rows)))
    return checked
