"""TensorRT plans on a CUDA GPU (the ``gpu`` extra): deserialize, allocate with torch, ``execute_async_v3``.

``tensorrt`` is imported inside the functions, so this module imports on every host; using it without TensorRT
raises ``ConfigurationError``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cloud.serving.tensor.spec import TensorSpec, check_inputs
from shared.errors import ApplicationError, ConfigurationError, NotFoundError, ValidationError

NOT_INSTALLED = "TensorRT is not installed; pip install 'tierline[gpu]' on a CUDA host"


def _import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise ConfigurationError(NOT_INSTALLED) from exc
    return tensorrt


def _require_cuda(device: int) -> None:
    import torch

    if not torch.cuda.is_available():
        raise ConfigurationError("TensorRT needs a CUDA GPU, and torch sees none (is this the CPU build of torch?)")
    if not 0 <= device < torch.cuda.device_count():
        raise ConfigurationError(f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")


def build_plan(onnx_path: Path, plan_path: Path, *, max_batch_size: int, fp16: bool = False) -> None:
    """Compile an ONNX model with a dynamic first dimension into a TensorRT plan for batches of 1..max_batch_size.

    A plan is specific to the GPU model and TensorRT version it was built with; build it on the serving host.
    """
    trt = _import_tensorrt()
    _require_cuda(0)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConfigurationError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = list(tensor.shape)
        if any(d < 0 for d in shape[1:]):
            raise ConfigurationError(f"input {tensor.name!r} of {onnx_path} has a dynamic dimension besides the first")
        rest = shape[1:]
        profile.set_shape(tensor.name, [1, *rest], [max_batch_size, *rest], [max_batch_size, *rest])
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ConfigurationError(f"TensorRT could not build a plan from {onnx_path}")
    plan_path.write_bytes(bytes(plan))


class TensorRTRunner:
    """One TensorRT plan on one GPU, with the same ``run``/``run_named`` contract as ``OnnxRunner``.

    Runs are serialised by a lock: an execution context holds per-run shapes and addresses, so one context runs
    one batch at a time (the dynamic batcher in front supplies the concurrency).
    """

    provider = "TensorRT"

    def __init__(self, plan_path: Path, *, device: int = 0) -> None:
        trt = _import_tensorrt()
        _require_cuda(device)
        import torch

        if not plan_path.is_file():
            raise NotFoundError(f"no TensorRT plan at {plan_path}")
        self._trt = trt
        self._torch = torch
        self._device = torch.device("cuda", device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self._engine is None:
            raise ConfigurationError(f"TensorRT cannot deserialize {plan_path} (built for another GPU or version?)")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream(device=self._device)
        self._lock = threading.Lock()
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        for i in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(i)
            shape = tuple(d if d >= 0 else None for d in self._engine.get_tensor_shape(name))
            spec = TensorSpec(name, shape, np.dtype(trt.nptype(self._engine.get_tensor_dtype(name))))
            is_input = self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (inputs if is_input else outputs).append(spec)
        self.plan_path = plan_path
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        # The largest batch the plan's first optimization profile admits, per batchable input.
        self._max_rows = {
            s.name: int(self._engine.get_tensor_profile_shape(s.name, 0)[2][0]) for s in self.inputs if s.is_batchable
        }

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    @property
    def is_batchable(self) -> bool:
        return all(s.is_batchable for s in (*self.inputs, *self.outputs))

    @property
    def max_batch_size(self) -> int | None:
        """The most rows one run takes (from the plan's optimization profile), ``None`` if nothing is batchable."""
        return min(self._max_rows.values()) if self._max_rows else None

    def check(self, inputs: np.ndarray) -> np.ndarray:
        """Validate one array for a single-input plan (dtype and shape; not the row limit, which a batcher's
        splitting meets); raises ``ValidationError``."""
        if len(self.inputs) != 1:
            raise ValidationError(
                f"the plan has {len(self.inputs)} inputs ({', '.join(self.input_names)}); pass them by name"
            )
        return self.inputs[0].check(inputs)

    def run(self, inputs: np.ndarray) -> np.ndarray:
        """Run a single-input plan on a batch and return its first output."""
        x = self.check(inputs)
        return self.run_named({self.inputs[0].name: x})[self.outputs[0].name]

    def run_named(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on named inputs and return every output by name (host numpy arrays)."""
        feeds = check_inputs(self.inputs, inputs)
        for name, limit in self._max_rows.items():
            if feeds[name].shape[0] > limit:
                raise ValidationError(
                    f"input {name!r} has {feeds[name].shape[0]} rows; the plan takes at most {limit}", param=name
                )
        torch = self._torch
        with self._lock, torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            keep: list[Any] = []  # device tensors must outlive the asynchronous run
            for name, array in feeds.items():
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self._device, non_blocking=True)
                keep.append(tensor)
                self._context.set_input_shape(name, tuple(array.shape))
                self._context.set_tensor_address(name, tensor.data_ptr())
            results: dict[str, Any] = {}
            for spec in self.outputs:
                shape = tuple(self._context.get_tensor_shape(spec.name))
                torch_dtype = torch.from_numpy(np.empty(0, spec.dtype)).dtype
                results[spec.name] = torch.empty(shape, dtype=torch_dtype, device=self._device)
                self._context.set_tensor_address(spec.name, results[spec.name].data_ptr())
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise ApplicationError(f"TensorRT failed to run {self.plan_path.name}")
            host = {name: t.to("cpu", non_blocking=False) for name, t in results.items()}
            self._stream.synchronize()
        return {name: t.numpy() for name, t in host.items()}
