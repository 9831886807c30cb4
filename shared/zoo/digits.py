"""The tensor-model pair: two MLP classifiers on scikit-learn's bundled handwritten digits (no download)."""

from __future__ import annotations

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
