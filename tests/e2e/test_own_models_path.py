"""Issue 38's acceptance: a team's own checkpoints travel the whole path, with real processes.

Two random-initialised checkpoints of different families on one tokenizer: an edge-sized Qwen3 (q/k norms drawn
away from their initial ones, so an export that dropped them would answer differently) and a larger Llama-layout
cloud model. Both are pushed with the CLI, which says what serves each; the Qwen3 is derived (its fp32 ONNX export
agrees 100% with the checkpoint's own reference answers), exported and published to the devices holding a label,
while its INT8 export goes to another label only; it is paired with the Llama. A real agent enrolled with a real
cloud serves the Qwen3 under the team's names, and greedy answers on the device (the alias) and on the cloud (the
Llama) are transformers' ``generate(do_sample=False)`` on the same checkpoint, token for token. A forced
escalation of the Qwen3 reaches the Llama, and each model's tokens are billed at its own price.

Exactness of the token comparison: the servers return each generated token as its text (``logprobs``). A token's
text names it uniquely unless two tokens decode alike (the byte-level tokenizer's lone bytes 0x80-0xff all decode
to U+FFFD); those tokens' output rows are zeroed in both checkpoints, so greedy never picks one (and the test
asserts every expected token's text is unique in the vocabulary): equal texts are equal ids.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, col, select

from controlplane.billing.pricing import COST_QUANTUM, MILLION, period_of
from controlplane.fleet.devices import device_usage_id
from controlplane.storage.tables import Device, ModelArtifact, ModelVersion, Price, Tenant, UsageRecord
from tests.conftest import base_env, free_port, migrated_sqlite, run_server
from tests.forkserver import run_tierline
from tests.integration.test_edge_derive import make_checkpoint
from tests.integration.test_own_models import Cloud, until_not_loading

pytestmark = pytest.mark.e2e

EDGE = "acme-qwen3"  # the registry model, and the alias the device serves its formats under
CLOUD = "acme-llama"
RELEASE = f"{EDGE}-onnx"  # the fp32 export's release: `models export` names an LM's edge formats NAME-FORMAT
INT8_RELEASE = f"{EDGE}-onnx-int8"
PROMPTS = ["def encode(obj):\n", "import json\n", "class JSONDecoder(object):", "    return"]
MAX_TOKENS = 16
# Per million tokens: the edge model's at the edge price, the cloud model's at the cloud price.
# Large enough that the invoice's lines are not rounded to nothing; odd enough that a record's cost is rounded.
EDGE_PRICE = (Decimal("120.000125"), Decimal("360.250003"))
CLOUD_PRICE = (Decimal("1750.5"), Decimal("6500.000007"))

# The price book: the edge model at the edge price under both its names, the cloud model at the cloud price.
RATES = [(EDGE, "edge", EDGE_PRICE), (RELEASE, "edge", EDGE_PRICE), (CLOUD, "cloud", CLOUD_PRICE)]

T = TypeVar("T")


# --- the checkpoints ------------------------------------------------------------------------------------------------


def _ambiguous_tokens(tokenizer_file: Path) -> list[int]:
    """Ids whose text alone is another token's too, and the special tokens (EOS among them: no early stop)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    by_text: dict[str, list[int]] = {}
    for i in range(tok.get_vocab_size()):
        by_text.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    specials = [t["id"] for t in json.loads(tokenizer_file.read_text())["added_tokens"]]
    return sorted({i for ids in by_text.values() if len(ids) > 1 for i in ids} | set(specials))


def _never_chosen(model: Any, ids: list[int]) -> None:
    """Zero the output rows of ``ids``: their logit is exactly 0 while the others are drawn wide."""
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight[ids] = 0.0


def _edge_checkpoint(out: Path) -> Path:
    """An edge-sized Qwen3 (hidden 64, 2 layers, q/k norms drawn around 1 with std 0.5) from ``make_checkpoint``."""
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(out, "qwen3", seed=38)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for layer in model.model.layers:  # not at their init value (ones): an export that dropped them would differ
        for norm in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight):
            assert (norm - 1).abs().mean() > 0.2
    _never_chosen(model, _ambiguous_tokens(ckpt / "tokenizer.json"))
    model.save_pretrained(ckpt)
    return ckpt


def _cloud_checkpoint(out: Path, tokenizer_from: Path) -> Path:
    """A Llama-layout model twice the Qwen3's width and depth (hidden 128, 4 layers, untied head) on its tokenizer."""
    import torch
    import transformers

    source = json.loads((tokenizer_from / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=source["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=source["bos_token_id"],
        eos_token_id=source["eos_token_id"],
        pad_token_id=source["pad_token_id"],
    )
    torch.manual_seed(39)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.15)
    _never_chosen(model, _ambiguous_tokens(tokenizer_from / "tokenizer.json"))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_from / name, out / name)
    return out


def _greedy(ckpt: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)``, ``MAX_TOKENS`` new tokens per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
            out.append([int(t) for t in generated[0, len(ids) :]])
    return out


# --- the world ------------------------------------------------------------------------------------------------------


@dataclass
class World:
    env: dict[str, str]
    db: str
    cloud: Cloud
    edge_url: str
    tokenizer: Any
    prompts: list[list[int]]
    edge_greedy: list[list[int]]
    cloud_greedy: list[list[int]]
    pushed: dict[str, str]  # model -> what `models push` printed
    published: list[str]  # what `cloud publish` printed, labelled release first

    def edge(self, model: str, prompt: list[int], tier: str) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
        return httpx.post(f"{self.edge_url}/v1/completions", json=body, headers={"x-tierline-tier": tier}, timeout=120)

    def agent(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.edge_url}/v1/agent", timeout=10)
        assert resp.status_code == 200, resp.text
        body: dict[str, Any] = resp.json()
        return body

    def edge_models(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.edge_url}/v1/models", timeout=10)
        assert resp.status_code == 200, resp.text
        body: dict[str, Any] = resp.json()
        return body

    def rows(self, query: Any) -> list[Any]:
        engine = create_engine(self.db)
        with Session(engine) as s:
            found = list(s.exec(query))
        engine.dispose()
        return found

    def texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 120.0, why: Callable[[], Any] = str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {why()}")
        time.sleep(0.3)


def cli(env: dict[str, str], *args: str) -> str:
    proc = run_tierline(*args, env=env)
    assert proc.returncode == 0, f"tierline {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from tokenizers import Tokenizer

    work = tmp_path_factory.mktemp("own-path")
    edge_ckpt = _edge_checkpoint(work / "qwen3")
    cloud_ckpt = _cloud_checkpoint(work / "llama", edge_ckpt)
    tokenizer = Tokenizer.from_file(str(edge_ckpt / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]

    data = work / "data"
    db = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db,
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_NUM_THREADS="1",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S="0.5",
    )
    pushed = {
        EDGE: cli(env, "models", "push", str(edge_ckpt), "--name", EDGE),
        CLOUD: cli(env, "models", "push", str(cloud_ckpt), "--name", CLOUD, "--alias", "stable"),  # what serves
    }
    # INT8 is kept whatever its agreement, so it can be published (to other devices) and shown not to arrive here.
    cli(env, "models", "derive", EDGE, "1", "--no-tflite", "--no-gguf", "--min-int8-agreement", "0")
    for fmt in ("onnx", "onnx-int8"):
        cli(env, "models", "export", EDGE, "2", "--format", fmt, "--out", str(work / fmt))
    published = [
        cli(env, "cloud", "publish", str(work / "onnx" / "artifacts" / RELEASE), "--target", "ring=beta"),
        # The INT8 export, for the devices labelled ring=canary only: never this one.
        cli(env, "cloud", "publish", str(work / "onnx-int8" / "artifacts" / INT8_RELEASE), "--target", "ring=canary"),
    ]
    cli(env, "models", "pair", EDGE, CLOUD)
    cli(env, "tenants", "create", "acme")
    api_key = cli(env, "keys", "create", "--tenant", "acme").split()[-1]
    token = cli(env, "devices", "enrollment-token", "--tenant", "acme", "--label", "ring=beta").split()[-1]
    for model, tier, (prompt, completion) in RATES:
        cli(env, "billing", "prices", "set", "--model", model, "--tier", tier, "--prompt", str(prompt),
            "--completion", str(completion))  # fmt: skip

    edge_greedy, cloud_greedy = _greedy(edge_ckpt, prompts), _greedy(cloud_ckpt, prompts)
    agent_env = base_env(data, TIERLINE_EDGE_STATE_DIR=str(work / "agent"), TIERLINE_EDGE_ZOO_DIR=str(work / "no-zoo"))
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as cloud_url:
        cli(agent_env, "edge", "enroll", "--cloud", cloud_url, "--token", token, "--name", "acme-device-1")
        with run_server(["edge", "run"], agent_env, free_port(), timeout=120) as edge_url:
            yield World(
                env=env,
                db=db,
                cloud=Cloud(cloud_url, env, api_key, ""),
                edge_url=edge_url,
                tokenizer=tokenizer,
                prompts=prompts,
                edge_greedy=edge_greedy,
                cloud_greedy=cloud_greedy,
                pushed=pushed,
                published=published,
            )


# --- the path -------------------------------------------------------------------------------------------------------


def test_push_says_what_serves_each_and_derive_verifies_the_qwen3_exports(world: World) -> None:
    for model, family in ((EDGE, "qwen3"), (CLOUD, "llama")):
        line = f"{family}: served by the engine; edge formats onnx, onnx-int8, tflite, gguf"
        assert line in world.pushed[model].splitlines(), world.pushed[model]
    versions = world.rows(select(ModelVersion).order_by(col(ModelVersion.id)))
    derived = next(v for v in versions if v.derived_from_id is not None)
    assert derived.number == 2
    artifacts = {a.format: a for a in world.rows(select(ModelArtifact).where(ModelArtifact.version_id == derived.id))}
    assert set(artifacts) == {"onnx", "onnx-int8"}
    fp32 = artifacts["onnx"]
    meta = fp32.manifest["metadata"]
    assert fp32.status == "ready" and meta["verdict"] == "ready" and meta["bound"] == 1.0
    assert meta["agreement"]["overall"] == meta["agreement"]["long"] == 1.0, meta
    assert (fp32.manifest["name"], artifacts["onnx-int8"].manifest["name"]) == (RELEASE, INT8_RELEASE)
    assert meta["verified_against"]["name"] == f"{EDGE}@1"
    assert artifacts["onnx-int8"].status == "ready"  # --min-int8-agreement 0: whatever its numbers


def _device(world: World) -> Device:
    (device,) = world.rows(select(Device))
    return device


def _next_sync(world: World) -> None:
    before = _device(world).last_seen_at
    assert before is not None
    wait_for("a sync", lambda: (_device(world).last_seen_at or before) > before, timeout=30)


def test_the_labelled_device_serves_the_qwen3_under_the_teams_names_and_nothing_targeted_elsewhere(
    world: World,
) -> None:
    """The fp32 export went to ring=beta, the device's label, and is served under its release name and the model's
    (the alias, by the runtime guard's pick); the INT8 export, published for ring=canary, never reaches it."""
    assert (
        world.published[0].startswith(f"published {RELEASE} 2 ") and "devices ring=beta selects" in world.published[0]
    )
    assert (
        world.published[1].startswith(f"published {INT8_RELEASE} 2 ")
        and "devices ring=canary selects" in world.published[1]
    )

    def served() -> dict[str, Any] | None:
        listed = world.edge_models()
        return listed if {RELEASE, EDGE} <= {m["id"] for m in listed["data"]} else None

    listed = wait_for("the team's model and its alias on the device", served, why=world.agent)
    release = next(m for m in listed["data"] if m["id"] == RELEASE)
    assert (release["version"], release["format"]) == ("2", "onnx")
    alias = next(m for m in listed["data"] if m["id"] == EDGE)
    guard = alias["runtime_guard"]
    assert guard["chosen"] == "onnx" and guard["reference"] == f"reference.json ({EDGE}@1)", guard
    (onnx,) = guard["candidates"]  # the INT8 export is no candidate: the device does not have it
    assert onnx["eligible"] and onnx["agreement"] == 1.0, guard
    for model in (RELEASE, EDGE):
        answer = world.edge(model, world.prompts[0], "local-only")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-tierline-tier"] == "edge" and answer.json()["model"] == model
        assert _tokens(answer) == world.texts(world.edge_greedy[0])
    assert world.agent()["pairings"][RELEASE] == {"cloud_model": CLOUD, "resend": "as-sent"}

    device = _device(world)
    assert device.labels == {"ring": "beta"}
    for _ in range(2):  # two syncs later the release for ring=canary has still not been offered here
        _next_sync(world)
    device = _device(world)
    assert device.versions.get(INT8_RELEASE) is None and device.versions[RELEASE] == "2", device.versions
    assert device.runtime["serving"][EDGE]["chosen"] == "onnx"  # the guard's pick, as the cloud knows it
    listed = world.edge_models()
    assert INT8_RELEASE not in {m["id"] for m in listed["data"]} and INT8_RELEASE not in listed["not_served"]
    assert {m["id"] for m in listed["data"]} == {RELEASE, EDGE} and listed["not_served"] == {}


def _tokens(resp: httpx.Response) -> list[str]:
    tokens: list[str] = resp.json()["choices"][0]["logprobs"]["tokens"]
    return tokens


def test_greedy_answers_are_transformers_own_on_the_device_and_in_the_cloud(world: World) -> None:
    vocab_texts = world.texts(list(range(world.tokenizer.get_vocab_size())))
    for expected in (*world.edge_greedy, *world.cloud_greedy):
        assert len(expected) == MAX_TOKENS
        assert all(vocab_texts.count(text) == 1 for text in world.texts(expected))  # text names the id
    assert world.edge_greedy != world.cloud_greedy
    assert len({tuple(g) for g in world.edge_greedy}) == len(PROMPTS)  # answers depend on the prompt

    wait_for("the alias", lambda: EDGE in {m["id"] for m in world.edge_models()["data"]}, why=world.agent)
    assert until_not_loading(world.cloud, CLOUD, timeout=120).status_code == 200
    for prompt, edge_expected, cloud_expected in zip(world.prompts, world.edge_greedy, world.cloud_greedy, strict=True):
        on_device = world.edge(EDGE, prompt, "local-only")
        assert on_device.status_code == 200, on_device.text
        assert on_device.headers["x-tierline-tier"] == "edge" and on_device.json()["model"] == EDGE
        assert _tokens(on_device) == world.texts(edge_expected)
        assert on_device.json()["choices"][0]["text"] == world.tokenizer.decode(edge_expected)

        body = {"model": CLOUD, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
        in_cloud = httpx.post(
            f"{world.cloud.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {world.cloud.key}"},
            timeout=120,
        )
        assert in_cloud.status_code == 200, in_cloud.text
        assert in_cloud.json()["model"] == CLOUD
        assert _tokens(in_cloud) == world.texts(cloud_expected)
        assert in_cloud.json()["choices"][0]["text"] == world.tokenizer.decode(cloud_expected)


def test_a_forced_escalation_of_the_qwen3_reaches_the_paired_llama(world: World) -> None:
    assert until_not_loading(world.cloud, CLOUD, timeout=120).status_code == 200  # loaded at its first request
    wait_for("the pairing", lambda: world.agent()["pairings"].get(RELEASE, {}).get("cloud_model") == CLOUD)
    escalated = world.edge(EDGE, world.prompts[0], "cloud-only")
    assert escalated.status_code == 200, escalated.text
    assert escalated.headers["x-tierline-tier"] == "cloud" and escalated.json()["model"] == CLOUD
    assert _tokens(escalated) == world.texts(world.cloud_greedy[0])  # the Llama's own answer, sent as-sent
    usage_id = escalated.headers["x-tierline-usage-id"]
    (record,) = wait_for(
        "the cloud's record of the escalation",
        lambda: world.rows(select(UsageRecord).where(UsageRecord.id == usage_id)),
    )
    assert (record.model, record.tier, record.device_id) == (CLOUD, "cloud", _device(world).id)
    assert record.escalation_reason == "client-asked"


def test_each_model_is_metered_at_its_own_price(world: World) -> None:
    """The device's records (delivered from its outbox at sync) are rated at the Qwen3's edge price, the cloud's
    records of the Llama (escalated or asked directly) at the Llama's cloud price; the month's draft invoice bills
    each model's tokens in a line of its own. Every amount is recomputed here in Decimal."""
    wait_for("the model", lambda: EDGE in {m["id"] for m in world.edge_models()["data"]}, why=world.agent)
    wait_for("the pairing", lambda: world.agent()["pairings"].get(RELEASE, {}).get("cloud_model") == CLOUD)
    assert until_not_loading(world.cloud, CLOUD, timeout=120).status_code == 200
    local = world.edge(EDGE, world.prompts[2], "local-only")
    escalated = world.edge(EDGE, world.prompts[2], "cloud-only")
    assert (local.status_code, escalated.status_code) == (200, 200), (local.text, escalated.text)
    assert (local.headers["x-tierline-tier"], escalated.headers["x-tierline-tier"]) == ("edge", "cloud")
    (tenant,) = world.rows(select(Tenant).where(Tenant.name == "acme"))
    device = _device(world)
    assert tenant.id is not None and device.tenant_id == tenant.id
    # A device's record is stored under its usage id namespaced by tenant and device; the cloud's under its own.
    ledger_ids = {
        device_usage_id(tenant.id, device.id, local.headers["x-tierline-usage-id"]): (local, EDGE, "edge"),
        escalated.headers["x-tierline-usage-id"]: (escalated, CLOUD, "cloud"),
    }

    def delivered() -> list[UsageRecord] | None:  # the agent's outbox goes up at its next syncs
        rows = world.rows(select(UsageRecord).where(col(UsageRecord.id).in_(list(ledger_ids))))
        return rows if len(rows) == 2 and world.agent()["outbox"]["pending"]["usage"] == 0 else None

    for record in wait_for("both records in the ledger", delivered, why=world.agent):
        resp, model, tier = ledger_ids[record.id]
        usage = resp.json()["usage"]
        assert (record.model, record.tier) == (model, tier)
        assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], MAX_TOKENS)

    prices = {(p.model, p.tier): p for p in world.rows(select(Price))}
    rates = {(model, tier): price for model, tier, price in RATES}
    assert set(prices) == set(rates)
    records = world.rows(select(UsageRecord).where(UsageRecord.tenant_id == tenant.id))
    assert {(EDGE, "edge"), (CLOUD, "cloud")} <= {(r.model, r.tier) for r in records} <= set(rates)
    requests: dict[tuple[str, str], int] = {}
    tokens: dict[tuple[str, str], tuple[int, int]] = {}
    costs: dict[tuple[str, str], Decimal] = {}
    for r in records:
        key = (r.model, r.tier)
        per_prompt, per_completion = rates[key]
        expected = ((r.prompt_tokens * per_prompt + r.completion_tokens * per_completion) / MILLION).quantize(
            COST_QUANTUM, rounding=ROUND_HALF_EVEN
        )
        assert (r.price_id, r.cost) == (prices[key].id, expected), r
        requests[key] = requests.get(key, 0) + 1
        p, c = tokens.get(key, (0, 0))
        tokens[key] = (p + r.prompt_tokens, c + r.completion_tokens)
        costs[key] = costs.get(key, Decimal(0)) + expected

    (month,) = {period_of(r.occurred_at) for r in records}
    invoice = json.loads(cli(world.env, "billing", "invoice", "--tenant", "acme", "--month", month))
    assert invoice["status"] == "draft" and invoice["currency"] == "USD" and invoice["unpriced_records"] == 0
    lines = {(line["model"], line["tier"]): line for line in invoice["lines"]}
    assert set(lines) == set(requests) and len(invoice["lines"]) == len(requests)
    cents = Decimal("0.01")
    for key, line in lines.items():
        assert (line["requests"], line["prompt_tokens"], line["completion_tokens"]) == (requests[key], *tokens[key])
        assert Decimal(line["amount"]) == costs[key].quantize(cents, rounding=ROUND_HALF_EVEN), (key, costs[key])
    assert Decimal(invoice["total"]) == sum(Decimal(line["amount"]) for line in invoice["lines"])
    assert Decimal(invoice["total"]) > 0
