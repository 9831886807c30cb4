"""Tensor-model serving on this host: one request per model run vs Triton-style dynamic batching.

Every request is one held-out digit (one row) for the zoo's ``digits-large`` ONNX classifier. Three ways to serve
``num_requests`` of them:

- ``unbatched_sequential``: one caller, each request run alone.
- ``unbatched_concurrent``: ``concurrency`` asyncio callers, each running its request alone in its own thread
  (a thread per caller), as a server that hands every request to ``run`` in a thread would.
- ``batched``: the same callers submit to a ``DynamicBatcher`` that stacks their rows into batches.

Callers are closed-loop (each sends its next request when the last one is answered), so latency is what a caller
sees under that load. The baseline for ``batching_speedup`` is the faster of the two unbatched ways.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cloud.serving.tensor.batcher import DynamicBatcher
from cloud.serving.tensor.onnx_runner import OnnxRunner
from shared.zoo.registry import ZooLayout

MODEL = "digits-large"


def _summary(latencies_s: list[float], seconds: float) -> dict[str, float]:
    ms = np.asarray(latencies_s) * 1000.0
    return {
        "requests_per_s": round(len(latencies_s) / seconds, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


async def _closed_loop(
    call: Callable[[np.ndarray], Awaitable[np.ndarray]], requests: list[np.ndarray], concurrency: int
) -> tuple[list[np.ndarray], list[float], float]:
    """``concurrency`` callers share the requests; returns outputs and latencies in request order, and seconds."""
    outputs: list[np.ndarray] = [np.empty(0)] * len(requests)
    latencies = [0.0] * len(requests)
    order = iter(range(len(requests)))

    async def caller() -> None:
        for i in order:
            sent = time.perf_counter()
            outputs[i] = await call(requests[i])
            latencies[i] = time.perf_counter() - sent

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return outputs, latencies, time.perf_counter() - start


def _unbatched_sequential(runner: OnnxRunner, requests: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, Any]]:
    outputs, latencies = [], []
    start = time.perf_counter()
    for x in requests:
        sent = time.perf_counter()
        outputs.append(runner.run(x))
        latencies.append(time.perf_counter() - sent)
    return outputs, _summary(latencies, time.perf_counter() - start)


async def _unbatched_concurrent(
    runner: OnnxRunner, requests: list[np.ndarray], concurrency: int
) -> tuple[list[np.ndarray], dict[str, Any]]:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-caller") as pool:

        async def call(x: np.ndarray) -> np.ndarray:
            return await loop.run_in_executor(pool, runner.run, x)

        outputs, latencies, seconds = await _closed_loop(call, requests, concurrency)
    return outputs, _summary(latencies, seconds)


async def _batched(
    runner: OnnxRunner, requests: list[np.ndarray], concurrency: int, max_batch_size: int, max_queue_delay_ms: float
) -> tuple[list[np.ndarray], dict[str, Any]]:
    batcher = DynamicBatcher(runner.run, max_batch_size, max_queue_delay_ms, len(requests), validate=runner.check)
    async with batcher:
        outputs, latencies, seconds = await _closed_loop(batcher.submit, requests, concurrency)
    summary: dict[str, Any] = _summary(latencies, seconds)
    summary["mean_batch_size"] = round(batcher.mean_batch_size, 2)
    summary["num_batches"] = batcher.num_batches
    return outputs, summary


async def _registry_load(model: Path, cycles: int, num_threads: int) -> dict[str, Any]:
    """How long a registry tensor version takes to load on first use: fetched from a local artifact store into
    the cache (``cold``), or from the cache (``cached``, after an unload), both with the signature, digest and
    every file's sha256 checked, the ONNX Runtime session opened and the batcher started."""
    import json as _json
    import shutil
    import tempfile

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cloud.serving.tensor_models import TensorPool, TensorVersion
    from controlplane.registry.store import LocalArtifactStore
    from shared.artifacts import build_manifest, sign_manifest

    work = Path(tempfile.mkdtemp(prefix="tensor-bench-"))
    try:
        src = work / "src"
        src.mkdir()
        shutil.copy(model, src / "model.onnx")
        store = LocalArtifactStore(work / "store")
        blob = store.put_file(src / "model.onnx")
        key = Ed25519PrivateKey.generate()
        manifest = sign_manifest(build_manifest(src, name="m", version="1", kind="tensor", format="onnx"), key)
        version = TensorVersion(1, "active", manifest.sha256, _json.loads(manifest.to_json()), blob.size)
        cold: list[float] = []
        cached: list[float] = []
        for _ in range(cycles):
            shutil.rmtree(work / "cache", ignore_errors=True)
            pool = TensorPool(
                {}, num_threads=num_threads, cache_dir=work / "cache", store=store, trusted_keys=[key.public_key()]
            )
            await pool.start()
            for times in (cold, cached):  # the first load fetches; after an unload the cache is verified and used
                started = time.perf_counter()
                served = await pool.acquire("m", version)
                times.append(time.perf_counter() - started)
                pool.release(served)
                await pool.unload(("m", 1, version.sha256), "bench")
            await pool.close()
        return {
            "artifact_bytes": blob.size,
            "cycles": cycles,
            "cold_load_ms_p50": round(float(np.median(cold)) * 1000, 2),
            "cached_load_ms_p50": round(float(np.median(cached)) * 1000, 2),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_tensor_bench(
    zoo_root: Path,
    num_requests: int = 2000,
    concurrency: int = 64,
    *,
    max_batch_size: int = 64,
    max_queue_delay_ms: float = 2.0,
    num_threads: int = 1,
) -> dict[str, Any]:
    """Unbatched vs dynamically batched throughput and latency of ``digits-large`` on one built zoo preset.

    Args:
        zoo_root: a built preset, ``<zoo dir>/<preset>`` (e.g. ``var/zoo/demo``).
        num_requests: requests per way of serving, one held-out digit each.
        concurrency: concurrent callers for the concurrent and batched ways.
        max_batch_size: the batcher's largest batch, in rows.
        max_queue_delay_ms: how long the batcher waits for a batch to fill.
        num_threads: ONNX Runtime intra-op threads (the same runner serves every way).

    Returns:
        JSON-ready results: per way ``requests_per_s``, ``p50_ms``, ``p99_ms``; the headline
        ``unbatched_requests_per_s`` (best unbatched way), ``batched_requests_per_s``, ``batching_speedup`` and
        ``mean_batch_size``; the execution ``provider``; the largest difference between batched and unbatched
        outputs; and ``registry_load``: how long a registry tensor version of the same model takes to load
        (verified) on first use, cold and from the cache.
    """
    layout = ZooLayout(zoo_root)
    report = layout.report()
    held_out = np.load(layout.artifact_dir("digits-held-out") / "digits-held-out.npz")["x"]
    requests = [held_out[i % len(held_out)][None, :] for i in range(num_requests)]
    runner = OnnxRunner(layout.artifact_dir(MODEL) / "model.onnx", num_threads=num_threads)
    for x in (held_out[:1], held_out[:max_batch_size]) * 20:  # warm up both small and full-batch kernels
        runner.run(x)

    reference, sequential = _unbatched_sequential(runner, requests)
    _, concurrent = asyncio.run(_unbatched_concurrent(runner, requests, concurrency))
    batched_out, batched = asyncio.run(_batched(runner, requests, concurrency, max_batch_size, max_queue_delay_ms))

    registry_load = asyncio.run(_registry_load(layout.artifact_dir(MODEL) / "model.onnx", 5, num_threads))
    unbatched_rps = max(sequential["requests_per_s"], concurrent["requests_per_s"])
    max_diff = max(float(np.abs(a - b).max()) for a, b in zip(batched_out, reference, strict=True))
    return {
        "bench": "tensor-dynamic-batching",
        "preset": report.get("preset"),
        "model": MODEL,
        "provider": runner.provider,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "intra_op_threads": num_threads},
        "num_requests": num_requests,
        "concurrency": concurrency,
        "max_batch_size": max_batch_size,
        "max_queue_delay_ms": max_queue_delay_ms,
        "unbatched_requests_per_s": unbatched_rps,
        "batched_requests_per_s": batched["requests_per_s"],
        "batching_speedup": round(batched["requests_per_s"] / unbatched_rps, 2),
        "mean_batch_size": batched["mean_batch_size"],
        "max_abs_diff_batched_vs_unbatched": max_diff,
        "registry_load": registry_load,
        "results": {
            "unbatched_sequential": sequential,
            "unbatched_concurrent": concurrent,
            "batched": batched,
        },
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(run_tensor_bench(Path(sys.argv[1])), indent=2))
