"""``tierline bench edge``: what the edge LM costs on this host.

Decode speed of the zoo's edge LM in each device format (ONNX fp32, ONNX INT8, TFLite, and GGUF Q8_0/f32 through
the agent's llama.cpp runtime when llama-cpp-python is installed) beside eager torch (transformers, same
weights), INT8's next-token agreement with fp32 on held-out code, model file sizes, and the resident memory of a
real, idle edge agent serving the zoo, with the runtime its runtime guard chose for ``tierline/lm-edge`` and that
runtime's speed in the same rounds (``agent_serving``; beside llama.cpp's own loop with ``--vs llamacpp``).

Speed is generated tokens over the wall time of one greedy run (prefill of a 64-token held-out prompt, then
one decode step per token with a KV cache), best of ``repeats`` after a warm-up, the same thread count
everywhere.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np

from bench.common import emit, free_port, served, tokens_before_divergence, zoo_root
from edge_agent.runtime.lm import CausalLMRuntime, OnnxCausalLM, load_causal_lm
from shared.errors import ConfigurationError, ValidationError
from shared.zoo.registry import ZooLayout

PROMPT_TOKENS = 64
NUM_WINDOWS = 8
WINDOW_TOKENS = 64
# The targets; reported beside the measurements, never enforced.
TARGETS = {"fp32_vs_torch": 2.0, "int8_vs_fp32": 1.3, "agreement_int8_vs_fp32": 0.97}
AGENT_LM = "tierline/lm-edge"
# The runtime guard's formats -> the run that measures that runtime here.
AGENT_RUNS = {
    "onnx": "fp32",
    "onnx-int8": "int8",
    "tflite": "tflite",
    "gguf-q8_0": "agent_gguf_q8_0",
    "gguf-f32": "agent_gguf_f32",
}
AGENT_TARGET = 1.0  # the agent serving lm-edge at batch 1 vs llama.cpp Q8_0 (median of per-round ratios)
AGENT_START_TIMEOUT_S = 180.0
AGENT_SETTLE_S = 1.0


def _held_out_ids(layout: ZooLayout) -> tuple[list[int], np.ndarray]:
    """The timing prompt (the first held-out file's opening) and teacher-forcing windows: int64 [N, T]
    from the middle of the next held-out files long enough to hold one."""
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer.from_file(str(layout.artifact_dir("lm-edge") / "tokenizer.json"))
    files = held_out_files()
    prompt = list(tok.encode(files[0].text).ids[:PROMPT_TOKENS])
    windows: list[list[int]] = []
    for f in files[1:]:
        ids = tok.encode(f.text).ids
        if len(ids) >= WINDOW_TOKENS:
            start = (len(ids) - WINDOW_TOKENS) // 2
            windows.append(ids[start : start + WINDOW_TOKENS])
        if len(windows) == NUM_WINDOWS:
            break
    return prompt, np.asarray(windows, dtype=np.int64)


def _best_rates(
    runs: dict[str, Callable[[], list[int]]],
    num_tokens: int,
    repeats: int,
    per_round: dict[str, list[float]] | None = None,
    medians: dict[str, float] | None = None,
) -> tuple[dict[str, float], dict[str, list[int]]]:
    """(tokens/s of each run's best of ``repeats``, the tokens each generated), after one warm-up each; every
    round's tokens/s goes into ``per_round`` and the median tokens/s of each run into ``medians`` when given."""
    tokens = {name: run() for name, run in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        # Round-robin, so a burst of load from elsewhere on the host slows every format alike.
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    if per_round is not None:
        for name, t in times.items():
            per_round.setdefault(name, []).extend(num_tokens / s for s in t)
    if medians is not None:
        medians.update({name: num_tokens / float(np.median(t)) for name, t in times.items()})
    return {name: num_tokens / min(t) for name, t in times.items()}, tokens


def _torch_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> Callable[[], list[int]]:
    """Eager transformers with its KV cache, driven step by step like the runtimes (no ``generate`` overhead)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy() -> list[int]:
        with torch.inference_mode():
            # logits_to_keep=1: the prefill projects only the last position, as ``generate`` does.
            out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            while len(tokens) < num_tokens:
                out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True, logits_to_keep=1)
                tokens.append(int(out.logits[0, -1].argmax()))
        return tokens

    return greedy


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


DECISIVE_MARGIN = 0.05  # fp32 top-1 minus top-2 probability; below it the two choices are a near-tie


def _next_token_choices(runtime: CausalLMRuntime, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced greedy choice at every position of every window, and the top-1 minus top-2 probability
    margin there: int64 [N, T] and float [N, T]."""
    assert isinstance(runtime, OnnxCausalLM)
    meta = runtime.meta
    empty = np.zeros((meta["num_layers"], len(windows), meta["num_kv_heads"], 0, meta["head_dim"]), np.float32)
    # logits: [N, T, V]
    logits = runtime.session.run(["logits"], {"input_ids": windows, "past_keys": empty, "past_values": empty})[0]
    choices: np.ndarray = logits.argmax(-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top2 = np.sort(p, axis=-1)[..., -2:]
    return choices, top2[..., 1] - top2[..., 0]


def _model_bytes(artifact_dir: Path) -> int:
    """The model file with any external-data files beside it (``model.onnx``, ``model.onnx.data``...)."""
    return sum(p.stat().st_size for p in artifact_dir.glob("model.*") if p.is_file())


def _vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    raise ConfigurationError(f"no VmRSS in /proc/{pid}/status")


@contextmanager
def _running_agent(zoo_root: Path, data_dir: Path, threads: int) -> Iterator[tuple[int, str]]:
    """``tierline edge run`` on a free port, serving ``zoo_root`` with the data dir's signing key; yields
    (pid, base URL) once /healthz answers, then SIGTERMs it."""
    from shared.artifacts import public_path
    from shared.settings import CoreSettings

    key = public_path(CoreSettings(data_dir=data_dir).signing_key_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
    env.update(
        {
            "TIERLINE_DATA_DIR": str(data_dir),
            "TIERLINE_LOG_LEVEL": "WARNING",
            "TIERLINE_EDGE_ZOO_DIR": str(zoo_root),
            "TIERLINE_EDGE_TRUSTED_KEYS": json.dumps([str(key)]),
            "TIERLINE_EDGE_NUM_THREADS": str(threads),
        }
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tierline.cli", "edge", "run", "--host", "127.0.0.1", "--port", str(port)]
    try:
        what = f"the edge agent on {url}"
        with served(cmd, env, f"{url}/healthz", what, start_timeout_s=AGENT_START_TIMEOUT_S) as proc:
            yield proc.pid, url
    except RuntimeError as exc:
        raise ConfigurationError(str(exc)) from exc


def agent_idle_rss_mb(zoo_root: Path, data_dir: Path, threads: int = 1) -> tuple[float, int]:
    """(resident MB of a started, idle edge agent serving ``zoo_root``, how many models it serves)."""
    rss, count, _ = _agent_facts(zoo_root, data_dir, threads)
    return rss, count


def _agent_facts(zoo_root: Path, data_dir: Path, threads: int) -> tuple[float, int, dict[str, Any] | None]:
    """(idle resident MB, models served, the runtime guard's choice for the plain edge LM id) of a real agent."""
    with _running_agent(zoo_root, data_dir, threads) as (pid, url):
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        if not models:
            raise ConfigurationError(
                f"the edge agent refused every artifact in {zoo_root}: is it signed by {data_dir}'s key?"
            )
        guard = next((m.get("runtime_guard") for m in models if m["id"] == AGENT_LM), None)
        time.sleep(AGENT_SETTLE_S)
        return _vm_rss_mb(pid), len(models), guard


def _host(threads: int) -> dict[str, Any]:
    cpu, flags = platform.processor(), set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    import onnxruntime

    return {
        "machine": platform.machine(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "int8_dot_product": bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"}),
        "threads": threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def _llamacpp_runs(
    zoo_root: Path, prompt: list[int], num_tokens: int, threads: int, max_len: int
) -> tuple[dict[str, Callable[[], list[int]]], list[Any]]:
    """llama.cpp on the edge LM's GGUF exports (f32 and Q8_0), greedy, batch 1, the same prompt and thread count."""
    from bench.llamacpp import LlamaCppBatch, gguf_path

    peers = {
        f"llamacpp_{kind}": LlamaCppBatch(gguf_path(zoo_root, "lm-edge", kind), 1, max_len, threads)
        for kind in ("f32", "q8_0")
    }

    def run(peer: LlamaCppBatch) -> list[int]:
        return peer.generate([(prompt, num_tokens)])[0]

    return {name: partial(run, peer) for name, peer in peers.items()}, list(peers.values())


def _agent_gguf_runs(
    zoo_root: Path, prompt: list[int], num_tokens: int, threads: int
) -> tuple[dict[str, Callable[[], list[int]]], list[Any]]:
    """The agent's own GGUF runtime (edge_agent/runtime/gguf.py) on both weight files, when the zoo has them."""
    from edge_agent.runtime import gguf, load_runtime

    directory = ZooLayout(zoo_root).artifact_dir("lm-edge-gguf")
    if gguf.missing_reason() is not None or not gguf.is_gguf_dir(directory):
        return {}, []
    runtimes = {f"agent_gguf_{v}": load_runtime(directory, threads, v) for v in gguf.variants(directory)}
    return {name: partial(rt.greedy, prompt, num_tokens) for name, rt in runtimes.items()}, list(runtimes.values())


def _median_ratio(a: list[float], b: list[float]) -> float:
    return round(float(np.median([x / y for x, y in zip(a, b, strict=True)])), 2)


def _agent_serving(
    guard: dict[str, Any] | None,
    rates: dict[str, float],
    per_round: dict[str, list[float]],
    tokens: dict[str, list[int]],
) -> dict[str, Any]:
    """What the agent serves ``tierline/lm-edge`` with (its runtime guard's choice) and that runtime's speed in
    these rounds, beside llama.cpp Q8_0 (the bench's own llama-cpp-python loop): the issue's edge target."""
    chosen = guard.get("chosen") if guard else None
    run = AGENT_RUNS.get(chosen or "")
    out: dict[str, Any] = {"chosen": chosen, "runtime_guard": guard}
    if run is None or run not in rates:
        out["error"] = f"the chosen runtime {chosen!r} was not in the rounds"
        return out
    out.update(
        {
            "tokens_per_s": round(rates[run], 1),
            "tokens_per_s_runs": [round(x, 1) for x in per_round[run]],
            "outputs_identical_to_fp32": tokens[run] == tokens["fp32"],
        }
    )
    if "llamacpp_q8_0" in rates:
        out["vs_llamacpp_q8_0"] = _median_ratio(per_round[run], per_round["llamacpp_q8_0"])
        ratios = [a / b for a, b in zip(per_round[run], per_round["llamacpp_q8_0"], strict=True)]
        out["vs_llamacpp_q8_0_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
        # The agent's llama.cpp runtime against llama.cpp's own loop on the same file: its Python step's cost.
        for kind in ("q8_0", "f32"):
            if f"agent_gguf_{kind}" in per_round:
                out[f"agent_gguf_{kind}_vs_llamacpp_{kind}"] = _median_ratio(
                    per_round[f"agent_gguf_{kind}"], per_round[f"llamacpp_{kind}"]
                )
        out["vs_llamacpp_q8_0_best"] = round(rates[run] / rates["llamacpp_q8_0"], 2)
        out["target_vs_llamacpp_q8_0"] = AGENT_TARGET
        out["target_met"] = out["vs_llamacpp_q8_0"] >= AGENT_TARGET
    return out


def _vs_llamacpp(rates: dict[str, float], tokens: dict[str, list[int]]) -> dict[str, Any]:
    return {
        "llamacpp_f32_tokens_per_s": round(rates["llamacpp_f32"], 1),
        "llamacpp_q8_0_tokens_per_s": round(rates["llamacpp_q8_0"], 1),
        "fp32_vs_llamacpp_f32": round(rates["fp32"] / rates["llamacpp_f32"], 2),
        "int8_vs_llamacpp_q8_0": round(rates["int8"] / rates["llamacpp_q8_0"], 2),
        "best_onnx_vs_llamacpp_q8_0": round(max(rates["fp32"], rates["int8"]) / rates["llamacpp_q8_0"], 2),
        # same weights in f32 on both: greedy must agree token for token
        "llamacpp_f32_outputs_identical_to_fp32": tokens["llamacpp_f32"] == tokens["fp32"],
        "llamacpp_q8_0_tokens_before_divergence_from_fp32": tokens_before_divergence(
            tokens["llamacpp_q8_0"], tokens["fp32"]
        ),
    }


LITERT_TARGET_VS_FP32 = 0.5  # issue 26: LiteRT on lm-edge at batch 1 >= 0.5x ONNX Runtime fp32


def _litert_figures(
    runtime: CausalLMRuntime, best: dict[str, float], medians: dict[str, float], tokens: dict[str, list[int]]
) -> dict[str, Any]:
    """LiteRT beside ONNX Runtime fp32 from the same alternating rounds: medians (and bests) and their ratio."""
    ratio = medians["tflite"] / medians["fp32"]
    return {
        "runtime": type(runtime).__name__,
        "io": runtime.meta.get("io"),
        "tokens_per_s_median": round(medians["tflite"], 1),
        "fp32_tokens_per_s_median": round(medians["fp32"], 1),
        "vs_fp32_median": round(ratio, 3),
        "vs_fp32_best": round(best["tflite"] / best["fp32"], 3),
        "outputs_identical_to_fp32": tokens["tflite"] == tokens["fp32"],
        "target_vs_fp32": LITERT_TARGET_VS_FP32,
        "target_met": ratio >= LITERT_TARGET_VS_FP32,
    }


def run_edge_bench(
    zoo_root: Path, data_dir: Path, num_tokens: int = 64, repeats: int = 5, threads: int = 1, vs: str = "torch"
) -> dict[str, Any]:
    """Every figure of ``tierline bench edge`` on the built zoo preset at ``zoo_root`` (signed by the key in
    ``data_dir``); with ``vs="llamacpp"`` llama.cpp on the edge LM's GGUF exports runs in the same rounds."""
    layout = ZooLayout(zoo_root)
    fp32 = load_causal_lm(layout.artifact_dir("lm-edge-onnx"), threads)
    if PROMPT_TOKENS + num_tokens > fp32.max_context:
        raise ValidationError(
            f"--tokens {num_tokens}: the {PROMPT_TOKENS}-token prompt plus new tokens must fit the edge LM's "
            f"context of {fp32.max_context}"
        )
    int8 = load_causal_lm(layout.artifact_dir("lm-edge-onnx-int8"), threads)
    prompt, windows = _held_out_ids(layout)

    runtimes = {"fp32": fp32, "int8": int8}
    tflite_dir = layout.artifact_dir("lm-edge-tflite")
    if tflite_dir.is_dir():
        runtimes["tflite"] = load_causal_lm(tflite_dir, threads)
    runs: dict[str, Callable[[], list[int]]] = {
        name: partial(rt.greedy, prompt, num_tokens) for name, rt in runtimes.items()
    }
    runs["torch"] = _torch_greedy(layout.artifact_dir("lm-edge"), prompt, num_tokens)
    peers: list[Any] = []
    if vs == "llamacpp":
        peer_runs, peers = _llamacpp_runs(zoo_root, prompt, num_tokens, threads, fp32.max_context)
        runs.update(peer_runs)
    # The agent's own GGUF runtime, whenever it can run here: the agent may serve it (``agent_serving``).
    agent_runs, agent_runtimes = _agent_gguf_runs(zoo_root, prompt, num_tokens, threads)
    runs.update(agent_runs)
    peers += agent_runtimes
    per_round: dict[str, list[float]] = {}
    medians: dict[str, float] = {}
    with _torch_threads(threads):
        rates, tokens = _best_rates(runs, num_tokens, repeats, per_round, medians)
    for peer in peers:
        peer.close()
    int8_choice, _ = _next_token_choices(int8, windows)
    fp32_choice, fp32_margin = _next_token_choices(fp32, windows)
    same = int8_choice == fp32_choice
    agreement = float(same.mean())
    decisive = fp32_margin >= DECISIVE_MARGIN
    # Where fp32 is itself undecided (a near-tie), quantization noise flips the choice; this shows whether
    # INT8 ever disagrees where the fp32 model is sure.
    agreement_decisive = float(same[decisive].mean()) if decisive.any() else 1.0
    rss_mb, num_models, guard = _agent_facts(zoo_root, data_dir, threads)

    result: dict[str, Any] = {
        "bench": "edge",
        "preset": layout.report().get("preset"),
        "prompt_tokens": len(prompt),
        "new_tokens": num_tokens,
        "threads": threads,
        "int8_tokens_per_s": round(rates["int8"], 1),
        "fp32_tokens_per_s": round(rates["fp32"], 1),
        "torch_tokens_per_s": round(rates["torch"], 1),
        "tflite_tokens_per_s": round(rates["tflite"], 1) if "tflite" in rates else None,
        "fp32_vs_torch": round(rates["fp32"] / rates["torch"], 2),
        "int8_vs_fp32": round(rates["int8"] / rates["fp32"], 2),
        "int8_size_bytes": _model_bytes(layout.artifact_dir("lm-edge-onnx-int8")),
        "fp32_size_bytes": _model_bytes(layout.artifact_dir("lm-edge-onnx")),
        "agreement_int8_vs_fp32": round(agreement, 4),
        "agreement_positions": int(windows.size),
        "agreement_where_fp32_margin_ge_0_05": round(agreement_decisive, 4),
        "fp32_near_tie_share": round(float(1 - decisive.mean()), 4),
        "fp32_tokens_before_divergence_from_torch": tokens_before_divergence(tokens["fp32"], tokens["torch"]),
        "agent_idle_rss_mb": round(rss_mb, 1),
        "agent_models": num_models,
    }
    if "tflite" in runtimes:
        result["litert"] = _litert_figures(runtimes["tflite"], rates, medians, tokens)
    if vs == "llamacpp":
        result["vs_llamacpp"] = _vs_llamacpp(rates, tokens)
        for name in ("agent_gguf_q8_0", "agent_gguf_f32"):
            if name in rates:
                result["vs_llamacpp"][f"{name}_tokens_per_s"] = round(rates[name], 1)
    result["agent_serving"] = _agent_serving(guard, rates, per_round, tokens)
    result["targets"] = TARGETS
    result["targets_met"] = {key: result[key] >= target for key, target in TARGETS.items()}
    result["host"] = _host(threads)
    return result


@click.command("edge")
@click.option("--preset", type=click.Choice(["tiny", "demo"]), default="demo", show_default=True)
@click.option("--zoo-dir", type=click.Path(path_type=Path), default=None, help="default $TIERLINE_DATA_DIR/zoo")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="tokens to decode per run")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="timed runs (best kept)")
@click.option("--threads", type=click.IntRange(1, 64), default=1, show_default=True, help="threads per runtime")
@click.option(
    "--vs",
    type=click.Choice(["torch", "llamacpp"]),
    default="torch",
    show_default=True,
    help="add llama.cpp on the edge LM's GGUF exports (f32, Q8_0) to the rounds (needs tierline[peers])",
)
def edge_command(
    preset: str, zoo_dir: Path | None, as_json: bool, tokens: int, repeats: int, threads: int, vs: str
) -> None:
    """Edge LM on this host: INT8/fp32/TFLite decode speed beside eager torch (and llama.cpp with --vs llamacpp),
    INT8 agreement, sizes, agent RSS."""
    from shared.settings import CoreSettings

    if vs == "llamacpp":
        from bench.llamacpp import missing_reason

        if (reason := missing_reason()) is not None:
            raise click.UsageError(f"--vs llamacpp: {reason}")
    root = zoo_root(preset, zoo_dir)
    emit(run_edge_bench(root, CoreSettings().data_dir, tokens, repeats, threads, vs), as_json)


if __name__ == "__main__":
    edge_command()
