"""The tensor-model path on the tiny zoo's digits classifiers: real ONNX Runtime, the batcher, TensorRT on GPU."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from cloud.serving.tensor.batcher import DynamicBatcher
from cloud.serving.tensor.onnx_runner import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    TENSORRT_PROVIDER,
    OnnxRunner,
    select_providers,
)
from cloud.serving.tensor.tensorrt_runner import TensorRTRunner, build_plan
from shared.errors import ConfigurationError, ValidationError
from shared.zoo.registry import ZooLayout

pytestmark = pytest.mark.integration

DIGITS = ("digits-small", "digits-large", "digits-micro")


def classifier(zoo: Path, name: str) -> tuple[Path, dict[str, Any]]:
    model_dir = ZooLayout(zoo).artifact_dir(name)
    return model_dir / "model.onnx", json.loads((model_dir / "classifier.json").read_text())


@pytest.fixture(scope="module")
def held_out(tiny_zoo: Path) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(ZooLayout(tiny_zoo).artifact_dir("digits-held-out") / "digits-held-out.npz")
    return data["x"], data["y"]


@pytest.mark.parametrize("name", DIGITS)
def test_runner_matches_onnxruntime_and_describes_the_model(
    tiny_zoo: Path, held_out: tuple[np.ndarray, np.ndarray], name: str
) -> None:
    path, meta = classifier(tiny_zoo, name)
    x, y = held_out
    runner = OnnxRunner(path, num_threads=1)

    assert runner.input_names == [meta["input"]]
    assert runner.output_names == [meta["output"]]
    assert runner.inputs[0].shape == (None, meta["num_features"])
    assert runner.inputs[0].dtype == np.float32
    assert runner.outputs[0].shape == (None, len(meta["labels"]))
    assert runner.is_batchable
    assert runner.provider == select_providers(ort.get_available_providers())[0]

    direct = ort.InferenceSession(str(path), providers=[CPU_PROVIDER]).run(None, {meta["input"]: x})[0]
    np.testing.assert_allclose(runner.run(x), direct, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(runner.run_named({meta["input"]: x})[meta["output"]], direct, rtol=1e-5, atol=1e-5)
    accuracy = float((runner.run(x).argmax(axis=1) == y).mean())
    reported = ZooLayout(tiny_zoo).report()["artifacts"][name]["held_out_accuracy"]
    assert accuracy == pytest.approx(reported, abs=0.005)


def test_batched_results_equal_unbatched(tiny_zoo: Path, held_out: tuple[np.ndarray, np.ndarray]) -> None:
    path, _ = classifier(tiny_zoo, "digits-large")
    x, _ = held_out
    runner = OnnxRunner(path, num_threads=1)
    sizes = [1 + i % 5 for i in range(60)]
    bounds = np.cumsum([0, *sizes])
    requests = [x[a:b] for a, b in itertools.pairwise(bounds)]

    async def main() -> tuple[list[np.ndarray], int]:
        async with DynamicBatcher(runner.run, 32, 5, 1000, validate=runner.check) as batcher:
            results = await asyncio.gather(*(batcher.submit(r) for r in requests))
            return results, batcher.num_batches

    results, num_batches = asyncio.run(main())
    assert num_batches < len(requests)
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_allclose(result, runner.run(request), rtol=1e-5, atol=1e-5)
        assert (result.argmax(axis=1) == runner.run(request).argmax(axis=1)).all()


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (np.zeros((3, 65), np.float32), "expects 64 features per row"),
        (np.zeros((3, 64), np.float64), "expects dtype float32, got float64"),
        (np.zeros(64, np.float32), "expects 2 dimensions"),
        (np.zeros((0, 64), np.float32), "empty dimension 0"),
    ],
)
def test_bad_input_is_a_validation_error_naming_the_input(tiny_zoo: Path, bad: np.ndarray, expected: str) -> None:
    runner = OnnxRunner(classifier(tiny_zoo, "digits-small")[0], num_threads=1)
    with pytest.raises(ValidationError, match=expected) as excinfo:
        runner.run(bad)
    assert "input 'pixels'" in excinfo.value.message
    assert excinfo.value.param == "pixels"
    assert excinfo.value.status_code == 400


def test_bad_names_and_bad_requests_through_the_batcher(
    tiny_zoo: Path, held_out: tuple[np.ndarray, np.ndarray]
) -> None:
    runner = OnnxRunner(classifier(tiny_zoo, "digits-small")[0], num_threads=1)
    with pytest.raises(ValidationError, match="unknown input 'image'"):
        runner.run_named({"image": held_out[0][:1]})
    with pytest.raises(ValidationError, match="missing input 'pixels'"):
        runner.run_named({})

    async def main() -> tuple[np.ndarray | BaseException, np.ndarray | BaseException]:
        async with DynamicBatcher(runner.run, 32, 5, 100, validate=runner.check) as batcher:
            return await asyncio.gather(
                batcher.submit(held_out[0][:2]), batcher.submit(np.zeros((1, 63), np.float32)), return_exceptions=True
            )

    good, bad = asyncio.run(main())
    assert isinstance(good, np.ndarray)
    np.testing.assert_allclose(good, runner.run(held_out[0][:2]), rtol=1e-5, atol=1e-5)
    assert isinstance(bad, ValidationError)
    assert "input 'pixels' expects 64 features" in bad.message


def test_providers_prefer_tensorrt_then_cuda_then_cpu(tiny_zoo: Path) -> None:
    everything = [CPU_PROVIDER, "AzureExecutionProvider", CUDA_PROVIDER, TENSORRT_PROVIDER]
    assert select_providers(everything) == [TENSORRT_PROVIDER, CUDA_PROVIDER, CPU_PROVIDER]
    assert select_providers([CPU_PROVIDER, CUDA_PROVIDER]) == [CUDA_PROVIDER, CPU_PROVIDER]
    assert select_providers(everything, [CPU_PROVIDER]) == [CPU_PROVIDER]
    with pytest.raises(ConfigurationError, match=TENSORRT_PROVIDER):
        select_providers([CPU_PROVIDER], [TENSORRT_PROVIDER])

    path = classifier(tiny_zoo, "digits-small")[0]
    assert OnnxRunner(path, providers=[CPU_PROVIDER]).providers == [CPU_PROVIDER]
    if TENSORRT_PROVIDER not in ort.get_available_providers():
        with pytest.raises(ConfigurationError, match="not available"):
            OnnxRunner(path, providers=[TENSORRT_PROVIDER])


def test_tensorrt_runner_says_how_to_install_tensorrt(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed on this host")
    with pytest.raises(ConfigurationError, match=r"pip install 'tierline\[gpu\]'"):
        TensorRTRunner(tmp_path / "model.plan")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
def test_tensorrt_plan_matches_onnxruntime(
    tiny_zoo: Path, held_out: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("tensorrt is not installed: pip install 'tierline[gpu]' on a CUDA host")
    if not _cuda_available():
        pytest.skip("no CUDA GPU visible to torch")
    path, _ = classifier(tiny_zoo, "digits-large")
    x, _ = held_out
    build_plan(path, tmp_path / "model.plan", max_batch_size=64)
    runner = TensorRTRunner(tmp_path / "model.plan")
    assert runner.max_batch_size == 64
    expected = OnnxRunner(path, providers=[CPU_PROVIDER]).run(x)
    got = np.concatenate([runner.run(x[i : i + 64]) for i in range(0, len(x), 64)])
    # TensorRT may use TF32 for float32 matmuls on Ampere and later.
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).mean() > 0.99
    with pytest.raises(ValidationError, match="at most 64"):
        runner.run(x[:65])

    async def main() -> list[np.ndarray]:
        async with DynamicBatcher(runner.run, 64, 2, 1000, validate=runner.check) as batcher:
            return await asyncio.gather(*(batcher.submit(x[i : i + 3]) for i in range(0, 90, 3)))

    np.testing.assert_allclose(np.concatenate(asyncio.run(main())), got[:90], rtol=1e-3, atol=1e-3)
