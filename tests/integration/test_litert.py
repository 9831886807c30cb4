"""LiteRT as a real edge runtime: the tiny zoo's TFLite export (the KV cache kept in the interpreter, XNNPACK on)
decodes exactly like ONNX Runtime fp32, gives the escalation policy the same evidence, loads without LiteRT's
banner, and is what a device with LiteRT only serves as ``tierline/lm-edge``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from edge_agent.runtime.lm import OnnxCausalLM, TfliteCausalLM, load_causal_lm
from shared.escalation import step_signal
from tests.conftest import REPO, base_env, free_port, run_server, seed_data_dir

pytestmark = pytest.mark.integration

NEW_TOKENS = 40


def _prompts(vocab: int, max_context: int) -> list[list[int]]:
    rng = np.random.default_rng(26)
    lengths = [1, 5, 31, 32, 33, 64, 100, max_context - NEW_TOKENS - 3]  # around the 32-token prefill chunk
    return [rng.integers(2, vocab, size=n).tolist() for n in lengths]


def _steps(runtime: OnnxCausalLM | TfliteCausalLM, ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits each was chosen from, the way the agent's generation loop drives a runtime."""
    runtime.reset()
    logits = runtime.prefill(ids)
    tokens: list[int] = []
    seen: list[np.ndarray] = []
    for _ in range(n):
        seen.append(np.array(logits, copy=True))
        tokens.append(int(np.argmax(logits)))
        logits = runtime.decode(tokens[-1])
    return tokens, seen


def test_litert_decodes_exactly_like_onnx_fp32_with_the_same_escalation_signals(tiny_zoo: Path) -> None:
    arts = tiny_zoo / "artifacts"
    onnx = load_causal_lm(arts / "lm-edge-onnx")
    tflite = load_causal_lm(arts / "lm-edge-tflite")
    assert isinstance(onnx, OnnxCausalLM)
    assert isinstance(tflite, TfliteCausalLM)  # the zoo writes the in-interpreter-cache export (v2)
    assert tflite.vocab_size is not None
    for ids in _prompts(tflite.vocab_size, tflite.max_context):
        want, want_logits = _steps(onnx, ids, NEW_TOKENS)
        got, got_logits = _steps(tflite, ids, NEW_TOKENS)
        assert got == want, f"{len(ids)}-token prompt"
        np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), atol=2e-4, rtol=0)
        for token, a, b in zip(want, want_logits, got_logits, strict=True):
            sa, sb = step_signal(a, token), step_signal(b, token)
            assert sb.logprob == pytest.approx(sa.logprob, abs=1e-4)
            assert sb.margin == pytest.approx(sa.margin, abs=1e-4)
            assert sb.norm_entropy == pytest.approx(sa.norm_entropy, abs=1e-4)
    # A second sequence on the same runtime, then a prompt continued after decoding: nothing stale leaks in.
    first = _prompts(tflite.vocab_size, tflite.max_context)[5]
    assert tflite.greedy(first, 8) == onnx.greedy(first, 8)
    tflite.reset()
    onnx.reset()
    for rt in (tflite, onnx):
        rt.prefill(first[:40])
        rt.decode(7)
    assert np.argmax(tflite.prefill(first[40:])) == np.argmax(onnx.prefill(first[40:]))
    assert tflite.num_tokens == onnx.num_tokens == len(first) + 1
    # A prompt whose last padded chunk would run past the cache: its tail is fed token by token.
    near_end = np.random.default_rng(7).integers(2, tflite.vocab_size, size=tflite.max_context - 6).tolist()
    assert tflite.greedy(near_end, 6) == onnx.greedy(near_end, 6)


def test_litert_loads_without_its_banner_and_keeps_other_output(tiny_zoo: Path) -> None:
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from edge_agent.runtime.lm import load_causal_lm\n"
        "os.write(2, b'before\\n')\n"
        f"rt = load_causal_lm(Path({str(tiny_zoo / 'artifacts' / 'lm-edge-tflite')!r}))\n"
        "os.write(2, b'after\\n')\n"
        "print(rt.greedy([5, 6, 7], 3))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "XNNPACK" not in proc.stderr + proc.stdout
    assert proc.stderr.splitlines()[:1] == ["before"] and "after" in proc.stderr.splitlines()
    assert proc.stdout.strip().startswith("[")


def test_a_device_with_litert_only_serves_lm_edge_with_it(
    tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    from shared.chat_tokenizer import ChatTokenizer

    # The agent process cannot import ONNX Runtime (nor llama.cpp): as on a device image that ships LiteRT only.
    blocker = tmp_path / "no-onnxruntime"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['onnxruntime'] = None\nsys.modules['llama_cpp'] = None\n"
    )
    d = seed_data_dir(tmp_path / "edge", tiny_zoo, session_data_dir)
    env = base_env(d, TIERLINE_EDGE_ZOO_DIR=str(d / "zoo" / "tiny"))
    env["PYTHONPATH"] = f"{blocker}:{env.get('PYTHONPATH', REPO)}"
    prompt = list(range(10, 60))
    lm_dir = tiny_zoo / "artifacts" / "lm-edge-onnx"
    want = load_causal_lm(lm_dir).greedy(prompt, 16)
    with run_server(["edge", "run"], env, free_port(), timeout=120) as url:
        models = {m["id"]: m["format"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert models == {"tierline/lm-edge-tflite": "tflite", "tierline/lm-edge": "tflite"}
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": "tierline/lm-edge",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-tierline-tier"] == "edge"
        assert r.json()["choices"][0]["text"] == ChatTokenizer(lm_dir).decode(want)
