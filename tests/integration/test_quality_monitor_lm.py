"""The live quality monitor for LM answers, with real processes on localhost: a cloud (shadow share 1, its LM
engines), a console and an edge agent in device group ``lab`` (the tiny zoo; the INT8 ``lm-edge`` on the device,
``lm-cloud`` in the cloud).

The LM policy is calibrated in the control plane on the validation half of ``bench cascade``'s ``lm`` task (held-out
line completion, greedy, exact line); the agent then answers the test half's prompts (greedy completions, token
ids, as an editor sends them). Every answer the policy keeps on the device is shadowed: the cloud runs the prompt
greedily on its LM for as many tokens as the edge generated and counts the sample as agreeing when the tokens are
the same. Calibrated: no alert over 200+ samples. Deliberately mis-set (the calibration's operating point at a
small edge share, whose promised agreement is high, with a threshold that keeps every request on the device): an
alert within 200 samples, on the console and in the CLI. Shadow work is billed once per batch as tier ``shadow``
in tokens, and never changes what the client got."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from console.passwords import create_user
from controlplane.policies import monitor, service
from controlplane.registry import service as registry
from controlplane.registry.artifacts import platform_signing_key
from controlplane.storage.session import session_scope
from controlplane.storage.tables import QualityAlert, ShadowSample, UsageRecord
from edge_agent.cloud_link import Credentials
from shared.escalation import EdgePolicy
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.console_support import PASSWORD, login
from tests.integration.edge_support import ZOO_PAIRS_ENV
from tests.integration.test_quality_monitor import Platform as BasePlatform
from tests.integration.test_quality_monitor import wait_for

pytestmark = pytest.mark.integration
LM = "tierline/lm-edge"
INT8 = "tierline/lm-edge-onnx-int8"  # the export bench cascade runs on the edge
CLOUD_LM = "tierline/lm-cloud"
SYNC_S = 0.5
NUM_LINES = 400  # held-out line starts: half calibrate the policy, half are the device's traffic
SEED = 0
MIS_SET_SHARE = 0.2  # the mis-set version promises what the top fifth of the validation items deliver


@dataclass
class Platform(BasePlatform):
    """The classifier monitor test's platform, with the test half's LM prompts."""

    traffic: list[list[int]] = dataclasses.field(default_factory=list)  # the test half's prompts (token ids)


def lm_validation(zoo: Path, dest: Path) -> tuple[Path, list[list[int]]]:
    """``bench cascade``'s ``lm`` task on the tiny zoo: the validation half exported (``--export-validation``), and
    the test half's prompts."""
    from bench.cascade_bench import export_validation
    from bench.cascade_tasks import run_lm
    from shared.zoo.registry import ZooLayout

    task = run_lm(ZooLayout(zoo), NUM_LINES, SEED)
    order = np.random.default_rng(SEED).permutation(len(task))
    val_rows, test_rows = np.sort(order[: len(task) // 2]), np.sort(order[len(task) // 2 :])
    export_validation(dest, [(task, val_rows)])
    prompts = _prompts(zoo)
    assert len(prompts) == len(task)
    return dest, [prompts[i] for i in test_rows]


def _prompts(zoo: Path) -> list[list[int]]:
    """The ``lm`` task's prompts (token ids), drawn as ``run_lm`` draws them."""
    import json

    from tokenizers import Tokenizer

    from bench.cascade_tasks import EDGE_LM_ARTIFACT, _LineEnds, line_items
    from shared.zoo.corpus import held_out_files
    from shared.zoo.registry import ZooLayout

    edge_dir = ZooLayout(zoo).artifact_dir(EDGE_LM_ARTIFACT)
    eos = json.loads((edge_dir / "generation_config.json").read_text()).get("eos_token_id", [])
    ends = _LineEnds(
        Tokenizer.from_file(str(edge_dir / "tokenizer.json")), set(eos if isinstance(eos, list) else [eos])
    )
    return [item.prompt for item in line_items(ends, [f.text for f in held_out_files()], NUM_LINES, SEED)]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Platform]:
    data = seed_data_dir(tmp_path_factory.mktemp("lm-monitor"), tiny_zoo, session_data_dir)
    db = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S=str(SYNC_S),
        TIERLINE_CLOUD_EDGE_SHADOW_SHARE="1.0",
        TIERLINE_CLOUD_EDGE_SHADOW_TOKENS_PER_MINUTE="10000000",
    )
    agent_env = base_env(
        data,
        TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"),
        TIERLINE_EDGE_STATE_DIR=str(data / "agent-state"),
        TIERLINE_EDGE_CLOUD_DEADLINE_S="30",
        **ZOO_PAIRS_ENV,
    )
    validation, traffic = lm_validation(tiny_zoo, data / "lm-validation.jsonl")
    p = Platform(data, env, agent_env, "", "", "", db, traffic)
    p.cli("tenants", "create", "acme")
    token = p.cli("devices", "enrollment-token", "--tenant", "acme", "--label", "group=lab")
    out = p.cli("policies", "calibrate", "--model", LM, "--data", str(validation), "--max-quality-loss", "0.01")
    assert f"{LM} v1:" in out
    with ExitStack() as stack:
        p.cloud_url = stack.enter_context(run_server(["cloud", "serve"], env, free_port(), timeout=180))
        run_tierline(
            "edge", "enroll", "--cloud", p.cloud_url, "--token", token, "--name", "lab-1", env=agent_env, check=True
        )
        p.edge_url = stack.enter_context(run_server(["edge", "run"], agent_env, free_port()))
        console_env = {**env, "TIERLINE_SECRET_KEY": "test-" + uuid.uuid4().hex}
        p.console_url = stack.enter_context(run_server(["console", "serve"], console_env, free_port()))
        engine = create_engine(db)
        with session_scope(engine) as session:
            create_user(session, "ops", PASSWORD, "admin")
            registry.ensure_model(session, "lm-edge", None, actor="test")
        engine.dispose()
        yield p


def complete(p: Platform, prompt: list[int]) -> httpx.Response:
    """A greedy line completion on the device (what bench cascade's ``lm`` task asks of the edge)."""
    body = {"model": INT8, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["\n"]}
    resp = httpx.post(f"{p.edge_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def settle(p: Platform) -> None:
    def settled() -> bool:
        s = p.agent()["shadow"]
        return bool(s["queued"] == 0 and s["sent"] + s["dropped"] + s["refused"] == s["offered"])

    wait_for("the sampler sent its batches", settled, timeout=120)


def edge_answers(p: Platform, prompts: list[list[int]], want: int) -> tuple[int, list[str]]:
    """Send ``prompts`` (round and round) until ``want`` were answered on the device; (requests, edge texts)."""
    texts: list[str] = []
    sent = 0
    while len(texts) < want:
        resp = complete(p, prompts[sent % len(prompts)])
        sent += 1
        if resp.headers["x-tierline-tier"] == "edge":
            texts.append(resp.json()["choices"][0]["text"])
        assert sent < 20 * want, "the policy keeps (almost) nothing on the device"
    settle(p)
    return sent, texts


def counts(p: Platform, version: int) -> tuple[int, int]:
    def read(s: Session) -> tuple[int, int]:
        rows = s.exec(
            select(ShadowSample.agrees).where(ShadowSample.model == LM, ShadowSample.policy_version == version)
        )
        agrees = list(rows)
        return len(agrees), sum(bool(a) for a in agrees)

    result: tuple[int, int] = p.query(read)
    return result


def alerts_of(p: Platform, version: int) -> list[QualityAlert]:
    result: list[QualityAlert] = p.query(
        lambda s: list(
            s.exec(select(QualityAlert).where(QualityAlert.model == LM, QualityAlert.policy_version == version))
        )
    )
    return result


def test_a_mis_set_lm_policy_raises_an_alert_within_200_samples_and_a_calibrated_one_none(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = platform
    wait_for("v1 reaches the agent", lambda: p.agent()["policies"].get(LM) == "1", timeout=60)
    assert p.agent()["shadow"]["share"] == 1.0

    # Calibrated: the test half's prompts until 200 answers stayed on the device, every one of them shadowed.
    requests1, _ = edge_answers(p, p.traffic, 200)
    n1, k1 = counts(p, 1)
    assert n1 == 200 and alerts_of(p, 1) == []
    shadow = p.agent()["shadow"]
    assert shadow["lm_offered"] == 200 and shadow["dropped"] == 0 and shadow["refused"] == 0
    v1 = p.query(lambda s: service.get_version(s, LM, 1))
    promised1 = monitor.promised_agreement(v1, p.data)
    assert promised1 is not None

    # Deliberately mis-set: the calibration's operating point at edge share MIS_SET_SHARE (the top fifth of the
    # validation items by confidence: the agreement they promise is high), with a threshold that keeps every
    # request on the device.
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(p.data))
    engine = create_engine(p.db)
    with session_scope(engine) as session:
        base = service.get_version(session, LM, 1)
        policy = EdgePolicy.from_json(base.policy)
        loose = dataclasses.replace(
            policy, threshold=-1e9, calibration={**policy.calibration, "edge_share": MIS_SET_SHARE}
        )
        service._store(
            session,
            loose,
            max_quality_loss=base.max_quality_loss,
            data_sha256=base.data_sha256,
            data_items=base.data_items,
            target=[],
            derived_from=1,
            actor="test:mis-set",
            key=platform_signing_key(),
            action="escalation_policy.test",
        )
    engine.dispose()
    wait_for("v2 reaches the agent", lambda: p.agent()["policies"].get(LM) == "2", timeout=60)
    requests2, texts2 = edge_answers(p, p.traffic, 200)
    assert requests2 == 200  # every request answered on the device
    n2, k2 = counts(p, 2)
    assert n2 == 200
    (alert,) = alerts_of(p, 2)
    assert alert.device_group == "lab" and alert.status == "open" and alert.num_samples <= 200
    assert alert.upper_bound < alert.promised - monitor.TOLERANCE
    assert alert.proposed_threshold is not None and alert.proposed_threshold > -1e9
    print(
        {
            "v1": {"requests": requests1, "samples": n1, "agreement": round(k1 / n1, 3), "promised": promised1},
            "v2": {
                "samples": n2,
                "agreement": round(k2 / n2, 3),
                "alert_at": alert.num_samples,
                "promised": round(alert.promised, 3),
                "upper": round(alert.upper_bound, 3),
                "proposed_threshold": alert.proposed_threshold,
            },
        }
    )

    # The console and the CLI show it.
    assert f"alert {alert.id} (open): {LM} v2 group lab" in p.cli("policies", "alerts")
    with httpx.Client(base_url=p.console_url, follow_redirects=False, timeout=30) as admin:
        assert login(admin, "ops", PASSWORD).status_code == 303
        assert 'id="quality-alerts"' in admin.get("/").text
        page = admin.get("/models/lm-edge").text
        assert f'id="quality-alert-{alert.id}"' in page
        assert "<th>Token agreement</th>" in page  # LM groups show the mean share of tokens the cloud chose too
    # Every LM sample stores its token share; a sample that agrees (every token the same) has share 1.
    shares = p.query(
        lambda s: list(
            s.exec(select(ShadowSample.agrees, ShadowSample.token_agreement).where(ShadowSample.model == LM))
        )
    )
    assert shares and all(t is not None and 0.0 <= t <= 1.0 for _, t in shares)
    assert all(t == 1.0 for a, t in shares if a)

    # The client's answer is the device's own with or without shadowing: the same text for the same prompt.
    again = complete(p, p.traffic[0]).json()["choices"][0]["text"]
    assert again == texts2[0]
    # A stream the policy kept on the device is shadowed too, once it was sent whole (just after its last chunk).
    offered = p.agent()["shadow"]["lm_offered"]
    body = {"model": INT8, "prompt": p.traffic[0], "max_tokens": 24, "temperature": 0, "stop": ["\n"], "stream": True}
    with httpx.stream("POST", f"{p.edge_url}/v1/completions", json=body, timeout=120) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-tierline-tier"] == "edge"
        assert b"[DONE]" in b"".join(streamed.iter_bytes())
    wait_for(
        "the stream is offered to the sampler", lambda: p.agent()["shadow"]["lm_offered"] == offered + 1, timeout=60
    )
    settle(p)
    assert counts(p, 2)[0] == n2 + 2

    # Billed once per batch, as tier shadow on the cloud LM, in tokens (the prompts and the tokens generated).
    def billed(s: Session) -> tuple[int, int, int]:
        records = s.exec(select(UsageRecord).where(UsageRecord.tier == "shadow")).all()
        assert {r.model for r in records} == {CLOUD_LM}
        assert all(r.escalation_reason == "quality-monitor" and r.completion_tokens > 0 for r in records)
        return len(records), sum(r.prompt_tokens for r in records), len(set(s.exec(select(ShadowSample.usage_id))))

    num_records, prompt_tokens, sample_ids = p.query(billed)
    assert num_records == sample_ids == n1 + n2 + 2 and prompt_tokens > 0

    # A retried LM batch is not redone or billed twice; a vocabulary that is not the cloud LM's is refused (409).
    creds = Credentials.load(Path(p.agent_env["TIERLINE_EDGE_STATE_DIR"]))
    assert creds is not None
    from shared.chat_tokenizer import ChatTokenizer
    from shared.edge_protocol import vocabulary_sha256

    vocab = vocabulary_sha256(ChatTokenizer(p.data / "zoo" / "tiny" / "artifacts" / "lm-edge-onnx-int8").tokenizer)
    sample = {"prompt_ids": p.traffic[0], "edge_tokens": [1, 2, 3], "confidence": 0.5}
    batch: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "model": LM,
        "cloud_model": CLOUD_LM,
        "policy_version": 2,
        "lm_samples": [sample],
        "vocabulary_sha256": vocab,
        "occurred_at": time.time(),
    }
    auth = {"Authorization": f"Bearer {creds.device_token}"}
    first = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json=batch, headers=auth, timeout=60)
    retry = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json=batch, headers=auth, timeout=60)
    assert first.status_code == retry.status_code == 200, first.text
    assert first.json()["duplicate"] is False and retry.json()["duplicate"] is True
    assert 0.0 <= first.json()["token_agreement"] <= 1.0
    assert p.query(billed)[0] == num_records + 1
    other = {**batch, "id": uuid.uuid4().hex, "vocabulary_sha256": "0" * 64}
    refused = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json=other, headers=auth, timeout=60)
    assert refused.status_code == 409 and "vocabularies" in refused.text
    too_big = {**batch, "id": uuid.uuid4().hex, "lm_samples": [{**sample, "prompt_ids": [10**9]}]}
    bad = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json=too_big, headers=auth, timeout=60)
    assert bad.status_code == 400 and "prompt" in bad.text
