"""llama.cpp as a real third-party peer on the zoo's GGUF exports: its greedy outputs are tierline's engine's, token
for token, and llama-cpp-python's OpenAI-compatible server serves a model behind ``tierline cloud serve`` (an
``openai`` backend), billed once per request. Needs ``tierline[peers]`` (``make peers``); skipped, saying so,
without it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy import create_engine
from sqlmodel import Session, col, select

from bench.llama_server import BUILD_HINT
from bench.llama_server import missing_reason as llama_server_missing
from bench.llamacpp import missing_reason
from cloud.engine.llm import LLM
from cloud.engine.sampling_params import SamplingParams
from controlplane.storage.tables import UsageRecord
from shared.artifacts import load_public_key, public_path, read_manifest, verify_files, verify_signature
from shared.zoo.corpus import held_out_files
from shared.zoo.export_gguf import GGUF_F32, GGUF_Q8_0
from shared.zoo.registry import ZooLayout
from tests.conftest import REPO, base_env, free_port, migrated_sqlite, seed_data_dir, server_process
from tests.forkserver import run_tierline

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or ""),
]
MODEL = "llamacpp-lm"
NUM_PROMPTS = 8
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def lm_dir(tiny_zoo: Path) -> Path:
    return ZooLayout(tiny_zoo).artifact_dir("lm-cloud")


@pytest.fixture(scope="module")
def offline(lm_dir: Path) -> LLM:
    return LLM(lm_dir, kv_cache_bytes=32 << 20)


@pytest.fixture(scope="module")
def prompts(offline: LLM) -> list[list[int]]:
    """Token-id prompts of 20 to 90 held-out tokens."""
    ids: list[int] = []
    for f in held_out_files()[:4]:
        ids.extend(offline.tokenizer.encode(f.text))
    return [ids[i * 97 : i * 97 + 20 + 10 * i] for i in range(NUM_PROMPTS)]


def test_the_gguf_exports_are_signed_zoo_artifacts(tiny_zoo: Path, session_data_dir: Path) -> None:
    layout = ZooLayout(tiny_zoo)
    key = load_public_key(public_path(session_data_dir / "keys" / "artifact-signing.ed25519"))
    for lm in ("lm-cloud", "lm-edge"):
        manifest = read_manifest(layout.manifest_path(f"{lm}-gguf"))
        verify_signature(manifest, [key])
        verify_files(manifest, layout.artifact_dir(f"{lm}-gguf"))
        assert manifest.format == "gguf" and manifest.derived_from is not None
        assert manifest.derived_from == {"name": lm, "sha256": layout.manifest(lm).sha256}
        assert {GGUF_F32, GGUF_Q8_0} <= {e.path for e in manifest.files}
        f32, q8 = (layout.artifact_dir(f"{lm}-gguf") / n for n in (GGUF_F32, GGUF_Q8_0))
        assert q8.stat().st_size < f32.stat().st_size / 2  # 8-bit weights (norms stay f32)


def test_llamacpp_greedy_is_the_engines_token_for_token_at_f32(
    tiny_zoo: Path, offline: LLM, prompts: list[list[int]]
) -> None:
    """The same token-id prompts, greedy: llama.cpp on the f32 GGUF gives the engine's ids on every prompt, one
    request at a time and all at once in slots (the way llama-server batches)."""
    from bench.llamacpp import LlamaCppBatch, gguf_path

    expected = [
        list(o.token_ids)
        for o in offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ]
    work = [(p, NEW_TOKENS) for p in prompts]
    one = LlamaCppBatch(gguf_path(tiny_zoo, "lm-cloud", "f32"), slots=1, max_len=256, threads=1)
    many = LlamaCppBatch(gguf_path(tiny_zoo, "lm-cloud", "f32"), slots=NUM_PROMPTS, max_len=256, threads=1)
    try:
        alone = [one.generate([w])[0] for w in work]
        batched = many.generate(work)
    finally:
        one.close()
        many.close()
    assert sum(a == e for a, e in zip(alone, expected, strict=True)) == NUM_PROMPTS, (alone, expected)
    assert batched == alone


def test_llamacpp_f32_logits_are_transformers_at_every_prompt_position(
    tiny_zoo: Path, lm_dir: Path, prompts: list[list[int]]
) -> None:
    """The tiny LMs barely trained, so their greedy continuations repeat a token; the logits at every position
    of held-out prompts are the sharper check that the export (RoPE permutation, GQA, norms, tied embeddings)
    computes what the checkpoint does."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.llamacpp import LlamaCppBatch, gguf_path

    for lm in ("lm-cloud", "lm-edge"):
        model = AutoModelForCausalLM.from_pretrained(ZooLayout(tiny_zoo).artifact_dir(lm), dtype=torch.float32)
        peer = LlamaCppBatch(gguf_path(tiny_zoo, lm, "f32"), slots=1, max_len=256, threads=1)
        try:
            for prompt in prompts:
                with torch.inference_mode():
                    want = model(torch.tensor([prompt])).logits[0].numpy()
                got = peer.prompt_logits(prompt)
                assert got.shape == want.shape
                assert float(np.abs(got - want).max()) < 1e-3 * max(1.0, float(np.abs(want).max())), lm
                assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.99, lm
        finally:
            peer.close()


Q8_SCRIPT = """
import json, sys
from pathlib import Path
from bench.llamacpp import LlamaCppBatch
prompts = json.loads(sys.stdin.read())
out = {}
for path in sys.argv[1:]:
    peer = LlamaCppBatch(Path(path), slots=len(prompts), max_len=256, threads=1)
    out[path] = peer.generate([(p, 4) for p in prompts])
    peer.close()
print(json.dumps(out))
"""


def test_the_q8_0_export_runs_and_mostly_agrees_with_f32(tiny_zoo: Path, prompts: list[list[int]]) -> None:
    """In a child process, so that a crash in llama.cpp's kernels (its AMX Q8_0 path segfaults on these small
    matrices: `make peers` builds without it) fails this test and not the whole session."""
    from bench.llamacpp import gguf_path

    paths = [str(gguf_path(tiny_zoo, "lm-edge", kind)) for kind in ("f32", "q8_0")]
    proc = subprocess.run(
        [sys.executable, "-c", Q8_SCRIPT, *paths],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    f32, q8 = runs[paths[0]], runs[paths[1]]
    assert all(len(o) == 4 for o in q8)
    same = sum(a[0] == b[0] for a, b in zip(f32, q8, strict=True))  # the first greedy token of each prompt
    assert same >= NUM_PROMPTS // 2, (f32, q8)


def _usage_rows(db_url: str, ids: list[str], timeout: float = 10.0) -> list[UsageRecord]:
    engine = create_engine(db_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            with Session(engine) as s:
                rows = list(s.exec(select(UsageRecord).where(col(UsageRecord.model) == MODEL)))
            if len(rows) >= len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path, lm_dir: Path
) -> Iterator[dict[str, Any]]:
    """llama-cpp-python's server on the tiny lm-cloud's f32 GGUF (requiring a key), behind a real gateway."""
    from bench.llamacpp import gguf_path, llamacpp_server

    data = seed_data_dir(tmp_path_factory.mktemp("llamacpp"), tiny_zoo, session_data_dir)
    key_file = data / "upstream.key"
    key_file.write_text("sk-llamacpp-secret\n")
    key_file.chmod(0o600)
    port = free_port()
    backends = data / "backends.json"
    spec = {
        "type": "openai",
        "endpoints": [f"http://127.0.0.1:{port}"],
        "upstream_model": "lm-cloud",
        "tokenizer": str(lm_dir),
        "api_key_file": str(key_file),
        "max_concurrency": 4,
        "health_path": "/v1/models",
    }
    backends.write_text(json.dumps({"models": {MODEL: spec}}))
    db_url = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="none",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_BACKENDS=str(backends),
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env, check=True)
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    key = cli("keys", "create", "--tenant", "acme")
    model = gguf_path(tiny_zoo, "lm-cloud", "f32")
    with llamacpp_server(
        model, port, alias="lm-cloud", n_ctx=256, api_key="sk-llamacpp-secret", log=data / "llamacpp.log"
    ):
        gw_port = free_port()
        with server_process(["cloud", "serve"], env, gw_port, timeout=180, log=data / "gateway.log"):
            yield {"url": f"http://127.0.0.1:{gw_port}", "key": key, "db": db_url}


def test_llamacpp_server_behind_the_gateway_streams_and_bills_each_request_once(
    gateway: dict[str, Any], offline: LLM
) -> None:
    client = openai.OpenAI(base_url=f"{gateway['url']}/v1", api_key=gateway["key"], max_retries=0)
    assert MODEL in [m.id for m in client.models.list()]
    prompt = "def parse_args(argv):\n    "
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    usage_ids: list[str] = []

    # non-streaming: llama.cpp reports usage, the gateway bills from it
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    answer = raw.parse()
    usage_ids.append(raw.headers["x-tierline-usage-id"])
    assert answer.model == MODEL and answer.choices[0].text == expected.text
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a function."}]
    chat_raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    chat = chat_raw.parse()
    usage_ids.append(chat_raw.headers["x-tierline-usage-id"])
    chat_prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat.model == MODEL and chat.usage is not None and 1 <= chat.usage.completion_tokens <= 6
    assert chat.usage.prompt_tokens == len(offline.tokenizer.encode(chat_prompt))  # llama.cpp applied the same template

    # streaming: llama-cpp-python sends no usage in streams (it ignores stream_options), so the gateway counts
    # with the model's tokenizer, tells the client, and its usage record says so
    stream_raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage_ids.append(stream_raw.headers["x-tierline-usage-id"])
    chunks = list(stream_raw.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        len(expected.prompt_token_ids),
        len(offline.tokenizer.encode(expected.text)),
    )
    chat_stream_raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    usage_ids.append(chat_stream_raw.headers["x-tierline-usage-id"])
    chat_stream = chat_stream_raw.parse()
    assert isinstance(chat_stream, openai.Stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert streamed == chat.choices[0].message.content

    rows = {r.id: r for r in _usage_rows(gateway["db"], usage_ids)}
    assert sorted(rows) == sorted(usage_ids), "one usage record per request, each once"
    sources = [rows[i].usage_source for i in usage_ids]
    assert sources == ["upstream", "upstream", "gateway", "gateway"]
    assert all(rows[i].status == "ok" for i in usage_ids)
    assert (rows[usage_ids[0]].prompt_tokens, rows[usage_ids[0]].completion_tokens) == (
        len(expected.prompt_token_ids),
        12,
    )
    assert rows[usage_ids[2]].completion_tokens == len(offline.tokenizer.encode(expected.text))


def test_bench_engine_vs_llamacpp_reports_rates_ratios_and_identical_outputs(tiny_zoo: Path) -> None:
    from bench.engine_bench import bench_engine_vs_llamacpp

    result = bench_engine_vs_llamacpp(
        tiny_zoo, num_requests=6, max_num_seqs=6, rounds=2, batch1_requests=2, http_levels=None
    )
    assert "llama_server" not in result
    concurrent, batch1 = result["concurrent"], result["batch1"]
    assert concurrent["outputs_identical_f32"] == "6/6" and batch1["outputs_identical_f32"] == "2/2"
    assert len(concurrent["tierline_tokens_per_s_runs"]) == len(concurrent["llamacpp_f32_tokens_per_s_runs"]) == 2
    for part in (concurrent, batch1):
        assert part["tierline_tokens_per_s"] > 0 and part["llamacpp_f32_tokens_per_s"] > 0
        assert part["ratio_vs_llamacpp_f32"] > 0
    assert batch1["llamacpp_q8_0_tokens_per_s"] > 0
    # The engine with int8 weights beside Q8_0, over the same requests in the same rounds.
    assert batch1["tierline_int8_tokens_per_s"] > 0 and len(batch1["tierline_int8_tokens_per_s_runs"]) == 2
    assert batch1["int8_ratio_vs_llamacpp_q8_0"] > 0 and batch1["int8_ratio_vs_tierline_fp32"] > 0
    assert batch1["outputs_identical_int8_vs_fp32"].endswith("/2")


@pytest.mark.skipif(llama_server_missing() is not None, reason=llama_server_missing() or "")
def test_bench_engine_vs_llamacpp_runs_llama_server_against_engine_serve_over_http(tiny_zoo: Path) -> None:
    """``bench engine --vs llamacpp``'s HTTP part: llama-server (``make llama-server``) with a slot per concurrent
    request and ``tierline engine serve``, the same token-id prompts, greedy; the same texts from both."""
    from bench.engine_bench import bench_engine_vs_llamacpp

    result = bench_engine_vs_llamacpp(
        tiny_zoo, num_requests=4, max_num_seqs=4, rounds=1, batch1_requests=2, http_levels=(1, 3), http_tokens=16
    )
    http = result["llama_server"]
    assert http["llama_server_version"].startswith("version: ")
    assert set(http["llama_server_commands"]) == {"1", "3"}
    command = http["llama_server_commands"]["3"]
    assert "--parallel 3" in command and "model-f32.gguf" in command
    assert "tierline engine serve" in http["tierline_command"] and http["new_tokens"] == 16
    for key, requests in (("at_1", 2), ("at_3_concurrent", 3)):
        level = http[key]
        assert level["outputs_identical"] == f"{requests}/{requests}"
        assert level["generated_tokens"] == 16 * requests
        assert len(level["tierline_tokens_per_s_runs"]) == len(level["llama_server_tokens_per_s_runs"]) == 1
        assert level["tierline_tokens_per_s"] > 0 and level["llama_server_tokens_per_s"] > 0
        assert level["ratio_vs_llama_server"] > 0


def test_bench_engine_vs_llamacpp_says_why_llama_server_was_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.engine_bench import bench_http_vs_llama_server

    monkeypatch.setenv("TIERLINE_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    result = bench_http_vs_llama_server(tmp_path, [[1, 2, 3]], levels=(1,), num_tokens=4)
    assert result == {"skipped": f"llama-server is not built at {tmp_path / 'no-such-llama-server'}: {BUILD_HINT}"}
    assert "make llama-server" in BUILD_HINT


def test_bench_edge_puts_llamacpp_in_the_same_rounds(tiny_zoo: Path) -> None:
    from bench.edge_bench import _best_rates, _held_out_ids, _llamacpp_runs, _vs_llamacpp
    from edge_agent.runtime.lm import load_causal_lm

    layout = ZooLayout(tiny_zoo)
    runtimes = {
        k: load_causal_lm(layout.artifact_dir(d), 1)
        for k, d in (("fp32", "lm-edge-onnx"), ("int8", "lm-edge-onnx-int8"))
    }
    prompt, _ = _held_out_ids(layout)
    runs: dict[str, Callable[[], list[int]]] = {name: partial(rt.greedy, prompt, 24) for name, rt in runtimes.items()}
    peer_runs, peers = _llamacpp_runs(tiny_zoo, prompt, 24, 1, runtimes["fp32"].max_context)
    runs.update(peer_runs)
    rates, tokens = _best_rates(runs, 24, 2)
    for peer in peers:
        peer.close()
    report = _vs_llamacpp(rates, tokens)
    assert report["llamacpp_f32_outputs_identical_to_fp32"] is True
    assert report["llamacpp_f32_tokens_per_s"] > 0 and report["llamacpp_q8_0_tokens_per_s"] > 0
    assert report["int8_vs_llamacpp_q8_0"] > 0


def test_bench_engine_shape_runs_each_contender_apart_with_identical_f32_outputs(tmp_path: Path) -> None:
    """``tierline bench engine --vs llamacpp --shape``: a random checkpoint in a published configuration (here the
    few-MB Qwen2 stand-in), converted by llama.cpp's converter, each contender in its own process."""
    from shared.zoo.export_gguf import find_converter

    if find_converter() is None:
        pytest.skip("llama.cpp's converter is not unpacked here: make gguf-converter")
    env = {**base_env(tmp_path), "TIERLINE_DATA_DIR": str(tmp_path / "data")}
    args = ("bench", "engine", "--vs", "llamacpp", "--shape", "test-qwen2", "--rounds", "2", "--json")
    done = run_tierline(*args, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["shape"] == "test-qwen2" and result["config"]["model_type"] == "qwen2"
    for contender in ("tierline", "llamacpp-f32", "llamacpp-q8_0"):
        numbers = result[contender]
        assert len(numbers["batch1_runs"]) == len(numbers["concurrent_runs"]) == 2
        assert numbers["batch1_tokens_per_s"] > 0 and numbers["concurrent_tokens_per_s"] > 0
        assert numbers["peak_rss_mb"] > 50  # its own process: a loaded model and runtime, not the parent's
    # llama.cpp f32 through the converter's GGUF is the checkpoint: the same greedy tokens as the engine
    assert result["llamacpp-f32"]["outputs_identical_batch1"] == "4/4"
    assert result["llamacpp-f32"]["outputs_identical_concurrent"] == "16/16"
