"""Prompt logprobs on ``/v1/completions`` (issue 41): ``echo`` with ``logprobs``, ``max_tokens: 0`` and vLLM's
``prompt_logprobs``, on a real cloud and on ``tierline engine serve``, checked against the checkpoint's own logits
(transformers, fp32) at every prompt position; and lm-evaluation-harness ``local-completions`` scoring a local
multiple-choice task from them.

Before the fix the echoed ``logprobs`` held only the generated token (``tokens == ["\\n"]``, ``text_offset ==
[0]``): lm-eval's ``token_logprobs[ctxlen:-1]`` was empty, every choice scored 0.0 and the first choice won."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shared.chat_tokenizer import ChatTokenizer
from shared.zoo.registry import ZooLayout
from tests.conftest import (
    base_env,
    free_port,
    migrated_sqlite,
    run_server,
    seed_data_dir,
    server_process,
)
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-cloud"
KEY = "sk-engine-test"
# Longer than a step's token budget below: the prompt's prefill runs in chunks, and its logprobs are gathered across.
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def lm_dir(tiny_zoo: Path) -> Path:
    return ZooLayout(tiny_zoo).artifact_dir("lm-cloud")


@pytest.fixture(scope="module")
def tokenizer(lm_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(lm_dir)


@pytest.fixture(scope="module")
def reference(lm_dir: Path) -> Any:
    """log_softmax of the checkpoint's logits at every position (transformers, fp32): [len(ids), V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, str]]:
    data = seed_data_dir(tmp_path_factory.mktemp("prompt-logprobs"), tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_MAX_NUM_BATCHED_TOKENS="16",
        TIERLINE_CLOUD_MAX_NUM_SEQS="8",
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env, check=True)
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    key = cli("keys", "create", "--tenant", "acme")
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        yield {"url": url, "key": key}


@pytest.fixture(scope="module")
def engine_server(lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    port = free_port()
    data = tmp_path_factory.mktemp("engine-server-prompt-logprobs")
    key_file = data / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    env = base_env(data, TIERLINE_CLOUD_KV_CACHE_MB="32", TIERLINE_CLOUD_MAX_NUM_BATCHED_TOKENS="16")
    args = ["engine", "serve", "--model", str(lm_dir), "--api-key-file", str(key_file)]
    with server_process(args, env, port, ready_path="/health", timeout=180):
        yield {"url": f"http://127.0.0.1:{port}", "key": KEY}


@pytest.fixture(params=["cloud", "engine_server"])
def server(request: pytest.FixtureRequest) -> dict[str, str]:
    found: dict[str, str] = request.getfixturevalue(request.param)
    if request.param == "cloud":
        return {**found, "model": MODEL}
    models = httpx.get(f"{found['url']}/v1/models", headers={"Authorization": f"Bearer {found['key']}"})
    return {**found, "model": str(models.json()["data"][0]["id"])}


def complete(server: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(
        f"{server['url']}/v1/completions",
        json={"model": server["model"], **body},
        headers={"Authorization": f"Bearer {server['key']}"},
        timeout=60,
    )


def check_echoed(choice: dict[str, Any], ids: list[int], ref: torch.Tensor, tokenizer: ChatTokenizer) -> None:
    """The echoed logprobs: the prompt's tokens first (the first with null), each equal to the reference."""
    lp = choice["logprobs"]
    n = len(ids)
    assert lp["tokens"][:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert abs(lp["token_logprobs"][p] - float(ref[p - 1, ids[p]])) < TOLERANCE, p
        top = lp["top_logprobs"][p]
        assert lp["tokens"][p] in top  # the prompt token is always among its alternatives
        best = int(torch.argmax(ref[p - 1]))
        assert abs(top[tokenizer.decode([best], skip_special_tokens=False)] - float(ref[p - 1, best])) < TOLERANCE
    # text_offset: where each token's text starts in the returned (echoed) text
    text = choice["text"]
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_echo_with_logprobs_returns_the_prompt_tokens_logprobs(
    server: dict[str, str], tokenizer: ChatTokenizer, reference: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    ref = reference(ids)
    r = complete(server, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 1  # the prompt's tokens, then the generated one
    assert choice["text"].startswith(PROMPT)
    check_echoed(choice, ids, ref, tokenizer)
    generated = choice["logprobs"]["token_logprobs"][-1]  # the generated token's, from the last prompt position
    assert abs(generated - float(ref[-1].max())) < TOLERANCE  # greedy: the argmax
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and r.json()["usage"]["completion_tokens"] == 1


def test_max_tokens_0_with_echo_returns_the_prompt_only(
    server: dict[str, str], tokenizer: ChatTokenizer, reference: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    r = complete(server, prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and len(choice["logprobs"]["tokens"]) == len(ids)
    check_echoed(choice, ids, reference(ids), tokenizer)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    # Without echo there is nothing to return: a 400 naming max_tokens, as vLLM refuses it.
    refused = complete(server, prompt=PROMPT, max_tokens=0)
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_prompt_logprobs_field_in_vllm_shape(server: dict[str, str], tokenizer: ChatTokenizer, reference: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    ref = reference(ids)
    r = complete(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=3, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = entries[p]
        own = entry[str(ids[p])]
        assert abs(own["logprob"] - float(ref[p - 1, ids[p]])) < TOLERANCE
        assert own["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        top = torch.topk(ref[p - 1], 3).indices.tolist()
        assert all(str(t) in entry for t in top) and len(entry) in (3, 4)
    streamed = complete(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=1, stream=True)
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["error"]["message"]


def test_a_prefix_cached_prompt_gives_the_numbers_of_a_cold_one(
    server: dict[str, str], tokenizer: ChatTokenizer, reference: Any
) -> None:
    prompt = PROMPT + "main(sys.argv)\n"
    ids = tokenizer.encode(prompt)
    warm = complete(server, prompt=prompt, max_tokens=1, temperature=0)  # fills the prefix cache
    assert warm.status_code == 200
    again = complete(server, prompt=prompt, max_tokens=1, temperature=0)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache does hold it
    r = complete(server, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert r.status_code == 200
    check_echoed(r.json()["choices"][0], ids, reference(ids), tokenizer)


def test_a_batch_of_prompts_each_gets_its_own(server: dict[str, str], tokenizer: ChatTokenizer, reference: Any) -> None:
    prompts = [PROMPT, "x = 1\ny = 2\n", "hello world"]
    r = complete(server, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for prompt, choice in zip(prompts, choices, strict=True):
        ids = tokenizer.encode(prompt)
        check_echoed(choice, ids, reference(ids), tokenizer)


# -- lm-evaluation-harness ----------------------------------------------------------------------------------------
QUESTIONS = [
    {"question": "import os\nimport", "choices": [" sys", " banana", " os"], "gold": 1},
    {"question": "def main(argv):\n    for arg in", "choices": [" argv", " zebra"], "gold": 1},
    {"question": "x = 1\ny =", "choices": [" 2", " purple", " x"], "gold": 2},
]


def test_lm_eval_local_completions_scores_equal_the_model_logits(
    cloud: dict[str, str],
    lm_dir: Path,
    tokenizer: ChatTokenizer,
    reference: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lm-eval's loglikelihoods (from echoed prompt logprobs) equal the checkpoint's own, choice by choice: with
    today's generated-only lists every choice scored 0.0 and the first (here never the gold one) won."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        "task: tierline_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'target_delimiter: ""\n'
        "doc_to_choice: choices\n"
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n"
    )
    monkeypatch.setenv("OPENAI_API_KEY", cloud["key"])  # what local-completions sends as its bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is the local file: never the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL},base_url={cloud['url']}/v1/completions,tokenizer={lm_dir},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
        ),
        tasks=["tierline_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    assert results is not None
    samples = results["samples"]["tierline_tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        context = tokenizer.encode(doc["question"])
        scores = []
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            whole = tokenizer.encode(doc["question"] + choice)
            assert whole[: len(context)] == context  # the choices tokenize after the context as in lm-eval
            ref = reference(whole)
            want = sum(float(ref[p - 1, whole[p]]) for p in range(len(context), len(whole)))
            got = resp[0][0]
            assert math.isclose(got, want, abs_tol=1e-3), (doc["question"], choice, got, want)
            assert got < 0.0
            scores.append(want)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["gold"])
    assert results["results"]["tierline_tiny_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
