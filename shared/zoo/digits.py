"""The tensor-model pair: two MLP classifiers on scikit-learn's bundled handwritten digits (no download)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

NUM_FEATURES = 64
NUM_CLASSES = 10
HELD_OUT_FRACTION = 0.3
SPLIT_SEED = 7


@dataclass(slots=True)
class DigitsSplit:
    x_train: np.ndarray
    y_train: np.ndarray
    x_held_out: np.ndarray
    y_held_out: np.ndarray


def load_split() -> DigitsSplit:
    """The fixed split every preset and benchmark uses; pixels scaled to [0, 1]."""
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    x_tr, x_ho, y_tr, y_ho = train_test_split(x, y, test_size=HELD_OUT_FRACTION, random_state=SPLIT_SEED, stratify=y)
    return DigitsSplit(x_tr, y_tr, x_ho, y_ho)


def _mlp(hidden: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = NUM_FEATURES
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def train_classifier(split: DigitsSplit, hidden: tuple[int, ...], epochs: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = _mlp(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    x = torch.from_numpy(split.x_train)
    y = torch.from_numpy(split.y_train)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for idx in order.split(64):
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    pred = model(torch.from_numpy(x)).argmax(-1).numpy()
    return float((pred == y).mean())


def export_classifier(model: nn.Module, out_path: Path) -> None:
    """ONNX with input ``pixels`` float32 [N, 64] (values in [0, 1]) and output ``logits`` [N, 10]."""
    from shared.zoo.export_lm import legacy_onnx_export

    legacy_onnx_export(
        model,
        (torch.zeros(2, NUM_FEATURES),),
        out_path,
        ["pixels"],
        ["logits"],
        {"pixels": {0: "batch"}, "logits": {0: "batch"}},
    )


# The microcontroller-class edge model: multinomial logistic regression on 2x2-pooled pixels (the 8x8 image
# becomes 4x4, 16 features; 170 parameters), INT8 throughout (static QDQ quantization calibrated on the
# training pixels), a couple of KB. The pooling is inside the graph, so it takes the same ``pixels`` input.
MICRO_POOL = 2
MICRO_SIDE = 8 // MICRO_POOL
MICRO_C = 10.0  # inverse L2 strength: strong enough to fit, weak enough to stay ~10 points below the cloud


def pool_pixels(x: np.ndarray) -> np.ndarray:
    """[N, 64] pixels -> [N, 16]: the mean of each 2x2 block."""
    blocks = x.reshape(-1, MICRO_SIDE, MICRO_POOL, MICRO_SIDE, MICRO_POOL)
    return blocks.mean(axis=(2, 4)).reshape(len(x), MICRO_SIDE * MICRO_SIDE).astype(np.float32)


def train_micro(split: DigitsSplit) -> tuple[np.ndarray, np.ndarray]:
    """Weights ``[16, 10]`` and bias ``[10]`` of the pooled logistic regression (lbfgs: deterministic)."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=MICRO_C, max_iter=5000).fit(pool_pixels(split.x_train), split.y_train)
    return model.coef_.T.astype(np.float32), model.intercept_.astype(np.float32)


def export_micro(weights: np.ndarray, bias: np.ndarray, calibration: np.ndarray, out_path: Path) -> None:
    """ONNX INT8 (QDQ) with input ``pixels`` float32 [N, 64] and output ``logits`` [N, 10]; ``calibration``
    (training pixels) sets the activation ranges."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    nodes = [
        helper.make_node("Reshape", ["pixels", "image_shape"], ["image"]),
        helper.make_node("AveragePool", ["image"], ["pooled"], kernel_shape=[MICRO_POOL] * 2, strides=[MICRO_POOL] * 2),
        helper.make_node("Reshape", ["pooled", "feature_shape"], ["features"]),
        helper.make_node("MatMul", ["features", "weights"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["logits"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array([-1, 1, 8, 8], dtype=np.int64), "image_shape"),
        numpy_helper.from_array(np.array([-1, MICRO_SIDE * MICRO_SIDE], dtype=np.int64), "feature_shape"),
        numpy_helper.from_array(weights, "weights"),
        numpy_helper.from_array(bias, "bias"),
    ]
    graph = helper.make_graph(
        nodes,
        "digits-micro",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", NUM_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", NUM_CLASSES])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fp32 = out_path.with_name("model-fp32.onnx")
    onnx.save(model, fp32)

    class _Pixels(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"pixels": calibration[i : i + 256]} for i in range(0, len(calibration), 256)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its "consider pre-processing" advice (shape inference) is moot for 5 nodes
    try:
        quantize_static(
            str(fp32),
            str(out_path),
            _Pixels(),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
        )
    finally:
        root.setLevel(level)
    fp32.unlink()
