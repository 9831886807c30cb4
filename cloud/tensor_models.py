"""The tensor models this cloud process serves (the zoo's ONNX classifiers), each behind a dynamic batcher."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cloud.tensor import DynamicBatcher, OnnxRunner
from shared.errors import NotFoundError
from shared.tensor_rows import tensor_rows
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

ZOO_TENSOR_MODELS = {"tierline/digits-large": "digits-large", "tierline/digits-small": "digits-small"}


@dataclass(slots=True)
class ServedTensorModel:
    model_id: str
    runner: OnnxRunner
    batcher: DynamicBatcher
    labels: list[Any] | None


class TensorPool:
    def __init__(self, models: dict[str, ServedTensorModel]) -> None:
        self.models = models

    @classmethod
    def from_zoo(cls, zoo_root: Path, num_threads: int | None = None) -> TensorPool:
        layout = ZooLayout(zoo_root)
        models = {}
        for model_id, name in ZOO_TENSOR_MODELS.items():
            d = layout.artifact_dir(name)
            if not (d / "model.onnx").is_file():
                continue
            meta = json.loads((d / "classifier.json").read_text()) if (d / "classifier.json").is_file() else {}
            runner = OnnxRunner(d / "model.onnx", num_threads=num_threads)
            batcher = DynamicBatcher(runner.run, 64, 2.0, 4096, validate=runner.check)
            models[model_id] = ServedTensorModel(model_id, runner, batcher, meta.get("labels"))
        return cls(models)

    async def start(self) -> None:
        for m in self.models.values():
            await m.batcher.start()

    async def close(self) -> None:
        for m in self.models.values():
            await m.batcher.close()

    def get(self, model_id: str) -> ServedTensorModel | None:
        return self.models.get(model_id)

    async def infer(self, model: ServedTensorModel, inputs: list[Any]) -> dict[str, Any]:
        """Rows in, one output per row (and the predicted label for classifiers); concurrent calls batch."""
        out = await model.batcher.submit(tensor_rows(inputs, model_id=model.model_id))
        result: dict[str, Any] = {"outputs": out.tolist()}
        if model.labels is not None:
            result["labels"] = [model.labels[i] for i in np.argmax(out, axis=-1).tolist()]
        return result


def unknown_model(model_id: str) -> NotFoundError:
    return NotFoundError(f"The model '{model_id}' does not exist", param="model_id", code="model_not_found")
