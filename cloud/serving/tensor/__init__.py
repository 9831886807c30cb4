"""The cloud tier's tensor-model (non-LLM) path: ONNX Runtime and TensorRT runners and a dynamic batcher.

``OnnxRunner`` runs an ONNX model on the best execution provider the host has (TensorRT, then CUDA, then CPU);
``TensorRTRunner`` runs a TensorRT plan on a GPU (the ``gpu`` extra); ``DynamicBatcher`` merges concurrent
requests into batches for either, in Triton's model.
"""

from __future__ import annotations

from cloud.serving.tensor.batcher import DynamicBatcher
from cloud.serving.tensor.onnx_runner import PROVIDER_PREFERENCE, OnnxRunner, select_providers
from cloud.serving.tensor.spec import TensorSpec
from cloud.serving.tensor.tensorrt_runner import TensorRTRunner, build_plan

__all__ = [
    "PROVIDER_PREFERENCE",
    "DynamicBatcher",
    "OnnxRunner",
    "TensorRTRunner",
    "TensorSpec",
    "build_plan",
    "select_providers",
]
