"""The runtime guard on the tiny zoo's real edge exports (ONNX Runtime fp32 and INT8, LiteRT when installed,
llama.cpp when installed): every candidate is timed and checked against the fp32 reference's greedy outputs (the
zoo's exports carry no reference.json; ``test_edge_own_models`` checks exports against theirs);
the fastest that meets the agreement bound serves the plain model id; one the device cannot run is listed
with the reason; the INT8 guard is its two-candidate special case."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent import int8_guard, runtime_guard
from edge_agent.generation import LocalLM, LocalRequest
from edge_agent.model_store import ModelStore
from edge_agent.models import EDGE_LM, EDGE_LM_FP32, ServedModels
from edge_agent.runtime import gguf
from edge_agent.runtime.lm import CausalLMRuntime, load_causal_lm
from shared.artifacts import load_public_key
from shared.zoo.registry import ZooLayout
from tests.conftest import seed_data_dir

pytestmark = pytest.mark.integration


def _served(data: Path, min_agreement: float = 1.0) -> ServedModels:
    keys = [load_public_key(data / "keys" / "artifact-signing.ed25519.pub")]
    return ServedModels(data / "zoo" / "tiny", ModelStore(data / "agent"), keys, 1, min_agreement)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Path:
    return seed_data_dir(tmp_path_factory.mktemp("guard"), tiny_zoo, session_data_dir)


def test_the_fastest_candidate_within_the_bound_serves_the_plain_id(data: Path) -> None:
    served = _served(data)
    choice = served.guards[EDGE_LM]
    measured = {c.format: c for c in choice.candidates}
    # The tiny zoo's exports carry no reference.json: the fp32 export is the reference, and the report says so.
    assert {"onnx", "onnx-int8"} <= set(measured) and choice.reference == runtime_guard.FP32_REFERENCE
    assert measured["onnx"].agreement == 1.0 and measured["onnx"].eligible
    for c in choice.candidates:
        if c.ms_per_token is None:  # not run: it says why
            assert not c.eligible and c.reason
            continue
        assert c.ms_per_token > 0 and c.agreement is not None
        assert c.eligible == (c.agreement >= 1.0), c
        if not c.eligible:
            assert c.reason is not None and "below the bound" in c.reason
    fastest = min((c for c in choice.candidates if c.eligible), key=lambda c: c.ms_per_token or 0)
    assert choice.chosen == fastest.format == served.served_format(EDGE_LM)
    # No change in outputs at greedy: the plain id answers the check prompts as the fp32 reference does.
    plain, reference = served.lms.get(EDGE_LM), served.lms.get(EDGE_LM_FP32)
    for text in runtime_guard.CHECK_PROMPTS:
        ids = reference.tokenizer.encode(text)
        req = LocalRequest(ids, max_tokens=runtime_guard.CHECK_TOKENS, temperature=0.0, ignore_eos=True)
        assert [s.token_id for s in plain.generate(req)] == [s.token_id for s in reference.generate(req)]
    if gguf.missing_reason() is not None:  # llama.cpp not installed: GGUF listed, not run, and why
        for fmt in ("gguf-q8_0", "gguf-f32"):
            assert measured[fmt].runtime == "llama.cpp" and not measured[fmt].eligible
            assert "llama-cpp-python is not installed" in (measured[fmt].reason or "")
    assert served.serving()[EDGE_LM] == choice.as_json()


def test_a_lower_bound_admits_a_quantized_candidate_that_changes_outputs(data: Path) -> None:
    served = _served(data, min_agreement=0.0)
    choice = served.guards[EDGE_LM]
    assert choice.min_agreement == 0.0
    assert all(c.eligible for c in choice.candidates if c.ms_per_token is not None)
    timed = [c for c in choice.candidates if c.ms_per_token is not None]
    assert choice.chosen == min(timed, key=lambda c: c.ms_per_token or 0).format


def test_a_candidate_that_cannot_load_is_listed_not_served(tiny_zoo: Path) -> None:
    fp32_dir = ZooLayout(tiny_zoo).artifact_dir("lm-edge-onnx")

    def broken() -> CausalLMRuntime:
        raise RuntimeError("no such delegate")

    choice = runtime_guard.choose(
        [
            runtime_guard.Candidate("onnxruntime", "onnx", lambda: load_causal_lm(fp32_dir), model_id="fp32"),
            runtime_guard.Candidate("litert", "tflite", broken),
            runtime_guard.Candidate("llama.cpp", "gguf-q8_0", unavailable="llama-cpp-python is not installed"),
        ],
        rounds=1,
    )
    assert choice.chosen == "onnx"
    out = {c["format"]: c for c in choice.as_json()["candidates"]}
    assert out["tflite"]["reason"] == "cannot load: RuntimeError: no such delegate" and not out["tflite"]["eligible"]
    assert out["gguf-q8_0"]["reason"] == "llama-cpp-python is not installed"
    assert out["gguf-q8_0"]["ms_per_token"] is None


def test_the_int8_guard_is_the_two_onnx_candidate_case(tiny_zoo: Path) -> None:
    layout = ZooLayout(tiny_zoo)
    choice = int8_guard.choose(layout.artifact_dir("lm-edge-onnx-int8"), layout.artifact_dir("lm-edge-onnx"), 1)
    assert choice.int8_ms_per_token > 0 and choice.fp32_ms_per_token > 0
    faster = "onnx-int8" if choice.int8_ms_per_token < choice.fp32_ms_per_token else "onnx"
    assert choice.chosen == faster
    LocalLM(layout.artifact_dir("lm-edge-onnx"))  # (the plain loader still takes an ONNX dir as it is)
