"""Derive checks every edge export against the checkpoint it came from (transformers' greedy answers, carried in
``reference.json``), and each artifact succeeds or fails on its own with one line why."""

from __future__ import annotations

import importlib.util
import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlmodel import Session, col, select

from controlplane.registry.cli import models
from controlplane.storage.database import create_db
from controlplane.storage.tables import ModelArtifact
from shared.architectures import support_for, supported_list
from shared.artifacts import Manifest, load_public_key, verify_files, verify_signature
from shared.reference_answers import REFERENCE_FILE, ReferenceAnswers
from shared.zoo.export_gguf import find_converter
from tests.conftest import base_env, migrated_sqlite

pytestmark = pytest.mark.integration

NEEDS_GGUF = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or find_converter() is None,
    reason="GGUF needs llama-cpp-python (make peers) and llama.cpp's converter (make gguf-converter)",
)

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def make_checkpoint(
    out: Path, family: str, seed: int = 0, context: int = 256, std: float = 0.3, crush_int8: bool = False
) -> Path:
    """A tiny random checkpoint of ``family`` in the HF layout, with the zoo's byte-level BPE tokenizer. Weights
    are drawn wide (``std`` 0.3) so greedy answers depend on the prompt (at the usual 0.02 a random model answers one
    token whatever it reads, and no export could be told from another); Qwen2's biases and Qwen3's q/k norms are
    drawn away from their zero/one initial values, so an export that drops them answers differently.
    ``crush_int8``: one huge weight per matrix, so per-tensor INT8 rounds the others to nothing."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from shared.zoo.tokenizer import BOS_EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

    tok_dir = out.with_name(out.name + "-tokenizer")
    save_tokenizer(train_tokenizer([inspect.getsource(json)] * 2, 300), tok_dir, 256)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    special: dict[str, Any] = {
        "bos_token_id": tok.token_to_id(BOS_EOS_TOKEN),
        "eos_token_id": tok.token_to_id(BOS_EOS_TOKEN),
        "pad_token_id": tok.token_to_id(PAD_TOKEN),
    }
    if family == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=4, n_positions=context, **special
        )
        model: Any = transformers.GPT2LMHeadModel(config)
    else:
        config_cls, model_cls, extra = FAMILIES[family]
        config = getattr(transformers, config_cls)(
            vocab_size=tok.get_vocab_size(),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context,
            tie_word_embeddings=True,
            **special,
            **extra,
        )
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "q_norm" in name or "k_norm" in name:
                p.normal_(1.0, 0.5)
            if crush_int8 and p.ndim == 2:
                p[0, 0] = 100.0 * p.abs().max()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tok_dir / name, out / name)
    if family == "gpt2":  # as GPT-2 checkpoints on the Hub declare it (transformers 5 no longer writes it)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "n_ctx": cfg["n_positions"]}))
    return out


class Registry:
    """A registry on SQLite and a local store, driven through ``tierline models``."""

    def __init__(self, root: Path, **env: str) -> None:
        self.data = root / "data"
        self.url = migrated_sqlite(self.data)
        self.env = base_env(self.data, TIERLINE_DATABASE_URL=self.url, TIERLINE_REGISTRY_DERIVE_TFLITE="false", **env)
        self.runner = CliRunner()

    def push_and_derive(self, ckpt: Path, name: str, *args: str) -> dict[str, ModelArtifact]:
        pushed = self.runner.invoke(models, ["push", str(ckpt), "--name", name], env=self.env)
        assert pushed.exit_code == 0, pushed.output
        derived = self.runner.invoke(models, ["derive", name, "1", *args], env=self.env)
        assert derived.exit_code == 0, derived.output
        engine = create_db(self.url)
        with Session(engine) as s:
            rows = s.exec(select(ModelArtifact).where(ModelArtifact.target == "edge").order_by(col(ModelArtifact.id)))
            out = {a.format: a for a in rows}
        engine.dispose()
        return out

    def manifest(self, artifact: ModelArtifact) -> Manifest:
        manifest = Manifest.from_json(json.dumps(artifact.manifest))
        verify_signature(manifest, [load_public_key(self.data / "keys" / "artifact-signing.ed25519.pub")])
        return manifest

    def files(self, artifact: ModelArtifact, dest: Path) -> Path:
        from controlplane.registry.artifacts import materialize
        from controlplane.registry.store import LocalArtifactStore

        out = materialize(LocalArtifactStore(self.data / "artifacts"), artifact, dest)
        verify_files(self.manifest(artifact), out)
        return out


def _one_line_reason(artifact: ModelArtifact) -> str:
    reason = (artifact.manifest or {}).get("error") or (artifact.manifest or {}).get("metadata", {}).get("reason")
    assert isinstance(reason, str) and reason, artifact.manifest
    assert "\n" not in reason and "Traceback" not in reason, reason
    return reason


def _transformers_greedy(ckpt: Path, ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_a_checkpoint_derives_ready_artifacts_that_give_its_own_greedy_answers(tmp_path: Path, family: str) -> None:
    ckpt = make_checkpoint(tmp_path / family, family)
    reg = Registry(tmp_path)
    artifacts = reg.push_and_derive(ckpt, f"{family}-lm")
    assert {f: a.status for f, a in artifacts.items()} == {"onnx": "ready", "onnx-int8": artifacts["onnx-int8"].status}

    source_sha = reg.manifest(artifacts["onnx"]).derived_from
    assert source_sha is not None and source_sha["name"] == f"{family}-lm@1"
    references = []
    for fmt, artifact in artifacts.items():
        manifest = reg.manifest(artifact)
        assert REFERENCE_FILE in {f.path for f in manifest.files}, fmt  # hashed and signed with the export
        meta = manifest.metadata
        assert meta["verified_against"] == manifest.derived_from
        bound = 1.0 if fmt == "onnx" else 0.9
        assert meta["bound"] == bound
        assert meta["verdict"] == artifact.status == ("ready" if meta["agreement"]["overall"] >= bound else "rejected")
        reference = ReferenceAnswers.read(reg.files(artifact, tmp_path / fmt))
        assert reference is not None
        references.append(reference.to_json())
    assert len(set(references)) == 1  # one set of answers, from the source, in every artifact

    fp32 = reg.manifest(artifacts["onnx"]).metadata
    assert fp32["agreement"]["overall"] == fp32["agreement"]["long"] == 1.0
    assert set(fp32["first_divergence"].values()) == {None}
    reference = ReferenceAnswers.from_json(references[0])
    long = [p for p in reference.prompts if p.is_long]
    assert len(long) == 1 and len(long[0].token_ids) + len(long[0].greedy) == 256  # the model's whole context
    # The answers are transformers' own (recomputed here without a KV cache).
    short = reference.prompts[0]
    assert _transformers_greedy(ckpt, short.token_ids, len(short.greedy)) == short.greedy


def test_an_export_that_drops_a_bias_is_rejected_with_its_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test double of an exporter bug: the fp32 ONNX export loses layer 0's query bias."""
    from safetensors.torch import load_file, save_file

    from shared.zoo import export_lm

    real_export = export_lm.export_onnx

    def export_without_a_bias(model_dir: Path, out_path: Path) -> None:
        broken = tmp_path / "broken-checkpoint"
        shutil.copytree(model_dir, broken)
        weights = broken / "model.safetensors"
        state = load_file(str(weights))
        del state["model.layers.0.self_attn.q_proj.bias"]
        save_file(state, str(weights), metadata={"format": "pt"})
        real_export(broken, out_path)

    monkeypatch.setattr(export_lm, "export_onnx", export_without_a_bias)
    reg = Registry(tmp_path, TIERLINE_REGISTRY_GGUF_CONVERTER=str(tmp_path / "no-converter"))
    artifacts = reg.push_and_derive(make_checkpoint(tmp_path / "qwen2", "qwen2"), "biased", "--gguf")

    assert artifacts["onnx"].status == "rejected"
    reason = _one_line_reason(artifacts["onnx"])
    meta = reg.manifest(artifacts["onnx"]).metadata
    assert meta["verdict"] == "rejected" and meta["agreement"]["overall"] < 1.0
    assert "diverges at token" in reason and "must agree on 100%" in reason
    # The INT8 export is made from the fp32 graph; it gets its own verdict from its own numbers against the source.
    int8 = reg.manifest(artifacts["onnx-int8"]).metadata
    assert artifacts["onnx-int8"].status == ("ready" if int8["agreement"]["overall"] >= 0.9 else "rejected")
    # A sibling failing for its own reason (no converter at the configured path) fails alone, in one line.
    assert artifacts["gguf"].status == "failed"
    assert _one_line_reason(artifacts["gguf"]).startswith("gguf: TIERLINE_REGISTRY_GGUF_CONVERTER=")


def test_an_int8_export_below_its_bound_is_rejected_with_its_numbers(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    artifacts = reg.push_and_derive(make_checkpoint(tmp_path / "lm", "llama", crush_int8=True), "crushed")
    assert (artifacts["onnx"].status, artifacts["onnx-int8"].status) == ("ready", "rejected")
    meta = reg.manifest(artifacts["onnx-int8"]).metadata
    assert meta["agreement"]["overall"] < meta["bound"] == 0.9 and meta["verdict"] == "rejected"
    reason = _one_line_reason(artifacts["onnx-int8"])
    assert f"{meta['agreement']['overall']:.1%}" in reason and "below the bound 90.0%" in reason


def test_a_failing_gguf_export_fails_only_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.registry import edge_derive
    from shared.zoo import export_gguf

    def fails(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        raise KeyError("num_hidden_layers")

    monkeypatch.setattr(export_gguf, "export_gguf", fails)
    # The export fails before llama-cpp-python (which checks a made GGUF) would be used: the test runs without it.
    monkeypatch.setattr(edge_derive, "gguf_missing_reason", lambda: None)
    reg = Registry(tmp_path)
    artifacts = reg.push_and_derive(make_checkpoint(tmp_path / "llama", "llama"), "lm", "--gguf")
    assert artifacts["onnx"].status == "ready"
    assert artifacts["onnx-int8"].status in ("ready", "rejected")
    assert artifacts["gguf"].status == "failed"
    assert _one_line_reason(artifacts["gguf"]) == "gguf: KeyError: 'num_hidden_layers'"


@pytest.mark.skipif(importlib.util.find_spec("litert_torch") is None, reason="the LiteRT column needs litert-torch")
def test_an_architecture_a_format_cannot_serve_fails_only_that_format(tmp_path: Path) -> None:
    """GPT-2 has no LiteRT export (the architecture table says so): that artifact fails up front with the table's
    line, and every format that can serve GPT-2 is made and judged on its own."""
    reg = Registry(tmp_path)
    ckpt = make_checkpoint(tmp_path / "gpt2", "gpt2")
    support = support_for(json.loads((ckpt / "config.json").read_text()))
    assert "tflite" not in support.runtimes
    artifacts = reg.push_and_derive(ckpt, "gpt", "--gguf", "--tflite")
    assert artifacts["tflite"].status == "failed"
    assert _one_line_reason(artifacts["tflite"]) == (
        f"tflite: architecture gpt2 is not supported by the LiteRT export; supported: {supported_list('tflite')}"
    )
    for fmt in ("onnx", "onnx-int8", "gguf"):
        column = "onnx" if fmt == "onnx-int8" else fmt
        if column not in support.runtimes:
            assert _one_line_reason(artifacts[fmt]).startswith(f"{fmt}: architecture gpt2 is not supported by")
        elif artifacts[fmt].status == "failed":  # made and failed for a reason of its own (e.g. no llama.cpp)
            assert "is not supported by" not in _one_line_reason(artifacts[fmt])
    if "gguf" in support.runtimes and importlib.util.find_spec("llama_cpp") and find_converter():
        assert artifacts["gguf"].status == "ready"


@NEEDS_GGUF
def test_a_2000_token_prompt_through_the_devices_gguf_f32_runtime_is_transformers_greedy(tmp_path: Path) -> None:
    """Flash attention (llama.cpp's "auto") sums attention in float16 and left this prompt's greedy output at
    token 3; the device runtime runs with it off and an f32 cache."""
    from edge_agent.runtime.gguf import GgufCausalLM
    from shared.zoo.export_gguf import GGUF_F32, export_gguf
    from shared.zoo.verify import make_reference

    ckpt = make_checkpoint(tmp_path / "llama", "llama", context=2048, std=0.1)
    converter = find_converter()
    assert converter is not None
    export_gguf(ckpt, tmp_path / "gguf" / GGUF_F32, "f32", converter)
    shutil.copy2(ckpt / "config.json", tmp_path / "gguf" / "config.json")
    reference = make_reference(ckpt, {"name": "llama@1", "sha256": "-"}, 2048)
    long = next(p for p in reference.prompts if p.is_long)
    assert len(long.token_ids) >= 2000
    runtime = GgufCausalLM(tmp_path / "gguf", "f32")
    try:
        assert runtime.greedy(long.token_ids, len(long.greedy)) == long.greedy
    finally:
        runtime.close()


@NEEDS_GGUF
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral"])
def test_gguf_from_llama_cpps_converter_gives_the_checkpoints_greedy_answers(tmp_path: Path, family: str) -> None:
    reg = Registry(tmp_path, TIERLINE_REGISTRY_MIN_INT8_AGREEMENT="0")
    artifacts = reg.push_and_derive(make_checkpoint(tmp_path / family, family), f"{family}-lm", "--gguf")
    gguf = artifacts["gguf"]
    meta = reg.manifest(gguf).metadata
    assert gguf.status == "ready", meta
    assert meta["converter"].startswith("llama-cpp-python") and meta["files"] == {
        "f32": "model-f32.gguf",
        "q8_0": "model-q8_0.gguf",
    }
    assert meta["variants"]["f32"]["agreement"]["overall"] == meta["variants"]["f32"]["agreement"]["long"] == 1.0
    assert meta["variants"]["q8_0"]["agreement"]["overall"] >= meta["variants"]["q8_0"]["bound"] == 0.9
    files = reg.files(gguf, tmp_path / "gguf")
    assert (files / REFERENCE_FILE).is_file() and (files / "model-f32.gguf").is_file()
