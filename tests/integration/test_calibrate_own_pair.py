"""``tierline policies calibrate`` on a team's own edge/cloud pair: two random-init registry models of different
architectures (a Llama edge, a Qwen2 cloud), a dozen prompts in a JSONL file (completion text and chats, with and
without a reference answer) -> a signed policy version that ``tierline policies list`` shows and devices get."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlmodel import Session

from controlplane.policies import service
from controlplane.policies.prompt_validation import EDGE_FORMATS, find_artifact, is_match, normalize_answer
from controlplane.storage.database import create_db
from controlplane.storage.session import get_db
from controlplane.storage.tables import Device, Tenant
from shared.artifacts import load_or_create_signing_key
from shared.escalation import LM_SIGNALS
from shared.policy_signing import verify_policy

pytestmark = pytest.mark.integration

EDGE = "acme-edge"
CLOUD = "acme-cloud"
MAX_NEW_TOKENS = 6
NONSENSE = "zebra quantum marmalade"


def make_checkpoint(out: Path, architecture: str, seed: int) -> Path:
    """A tiny random-init checkpoint (hidden 64, 2 layers) with the zoo's tokenizer (ChatML in its config)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from shared.zoo.tokenizer import BOS_EOS_TOKEN, save_tokenizer, train_tokenizer

    tok = train_tokenizer([inspect.getsource(json)] * 2, 300)
    save_tokenizer(tok, out, 256)
    eos = tok.token_to_id(BOS_EOS_TOKEN)
    shape: dict[str, Any] = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": True,
    }
    torch.manual_seed(seed)
    model = (
        LlamaForCausalLM(LlamaConfig(**shape)) if architecture == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape))
    )
    model.save_pretrained(out)
    return out


def greedy_text(model_dir: Path, prompt: str) -> str:
    """transformers' own greedy answer (the oracle the cloud tier must reproduce)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def test_a_device_is_told_where_prompts_are_calibrated(tmp_path: Path) -> None:
    from edge_agent.calibrate import calibrate_command

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "reference": "x"}) + "\n" for i in range(12)))
    out = CliRunner().invoke(calibrate_command, ["--model", EDGE, "--data", str(prompts), "--out-dir", str(tmp_path)])
    assert out.exit_code == 1 and "tierline policies calibrate --model EDGE --data FILE" in out.output


def test_answers_are_graded_on_normalised_text() -> None:
    assert normalize_answer("  The  Answer: PARIS. ") == "the answer: paris"
    assert is_match("Paris.", "paris") and is_match("Paris, of course", "Paris")
    assert not is_match("Parisian", "Paris") and not is_match("London", "Paris")
    assert is_match("", "") and not is_match("x", "")


def test_a_teams_own_pair_is_calibrated_from_its_prompts(
    migrated_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.policies.cli import policies
    from controlplane.registry.cli import models

    data_dir = tmp_path / "data"
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(data_dir))
    monkeypatch.setenv("TIERLINE_DATABASE_URL", migrated_db)
    edge_dir = make_checkpoint(tmp_path / "edge", "llama", seed=1)
    cloud_dir = make_checkpoint(tmp_path / "cloud", "qwen2", seed=2)
    runner = CliRunner()
    for path, name in ((edge_dir, EDGE), (cloud_dir, CLOUD)):
        pushed = runner.invoke(models, ["push", str(path), "--name", name])
        assert pushed.exit_code == 0, pushed.output
    # The edge answers on what devices run: its derived ONNX export, through the device runtime.
    derived = runner.invoke(models, ["derive", EDGE, "1", "--no-tflite", "--no-gguf"])
    assert derived.exit_code == 0, derived.output
    engine = create_db(migrated_db)
    with Session(engine) as session:
        assert find_artifact(session, EDGE, edge=True).format in EDGE_FORMATS
        assert find_artifact(session, CLOUD, edge=False).format == "hf-safetensors"
    engine.dispose()

    known = "def dumps(obj"
    cloud_answer = greedy_text(cloud_dir, known)
    assert normalize_answer(cloud_answer)  # a random model still says something in 6 tokens
    prompts = [
        {"prompt": known, "reference": cloud_answer},  # the cloud gives the reference: right
        {"prompt": "import json\n", "reference": NONSENSE},  # no tier says that: both wrong
        {"prompt": "class JSONEncoder("},  # no reference: graded by the cloud's answer
        {"messages": [{"role": "user", "content": "What does json.loads return?"}], "reference": "a dict"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a JSON type."}]},
        *({"prompt": f"def f{i}(x):\n    return", "reference": " x"} for i in range(7)),
    ]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))

    # No cloud model named and no pairing: a clear error, nothing stored.
    unpaired = runner.invoke(policies, ["calibrate", "--model", EDGE, "--data", str(prompts_file)])
    assert unpaired.exit_code != 0 and "--cloud-model" in str(unpaired.exception)

    args = ["calibrate", "--model", EDGE, "--data", str(prompts_file), "--cloud-model", CLOUD]
    out = runner.invoke(policies, [*args, "--max-new-tokens", str(MAX_NEW_TOKENS)])
    assert out.exit_code == 0, f"{out.output}{out.exception!r}"
    assert out.output.startswith(f"{EDGE} v1: ") and "on its 12 validation items" in out.output

    listed = json.loads(runner.invoke(policies, ["list", "--json"]).output)
    assert [(p["model"], p["version"], p["data_items"]) for p in listed] == [(EDGE, 1, 12)]
    assert "acme-edge v1" in runner.invoke(policies, ["list"]).output

    # The kept validation set: one row per prompt, the device's LM signals, graded as the file says.
    rows = [json.loads(line) for line in service.validation_path(EDGE, data_dir).read_text().splitlines()]
    assert len(rows) == 12 and {r["model"] for r in rows} == {EDGE}
    assert all(set(LM_SIGNALS) <= set(r["signals"]) for r in rows)
    assert rows[0]["cloud_good"] is True
    assert rows[1]["cloud_good"] is False and rows[1]["edge_good"] is False
    assert rows[2]["cloud_good"] is True and rows[2]["edge_good"] == rows[2]["agrees_with_cloud"]
    assert rows[4]["cloud_good"] is True

    # Shipped as for the zoo: a version signed with the platform key, delivered to a device at sync.
    engine = create_db(migrated_db)
    with Session(engine) as session:
        tenant = Tenant(name="acme")
        session.add(tenant)
        session.flush()
        assert tenant.id is not None
        device = Device(id="dev-1", tenant_id=tenant.id, labels={}, token_hash="h", runtime={})
        session.add(device)
        session.flush()
        (desired,) = service.desired_for(session, device)
    engine.dispose()
    key = load_or_create_signing_key(data_dir / "keys" / "artifact-signing.ed25519")
    assert (desired.model, desired.version) == (EDGE, 1)
    verify_policy(
        [key.public_key()],
        desired.model,
        desired.version,
        desired.target,
        desired.policy,
        desired.key_id,
        desired.signature,
    )
    assert desired.policy["model"] == EDGE and desired.policy["calibration"]["num_items"] == 12

    # An answer that cannot fit the context is refused naming the prompt, before any version is made.
    long = runner.invoke(policies, [*args, "--max-new-tokens", "512"])
    assert long.exit_code != 0 and "prompt 1: " in str(long.exception) and "context of 256" in str(long.exception)

    # Recalibrating needs no file (the rows are kept); a pairing in the registry replaces --cloud-model.
    again = runner.invoke(policies, ["calibrate", "--model", EDGE, "--max-quality-loss", "0.2"])
    assert again.exit_code == 0 and f"{EDGE} v2:" in again.output, again.output
    paired = runner.invoke(models, ["pair", EDGE, CLOUD])
    if paired.exit_code == 0:  # `tierline models pair` is being added to the registry
        out = runner.invoke(policies, ["calibrate", "--model", EDGE, "--data", str(prompts_file)])
        assert out.exit_code == 0 and f"{EDGE} v3:" in out.output, f"{out.output}{out.exception!r}"
    get_db().dispose()


@pytest.mark.parametrize("architecture", ["gpt2", "llama-untied"])
def test_the_probe_projection_reads_any_layouts_output_embedding(tmp_path: Path, architecture: str) -> None:
    """``tierline edge calibrate --model-dir``: pinv of the output embedding, whatever the checkpoint calls it."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from shared.calibration import tied_embedding_projection

    torch.manual_seed(0)
    model: Any
    if architecture == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4))
    else:
        config = LlamaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    head = model.get_output_embeddings().weight.detach().numpy().astype(np.float64)
    np.testing.assert_allclose(tied_embedding_projection(tmp_path), np.linalg.pinv(head), rtol=1e-6, atol=1e-9)


def test_bad_prompt_files_are_refused_naming_the_line(
    migrated_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.policies.cli import policies

    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TIERLINE_DATABASE_URL", migrated_db)
    runner = CliRunner()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "messages": []}) + "\n")
    out = runner.invoke(policies, ["calibrate", "--model", EDGE, "--data", str(bad), "--cloud-model", CLOUD])
    assert out.exit_code != 0 and f"{bad}:2: give exactly one of 'prompt'" in str(out.exception)
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"prompt": "a", "reference": "b"}) + "\n")
    out = runner.invoke(policies, ["calibrate", "--model", EDGE, "--data", str(few), "--cloud-model", CLOUD])
    assert out.exit_code != 0 and "only 1 prompts; calibration needs 10" in str(out.exception)
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(12)))
    out = runner.invoke(policies, ["calibrate", "--model", "nobody", "--data", str(many), "--cloud-model", CLOUD])
    assert out.exit_code != 0 and "no registry model named 'nobody'" in str(out.exception)
    get_db().dispose()
