"""The tiny zoo, built once per session: real files loaded by transformers, ONNX Runtime and LiteRT."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from edge_agent.runtime.lm import load_causal_lm
from shared.zoo.build import build_zoo
from shared.zoo.export_lm import cache_shape, load_export_llama
from shared.zoo.presets import DEMO, TINY
from shared.zoo.registry import ZooLayout
from tests.conftest import base_env
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

EXPECTED_ARTIFACTS = {
    "lm-edge",
    "lm-cloud",
    "lm-draft",
    "lm-edge-onnx",
    "lm-edge-onnx-int8",
    "lm-edge-tflite",
    "lm-micro",
    "lm-micro-onnx",
    "lm-micro-onnx-int8",
    "lm-cloud-gguf",
    "lm-edge-gguf",
    "digits-small",
    "digits-large",
    "digits-micro",
    "digits-held-out",
}


def test_build_writes_every_artifact_with_a_signed_manifest(tiny_zoo: Path) -> None:
    layout = ZooLayout(tiny_zoo)
    assert set(layout.manifest_names()) == EXPECTED_ARTIFACTS
    report = layout.report()
    assert report["artifacts"]["lm-edge-onnx"]["derived_from"] == "lm-edge"
    onnx = layout.manifest("lm-edge-onnx-int8")
    assert onnx.derived_from is not None and onnx.derived_from["name"] == "lm-edge-onnx"
    assert onnx.derived_from["sha256"] == layout.manifest("lm-edge-onnx").sha256
    assert onnx.format == "onnx-int8" and onnx.signature and onnx.signature["alg"] == "ed25519"
    draft = layout.manifest("lm-draft")
    assert draft.derived_from is not None and draft.derived_from["sha256"] == layout.manifest("lm-edge").sha256


def test_second_build_is_cached(tiny_zoo: Path, session_data_dir: Path) -> None:
    from shared.artifacts import load_or_create_signing_key

    before = (tiny_zoo / "zoo.json").stat().st_mtime_ns
    key = load_or_create_signing_key(session_data_dir / "keys" / "artifact-signing.ed25519")
    started = time.monotonic()
    build_zoo(TINY, tiny_zoo.parent, key)
    assert time.monotonic() - started < 2.0
    assert (tiny_zoo / "zoo.json").stat().st_mtime_ns == before


def test_the_micro_lm_is_the_smallest_and_runs_on_the_device_runtime(tiny_zoo: Path) -> None:
    """The weak side of the LM pair with a real gap: fewer parameters than the edge LM, its own seed, exported
    to ONNX INT8 (derived from the fp32 export) and decoded by the agent's runtime."""
    layout = ZooLayout(tiny_zoo)
    training = layout.report()["training"]
    assert training["micro"]["num_params"] == TINY.micro.num_params(TINY.vocab_size)
    assert training["micro"]["num_params"] < training["edge"]["num_params"] / 2
    for preset in (TINY, DEMO):
        assert preset.micro.flops_per_token(preset.vocab_size) < preset.edge.flops_per_token(preset.vocab_size)
    int8 = layout.manifest("lm-micro-onnx-int8")
    assert int8.derived_from is not None and int8.derived_from["sha256"] == layout.manifest("lm-micro-onnx").sha256
    assert layout.report()["artifacts"]["lm-micro-onnx"]["derived_from"] == "lm-micro"
    runtime = load_causal_lm(layout.artifact_dir("lm-micro-onnx-int8"), num_threads=1)
    logits = runtime.prefill([5, 17, 300, 42])
    assert logits.shape == (TINY.vocab_size,) and np.isfinite(logits).all()
    assert runtime.decode(int(np.argmax(logits))).shape == (TINY.vocab_size,)


def test_compute_ratio_between_cloud_and_edge() -> None:
    for preset in (TINY, DEMO):
        ratio = preset.cloud.flops_per_token(preset.vocab_size) / preset.edge.flops_per_token(preset.vocab_size)
        assert ratio >= 6.0, preset.name


def test_the_distilled_draft_agrees_with_the_cloud_lm_more_often_than_the_edge_lm(tiny_zoo: Path) -> None:
    """The draft is the edge LM trained on the cloud LM's distribution: on held-out text its most likely next
    token is the cloud LM's more often than the edge LM's is (what speculative decoding's acceptance rides on)."""
    from transformers import LlamaForCausalLM

    from shared.zoo.corpus import held_out_files
    from shared.zoo.train_lm import top1_agreement

    tok = Tokenizer.from_file(str(tiny_zoo / "artifacts" / "lm-cloud" / "tokenizer.json"))
    stream = np.asarray([i for f in held_out_files()[:8] for i in tok.encode(f.text).ids], dtype=np.int32)
    lm = {
        role: LlamaForCausalLM.from_pretrained(tiny_zoo / "artifacts" / f"lm-{role}", dtype=torch.float32)
        for role in ("edge", "cloud", "draft")
    }
    edge = top1_agreement(lm["edge"], lm["cloud"], stream, 64, 32)
    draft = top1_agreement(lm["draft"], lm["cloud"], stream, 64, 32)
    assert draft > edge + 0.01, (edge, draft)
    report = ZooLayout(tiny_zoo).report()["training"]["draft"]
    assert report["top1_agreement_with_cloud"] > report["top1_agreement_with_cloud_before"]


def test_transformers_loads_every_lm(tiny_zoo: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for role in ("edge", "cloud", "draft", "micro"):
        path = tiny_zoo / "artifacts" / f"lm-{role}"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path)
        assert model.config.model_type == "llama"
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
        ids = tok("def main():\n    return", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.shape[1] == ids.shape[1] + 5
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")


def _hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_onnx_export_matches_transformers_through_the_kv_cache(tiny_zoo: Path) -> None:
    import onnxruntime as ort

    lm_dir = tiny_zoo / "artifacts" / "lm-edge"
    ids = [5, 17, 300, 42, 7, 99, 512, 3, 64]
    reference = _hf_logits(lm_dir, ids)
    llama = load_export_llama(lm_dir)
    sess = ort.InferenceSession(
        str(tiny_zoo / "artifacts" / "lm-edge-onnx" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    keys = values = np.zeros(cache_shape(llama, 0), np.float32)
    got = []
    # Prefill five tokens, then decode the rest one at a time through the returned cache.
    for chunk in [ids[:5]] + [[t] for t in ids[5:]]:
        logits, keys, values = sess.run(
            None, {"input_ids": np.array([chunk], np.int64), "past_keys": keys, "past_values": values}
        )
        got.append(logits[0])
    np.testing.assert_allclose(np.concatenate(got), reference, atol=1e-4, rtol=0)
    assert keys.shape[3] == len(ids)


@pytest.mark.parametrize("artifact", ["lm-edge-onnx", "lm-edge-onnx-int8", "lm-edge-tflite"])
def test_edge_runtimes_decode_like_transformers(tiny_zoo: Path, artifact: str) -> None:
    from transformers import AutoModelForCausalLM

    ids = list(range(10, 50))  # longer than the TFLite prefill chunk, so chunking is exercised
    model = AutoModelForCausalLM.from_pretrained(tiny_zoo / "artifacts" / "lm-edge", dtype=torch.float32)
    expected = model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=model.config.pad_token_id
    )[0, len(ids) :].tolist()
    got = load_causal_lm(tiny_zoo / "artifacts" / artifact).greedy(ids, 12)
    agreement = np.mean(np.array(got) == np.array(expected))
    # fp32 exports must agree exactly; INT8 only approximately (its agreement is reported by the build).
    assert agreement == 1.0 if artifact != "lm-edge-onnx-int8" else agreement >= 0.5


def test_digits_classifiers_score_as_reported(tiny_zoo: Path) -> None:
    import onnxruntime as ort

    layout = ZooLayout(tiny_zoo)
    data = np.load(layout.artifact_dir("digits-held-out") / "digits-held-out.npz")
    report = layout.report()["digits"]
    for role in ("small", "large"):
        sess = ort.InferenceSession(
            str(layout.artifact_dir(f"digits-{role}") / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        pred = sess.run(["logits"], {"pixels": data["x"]})[0].argmax(-1)
        accuracy = float((pred == data["y"]).mean())
        assert accuracy == pytest.approx(report[f"{role}_accuracy"], abs=1e-4)
        assert accuracy > 0.9
    assert report["large_accuracy"] >= report["small_accuracy"]


def test_verify_cli_passes_then_names_a_tampered_file(tiny_zoo: Path, session_data_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_zoo, copy)
    env = base_env(session_data_dir)
    ok = run_tierline("zoo", "verify", str(copy), env=env)
    assert ok.returncode == 0, ok.stderr
    assert f"{len(EXPECTED_ARTIFACTS)} of {len(EXPECTED_ARTIFACTS)} artifacts verified" in ok.stdout
    target = copy / "artifacts" / "digits-small" / "model.onnx"
    target.write_bytes(target.read_bytes()[:-1] + b"\x00")
    bad = run_tierline("zoo", "verify", str(copy), env=env)
    assert bad.returncode == 1
    assert f"FAIL {copy / 'artifacts' / 'digits-small'}" in bad.stderr
    assert "model.onnx: sha256 mismatch" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_verify_refuses_a_zoo_signed_by_another_key(tiny_zoo: Path, tmp_path: Path) -> None:
    env = base_env(tmp_path)  # a data dir whose own key did not sign this zoo
    from shared.artifacts import load_or_create_signing_key

    load_or_create_signing_key(tmp_path / "keys" / "artifact-signing.ed25519")
    proc = run_tierline("zoo", "verify", str(tiny_zoo), env=env)
    assert proc.returncode == 1
    assert "untrusted key" in proc.stderr


def test_report_has_the_numbers_the_issue_asks_for(tiny_zoo: Path) -> None:
    report = json.loads((tiny_zoo / "zoo.json").read_text())
    for role in ("edge", "cloud"):
        assert report["training"][role]["held_out_loss"] > 0
    assert 0.0 <= report["edge_lm"]["int8_top1_agreement"] <= 1.0
    assert report["edge_lm"]["tflite"]["max_abs_diff_vs_onnx"] < 1e-3
