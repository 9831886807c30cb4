"""llama.cpp on the edge: the agent's GGUF runtime (real llama-cpp-python on the tiny zoo's GGUF exports of the
edge LM) gives the fp32 ONNX reference's greedy outputs; the runtime guard serves it under the plain model id
when it is the fastest that agrees, shows the choice and every candidate's numbers in ``/v1/models``; a GGUF
file that is not the signed bytes is never loaded; the updater smoke-tests every weight file of a GGUF
artifact. Needs ``tierline[edge-gguf]`` (or ``make peers``); skipped, saying so, without it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from edge_agent import runtime_guard
from edge_agent.generation import LocalLM, LocalRequest
from edge_agent.model_store import ModelStore
from edge_agent.models import EDGE_LM, EDGE_LM_FP32, EDGE_LM_GGUF, ServedModels
from edge_agent.runtime import gguf
from edge_agent.runtime.lm import load_causal_lm
from edge_agent.updater import Updater
from shared.artifacts import load_public_key
from shared.errors import NotFoundError
from shared.zoo.corpus import held_out_files
from shared.zoo.registry import ZooLayout
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.integration.test_edge_updates import Cloud, cloud  # noqa: F401 - the module's cloud process fixture

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(gguf.missing_reason() is not None, reason=gguf.missing_reason() or ""),
]
NEW_TOKENS = 32


def _held_out_prompts(lm: LocalLM, n: int = 6, length: int = 48) -> list[list[int]]:
    prompts = []
    for f in held_out_files()[:n]:
        ids = lm.tokenizer.encode(f.text)[:length]
        if ids:
            prompts.append(ids)
    return prompts


def _greedy(lm: LocalLM, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return [s.token_id for s in lm.generate(LocalRequest(prompt, max_tokens=n, temperature=0.0, ignore_eos=True))]


def _served(data: Path, **kw: Any) -> ServedModels:
    keys = [load_public_key(data / "keys" / "artifact-signing.ed25519.pub")]
    return ServedModels(data / "zoo" / "tiny", ModelStore(data / "agent"), keys, 1, **kw)


def test_the_gguf_runtime_gives_the_onnx_reference_greedy_outputs(tiny_zoo: Path) -> None:
    layout = ZooLayout(tiny_zoo)
    onnx = LocalLM(layout.artifact_dir("lm-edge-onnx"))
    f32 = LocalLM(layout.artifact_dir("lm-edge-gguf"), variant="f32")
    q8 = LocalLM(layout.artifact_dir("lm-edge-gguf"), variant="q8_0")
    assert isinstance(f32.runtime, gguf.GgufCausalLM) and f32.runtime.format == "gguf-f32"
    assert q8.runtime.format == "gguf-q8_0" and f32.vocab_size == onnx.vocab_size
    prompts = _held_out_prompts(onnx)
    assert len(prompts) >= 4
    reference = [_greedy(onnx, p) for p in prompts]
    # The same weights in f32: token for token, through the agent's sampling loop (logits, not just argmax).
    assert [_greedy(f32, p) for p in prompts] == reference
    onnx.runtime.reset()
    f32.runtime.reset()
    a, b = onnx.runtime.prefill(prompts[0]), f32.runtime.prefill(prompts[0])
    assert a.shape == b.shape and float(np.abs(a - b).max()) < 1e-3
    a, b = onnx.runtime.decode(7), f32.runtime.decode(7)
    assert float(np.abs(a - b).max()) < 1e-3
    # Q8_0 is a different model: close, and the guard decides whether it is close enough.
    ref = onnx.runtime
    agreement = runtime_guard.agreement(q8.runtime, prompts, [ref.greedy(p, NEW_TOKENS) for p in prompts])
    assert agreement > 0.8


def test_a_structured_output_mask_and_logprobs_work_on_the_gguf_runtime(tiny_zoo: Path) -> None:
    lm = LocalLM(ZooLayout(tiny_zoo).artifact_dir("lm-edge-gguf"))
    prompt = lm.tokenizer.encode("def main():\n")
    steps = list(lm.generate(LocalRequest(prompt, max_tokens=6, temperature=0.0, logprobs=2)))
    assert len(steps) >= 1 and all(s.logprob is not None and s.signal is not None for s in steps)
    try:
        lm.check_grammar('start: "yes" | "no"')
    except Exception as exc:  # llguidance missing here: the 400 names it; nothing about GGUF to check
        pytest.skip(f"structured outputs unavailable: {exc}")
    req = LocalRequest(prompt, max_tokens=8, temperature=0.0, grammar='start: "yes" | "no"')
    text = "".join(s.delta_text for s in lm.generate(req))
    assert text in ("yes", "no")


@pytest.fixture
def data(tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> Path:
    return seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)


def test_the_agent_serves_gguf_under_the_plain_id_when_it_wins(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing is made to favour llama.cpp (its real figures depend on the host: see the HTTP test below for
    them); loading, the agreement check and serving are real."""
    timed: list[str] = []
    real = runtime_guard._time_once

    def favour_llamacpp(runtime: Any, prompt: list[int]) -> float:
        ms = real(runtime, prompt)
        timed.append(runtime.format)
        return ms / 100 if isinstance(runtime, gguf.GgufCausalLM) else ms

    monkeypatch.setattr(runtime_guard, "_time_once", favour_llamacpp)
    served = _served(data)
    choice = served.guards[EDGE_LM]
    assert {"gguf-q8_0", "gguf-f32", "onnx"} <= set(timed)
    assert choice.chosen is not None and choice.chosen.startswith("gguf-")
    measured = {c.format: c for c in choice.candidates}
    # Of the two weight files, the faster that gives the reference's greedy outputs (f32 always does).
    assert measured["gguf-f32"].agreement == 1.0 and measured["gguf-f32"].eligible
    ggufs = [measured[f] for f in ("gguf-q8_0", "gguf-f32") if measured[f].eligible]
    expect = min(ggufs, key=lambda c: c.ms_per_token or 0).format
    assert choice.chosen == expect
    assert served.aliases[EDGE_LM] == EDGE_LM_GGUF and served.served_format(EDGE_LM) == expect
    lm = served.lms.get(EDGE_LM)
    assert isinstance(lm.runtime, gguf.GgufCausalLM) and lm.runtime.format == expect
    reference = served.lms.get(EDGE_LM_FP32)
    for prompt in runtime_guard.CHECK_PROMPTS:  # the check prompts: the bound (1.0) says these never change
        ids = reference.tokenizer.encode(prompt)
        assert _greedy(lm, ids, runtime_guard.CHECK_TOKENS) == _greedy(reference, ids, runtime_guard.CHECK_TOKENS)
    report = served.serving()[EDGE_LM]
    assert report["chosen"] == expect
    assert {c["format"] for c in report["candidates"]} >= {"onnx", "onnx-int8", "gguf-q8_0", "gguf-f32"}


def test_a_tampered_gguf_file_is_never_loaded(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[Path] = []
    original_init = gguf.GgufCausalLM.__init__

    def spy(self: gguf.GgufCausalLM, model_dir: Path, variant: str | None = None, num_threads: int = 1) -> None:
        loads.append(model_dir)
        original_init(self, model_dir, variant, num_threads)

    monkeypatch.setattr(gguf.GgufCausalLM, "__init__", spy)
    q8 = data / "zoo" / "tiny" / "artifacts" / "lm-edge-gguf" / gguf.GGUF_FILES["q8_0"]
    pristine = q8.read_bytes()
    q8.write_bytes(pristine[:-1] + bytes([pristine[-1] ^ 1]))  # one bit: a valid-looking file, not the signed one
    served = _served(data)
    assert EDGE_LM_GGUF not in served.models and not served.lms.has(EDGE_LM_GGUF)
    measured = {c.format: c for c in served.guards[EDGE_LM].candidates}
    for fmt in ("gguf-q8_0", "gguf-f32"):  # the whole artifact is refused, and says so
        assert not measured[fmt].eligible and measured[fmt].ms_per_token is None
        assert (measured[fmt].reason or "").startswith("refused: ")
    assert served.served_format(EDGE_LM) != "gguf-q8_0" and loads == []

    # Verified at start-up, changed before it is loaded: refused at the load, never read by llama.cpp.
    q8.write_bytes(pristine)
    served = _served(data)
    assert served.lms.has(EDGE_LM_GGUF)
    loads.clear()
    q8.write_bytes(pristine[:-1] + bytes([pristine[-1] ^ 1]))
    served._guard(EDGE_LM, ("tierline/lm-edge-onnx", EDGE_LM_GGUF))  # the guard's own loads verify first
    measured = {c.format: c for c in served.guards[EDGE_LM].candidates}
    assert (measured["gguf-q8_0"].reason or "").startswith("cannot load: ") and not measured["gguf-q8_0"].eligible
    assert "sha256" in (measured["gguf-q8_0"].reason or "")
    assert served.guards[EDGE_LM].chosen != "gguf-q8_0" and loads == []
    with pytest.raises(NotFoundError, match="failed verification"):  # and so does serving's
        served.lms.get(EDGE_LM_GGUF)
    assert loads == [] and not served.lms.has(EDGE_LM_GGUF)
    served._guard(EDGE_LM, ("tierline/lm-edge-onnx", EDGE_LM_GGUF))  # refused for good: not even tried again
    measured = {c.format: c for c in served.guards[EDGE_LM].candidates}
    assert (measured["gguf-f32"].reason or "").startswith("refused: ") and loads == []


def test_the_updater_smoke_tests_every_weight_file_of_a_gguf_artifact(tiny_zoo: Path) -> None:
    from edge_agent.updater import RejectedError, _smoke_lm

    gguf_dir = ZooLayout(tiny_zoo).artifact_dir("lm-edge-gguf")
    onnx = load_causal_lm(ZooLayout(tiny_zoo).artifact_dir("lm-edge-onnx"))
    lm = LocalLM(gguf_dir, variant="f32")
    prompt = "def main():\n"
    golden = onnx.greedy(lm.tokenizer.encode(prompt), 6)
    _smoke_lm(gguf_dir, [{"prompt": prompt, "greedy_ids": golden}], 1)  # f32 reproduces it; Q8_0 must too
    wrong = [(golden[0] + 1) % onnx.vocab_size if onnx.vocab_size else 0, *golden[1:]]
    with pytest.raises(RejectedError, match="differs"):
        _smoke_lm(gguf_dir, [{"prompt": prompt, "greedy_ids": wrong}], 1)


# -- the agent process: /v1/models shows the choice and its numbers; the plain id answers as the reference -------
@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[str]:
    d = seed_data_dir(tmp_path_factory.mktemp("edge-gguf"), tiny_zoo, session_data_dir)
    env = base_env(d, TIERLINE_EDGE_ZOO_DIR=str(d / "zoo" / "tiny"), TIERLINE_EDGE_STATE_DIR=str(d / "agent"))
    with run_server(["edge", "run"], env, free_port()) as url:
        yield url


def test_v1_models_shows_the_runtime_choice_and_the_plain_id_answers_as_the_reference(edge: str) -> None:
    models = {m["id"]: m for m in httpx.get(f"{edge}/v1/models").json()["data"]}
    guard = models[EDGE_LM]["runtime_guard"]
    candidates = {c["format"]: c for c in guard["candidates"]}
    assert guard["reference"] == "onnx-fp32 (no reference.json)" and guard["min_agreement"] == 1.0
    for fmt, runtime in (("onnx", "onnxruntime"), ("gguf-q8_0", "llama.cpp"), ("gguf-f32", "llama.cpp")):
        c = candidates[fmt]
        assert c["runtime"] == runtime and c["ms_per_token"] > 0 and 0 <= c["agreement"] <= 1
    assert candidates["gguf-f32"]["agreement"] == 1.0 and candidates["gguf-f32"]["eligible"]
    fastest = min((c for c in guard["candidates"] if c["eligible"]), key=lambda c: c["ms_per_token"])
    assert guard["chosen"] == fastest["format"] == models[EDGE_LM]["format"]
    assert models[EDGE_LM_GGUF]["format"] == "gguf"
    for prompt in runtime_guard.CHECK_PROMPTS[:4]:  # where the bound (1.0) says the plain id never differs
        texts = []
        for model in (EDGE_LM, EDGE_LM_FP32):
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{edge}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.headers["x-tierline-tier"] == "edge", r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]


# -- the device receives the GGUF export as any edge artifact: published, downloaded, verified, smoke-tested -------
def test_a_published_gguf_export_reaches_the_device_and_joins_the_runtime_guard(
    cloud: Cloud,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    tiny_zoo: Path,
    session_data_dir: Path,
) -> None:
    cloud.publish("lm-edge-gguf", "g1")
    desired = cloud.desired("lm-edge-gguf")
    assert desired.manifest_url == "/v1/edge/artifacts/lm-edge-gguf/g1/manifest.json"
    events: list[str] = []
    store = ModelStore(tmp_path / "state")
    with httpx.Client(base_url=cloud.url, headers=cloud.auth()) as client:
        updater = Updater(
            client, store, tmp_path / "state" / "staging", cloud.keys, 50 << 20, lambda kind, _: events.append(kind)
        )
        assert updater.apply(desired) == "installed"
    assert events == ["update.downloaded", "update.smoke_tested", "update.activated"]
    installed = store.current_dir("lm-edge-gguf")
    assert installed is not None and sorted(gguf.variants(installed)) == ["f32", "q8_0"]

    # A device whose own zoo has no GGUF export: the installed one joins the guard's candidates.
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    zoo = data / "zoo" / "tiny"
    shutil.rmtree(zoo / "artifacts" / "lm-edge-gguf")
    (zoo / "manifests" / "lm-edge-gguf.json").unlink()
    keys = [load_public_key(data / "keys" / "artifact-signing.ed25519.pub")]
    served = ServedModels(zoo, store, keys, 1)
    assert served.models[EDGE_LM_GGUF].source == "store" and served.models[EDGE_LM_GGUF].version == "g1"
    measured = {c.format: c for c in served.guards[EDGE_LM].candidates}
    assert measured["gguf-f32"].agreement == 1.0 and (measured["gguf-q8_0"].ms_per_token or 0) > 0


def test_the_registry_derives_a_gguf_artifact_a_device_can_run(tmp_path: Path, tiny_zoo: Path) -> None:
    """A cloud checkpoint pushed to the registry derives (``--gguf``) a signed GGUF artifact, exported laid out
    like the zoo's (``tierline cloud publish`` offers it to devices as ``lm-edge-gguf``), which the device's
    runtime loads and which gives the ONNX reference's greedy outputs."""
    from click.testing import CliRunner

    from controlplane.registry.cli import models
    from shared.artifacts import read_manifest, verify_files, verify_signature
    from tests.conftest import migrated_sqlite

    data = tmp_path / "data"
    env = base_env(data, TIERLINE_DATABASE_URL=migrated_sqlite(data), TIERLINE_REGISTRY_DERIVE_TFLITE="false")
    runner = CliRunner()
    ckpt = ZooLayout(tiny_zoo).artifact_dir("lm-edge")
    pushed = runner.invoke(models, ["push", str(ckpt), "--name", "lm-edge-gguf"], env=env)
    assert pushed.exit_code == 0, pushed.output
    derived = runner.invoke(models, ["derive", "lm-edge-gguf", "1", "--gguf"], env=env)
    assert derived.exit_code == 0, derived.output
    assert "gguf ready" in derived.stdout
    out = tmp_path / "export"
    exported = runner.invoke(models, ["export", "lm-edge-gguf", "2", "--format", "gguf", "--out", str(out)], env=env)
    assert exported.exit_code == 0, exported.output
    files = out / "artifacts" / "lm-edge-gguf"
    manifest = read_manifest(out / "manifests" / "lm-edge-gguf.json")
    verify_signature(manifest, [load_public_key(data / "keys" / "artifact-signing.ed25519.pub")])
    verify_files(manifest, files)
    assert manifest.format == "gguf" and sorted(gguf.variants(files)) == ["f32", "q8_0"]
    onnx = load_causal_lm(ZooLayout(tiny_zoo).artifact_dir("lm-edge-onnx"))
    runtime = gguf.GgufCausalLM(files, "f32")
    prompt = LocalLM(files, variant="f32").tokenizer.encode("def main():\n")
    assert runtime.greedy(prompt, 16) == onnx.greedy(prompt, 16)
