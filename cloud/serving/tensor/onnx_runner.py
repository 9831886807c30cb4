"""ONNX Runtime for tensor models (classifiers and the like) on the best execution provider the host has."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cloud.serving.tensor.spec import TensorSpec, check_inputs
from shared.errors import ConfigurationError, NotFoundError, ValidationError

logger = logging.getLogger(__name__)

TENSORRT_PROVIDER = "TensorrtExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
# Fastest first. ONNX Runtime assigns each node to the first provider in the list that supports it.
PROVIDER_PREFERENCE = (TENSORRT_PROVIDER, CUDA_PROVIDER, CPU_PROVIDER)

_ORT_DTYPES: dict[str, np.dtype[Any]] = {
    f"tensor({name})": np.dtype(dtype)
    for name, dtype in (
        ("float", np.float32),
        ("float16", np.float16),
        ("double", np.float64),
        ("int8", np.int8),
        ("int16", np.int16),
        ("int32", np.int32),
        ("int64", np.int64),
        ("uint8", np.uint8),
        ("uint16", np.uint16),
        ("uint32", np.uint32),
        ("uint64", np.uint64),
        ("bool", np.bool_),
    )
}


def select_providers(available: Sequence[str], requested: Sequence[str] | None = None) -> list[str]:
    """The execution providers to ask ONNX Runtime for, fastest first.

    Args:
        available: what this ONNX Runtime build offers (``onnxruntime.get_available_providers()``).
        requested: an explicit list that overrides the preference order; each must be available.

    Returns:
        ``requested`` as given, or the available ones of TensorRT, CUDA and CPU in that order. CPU is always
        last so nodes a GPU provider cannot take still run.
    """
    if requested is not None:
        if not requested:
            raise ConfigurationError("the execution provider list is empty")
        missing = [p for p in requested if p not in available]
        if missing:
            raise ConfigurationError(
                f"execution provider {missing[0]} is not available in this ONNX Runtime build; "
                f"available: {', '.join(available)}"
            )
        return list(requested)
    chosen = [p for p in PROVIDER_PREFERENCE if p in available]
    if CPU_PROVIDER not in chosen:
        chosen.append(CPU_PROVIDER)
    return chosen


def _spec(arg: Any) -> TensorSpec:
    """A TensorSpec from an ONNX Runtime ``NodeArg`` (symbolic or unknown dims become ``None``)."""
    dtype = _ORT_DTYPES.get(arg.type)
    if dtype is None:
        raise ConfigurationError(f"tensor {arg.name!r} has type {arg.type}, which tierline's tensor path does not run")
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    return TensorSpec(arg.name, shape, dtype)


class OnnxRunner:
    """One ONNX model in one ONNX Runtime session.

    ``run`` and ``run_named`` may be called from several threads at once (ONNX Runtime sessions allow
    concurrent runs), which is how the dynamic batcher and a thread-per-request server use it.

    Args:
        model_path: the ``.onnx`` file.
        providers: explicit execution providers, overriding the TensorRT > CUDA > CPU preference.
        provider_options: options per provider name, e.g. ``{"TensorrtExecutionProvider":
            {"trt_engine_cache_enable": "True", "trt_engine_cache_path": "/var/cache/trt"}}``; without an engine
            cache the TensorRT provider rebuilds its engine in every new process.
        num_threads: intra-op threads per run; ``None`` lets ONNX Runtime use one per physical core.
    """

    def __init__(
        self,
        model_path: Path,
        *,
        providers: Sequence[str] | None = None,
        provider_options: Mapping[str, Mapping[str, str]] | None = None,
        num_threads: int | None = None,
    ) -> None:
        import onnxruntime as ort

        if not model_path.is_file():
            raise NotFoundError(f"no ONNX model at {model_path}")
        if num_threads is not None and num_threads < 1:
            raise ConfigurationError(f"num_threads must be at least 1, got {num_threads}")
        chosen = select_providers(ort.get_available_providers(), providers)
        options = provider_options or {}
        opts = ort.SessionOptions()
        if num_threads is not None:
            opts.intra_op_num_threads = num_threads
        opts.inter_op_num_threads = 1
        try:
            self._session = ort.InferenceSession(
                str(model_path),
                opts,
                providers=chosen,
                provider_options=[dict(options.get(p, {})) for p in chosen],
            )
        except Exception as exc:  # ORT raises its own untyped pybind errors for unreadable models
            raise ConfigurationError(f"ONNX Runtime cannot load {model_path}: {exc}") from exc
        self.model_path = model_path
        self.inputs = tuple(_spec(a) for a in self._session.get_inputs())
        self.outputs = tuple(_spec(a) for a in self._session.get_outputs())
        self._output_names = [s.name for s in self.outputs]
        if self.providers[0] != chosen[0]:
            logger.warning("%s fell back from %s to %s", model_path.name, chosen[0], self.providers[0])

    @property
    def providers(self) -> list[str]:
        """The providers the session actually runs on (a GPU provider whose libraries fail to load drops out)."""
        return list(self._session.get_providers())

    @property
    def provider(self) -> str:
        """The first (fastest) provider in use."""
        return self.providers[0]

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return list(self._output_names)

    @property
    def is_batchable(self) -> bool:
        """Whether every input and output has a dynamic first dimension, so requests can share one run."""
        return all(s.is_batchable for s in (*self.inputs, *self.outputs))

    def check(self, inputs: np.ndarray) -> np.ndarray:
        """Validate one array for a single-input model (what ``run`` does first); raises ``ValidationError``."""
        if len(self.inputs) != 1:
            raise ValidationError(
                f"the model has {len(self.inputs)} inputs ({', '.join(self.input_names)}); pass them by name"
            )
        return self.inputs[0].check(inputs)

    def run(self, inputs: np.ndarray) -> np.ndarray:
        """Run a single-input model on a batch and return its first output.

        Raises:
            ValidationError: wrong dtype, rank, fixed dimension (e.g. feature count) or an empty batch; the message
                names the input and what it expects.
        """
        x = self.check(inputs)
        return self._run({self.inputs[0].name: x}, self._output_names[:1])[0]

    def run_named(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on named inputs and return every output by name."""
        feeds = check_inputs(self.inputs, inputs)
        return dict(zip(self._output_names, self._run(feeds, self._output_names), strict=True))

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

        try:
            outputs = self._session.run(output_names, feeds)
        except InvalidArgument as exc:  # a constraint the model's declared shapes do not show
            raise ValidationError(f"the model rejected the input: {exc}") from exc
        return [np.asarray(o) for o in outputs]
