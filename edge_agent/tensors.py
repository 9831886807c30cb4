"""Tensor models on the device (the zoo's digits classifier, ONNX Runtime on CPU) behind ``/v1/inference``.

Escalation is per row: rows whose confidence (the policy's classifier signal, ``softmax_margin`` unless
calibrated otherwise) is below the threshold go to the cloud's larger model in one escalated call; the
others are answered here. The answer says per row where it came from (``tiers``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.escalation import CLASSIFIER_SIGNALS, HIDDEN_PROBE, ROUTER, EdgePolicy, classifier_signals
from shared.tensor_rows import tensor_rows

DEFAULT_CLASSIFIER_SIGNAL = "softmax_margin"


@dataclass(slots=True)
class LocalClassifier:
    model_id: str
    session: Any  # onnxruntime.InferenceSession
    input_name: str
    num_features: int
    labels: list[Any] | None
    lock: threading.Lock

    @classmethod
    def load(cls, model_id: str, model_dir: Path, num_threads: int) -> LocalClassifier:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = num_threads
        opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        meta_path = model_dir / "classifier.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        first = session.get_inputs()[0]
        features = int(meta.get("num_features") or first.shape[-1])
        return cls(model_id, session, first.name, features, meta.get("labels"), threading.Lock())

    def rows(self, inputs: list[Any]) -> np.ndarray:
        return tensor_rows(inputs, model_id=self.model_id, num_features=self.num_features)

    def run(self, rows: np.ndarray) -> np.ndarray:
        with self.lock:
            return np.asarray(self.session.run(None, {self.input_name: rows})[0])

    async def infer(self, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        logits = await asyncio.to_thread(self.run, rows)
        return logits, classifier_signals(logits)

    def result(self, logits: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {"outputs": logits.tolist()}
        if self.labels is not None:
            out["labels"] = [self.labels[i] for i in np.argmax(logits, axis=-1).tolist()]
        return out


def row_confidences(
    policy: EdgePolicy, signals: dict[str, np.ndarray], rows: np.ndarray, default_threshold: float
) -> tuple[np.ndarray, float]:
    """Per row, the policy's confidence, and the threshold to compare it with: the learned router on the
    signals, the hidden-state probe on the rows' input pixels (the micro model's logits inputs), or a classifier
    signal (``softmax_margin`` and ``default_threshold`` when the policy names none)."""
    if policy.signal == ROUTER and policy.router is not None:
        if HIDDEN_PROBE in policy.router.features and policy.probe is not None and policy.probe.input == "pixels":
            signals = {**signals, HIDDEN_PROBE: policy.probe.confidences(rows)}  # a router stacked on the probe
        return policy.router.confidences(signals), policy.threshold
    if policy.signal == HIDDEN_PROBE and policy.probe is not None and policy.probe.input == "pixels":
        return policy.probe.confidences(rows), policy.threshold
    if policy.signal in CLASSIFIER_SIGNALS:
        return signals[policy.signal], policy.threshold
    return signals[DEFAULT_CLASSIFIER_SIGNAL], default_threshold


def classifier_confidence(signal: str, signals: dict[str, np.ndarray]) -> np.ndarray:
    if signal not in CLASSIFIER_SIGNALS:
        signal = DEFAULT_CLASSIFIER_SIGNAL
    return signals[signal]
