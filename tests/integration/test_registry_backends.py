"""Registry versions answered by upstream servers (a version's serving spec), behind a real ``tierline cloud serve``:
the spec set through ``tierline models push --serving`` / ``tierline models serving``, endpoint lists reloaded
without a restart (new endpoints join, removed ones drain), a canary rollout between a built-in version and an
``openai`` version that shifts traffic by weight and rolls back by itself when the upstream starts failing, and
prefix affinity plus per-interval DNS resolution on a backend.

Real processes: one ``tierline engine serve`` (the tiny LM, key-protected) is the upstream; in front of it, HTTP
proxies in this test process (real sockets) that count what reaches them, can hold a request, and can start
answering 500 — the upstream the test controls. Being one host, the operator allows serving specs to name loopback
upstreams and designates the secrets directory their key file is named in (``TIERLINE_CLOUD_UPSTREAM_*``).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.registry import service as registry
from controlplane.registry.artifacts import push_path
from controlplane.registry.store import LocalArtifactStore
from controlplane.rollouts import service as rollouts
from controlplane.storage.tables import Rollout, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.artifacts import load_or_create_signing_key
from shared.errors import ApplicationError
from shared.zoo.registry import ZooLayout
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
CANARY = "tiny-lm"  # v1 built-in (a checkpoint), v2 an openai version: the rollout's two arms
REMOTE = "remote-tiny"  # v1 an openai version: endpoint reloads and drains
AFFINE = "affine-lm"  # the backends file's model: prefix affinity, DNS names
ACTOR = "test"
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class Proxy:
    """An upstream the test controls: forwards to ``target`` (keeping the gateway's Authorization), records the
    path and Host of each request, holds POSTs ``delay_s``, and answers 500 to everything while ``fail``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.fail = False
        self.delay_s = 0.0
        self.hits: list[tuple[str, str]] = []  # (path, Host) of each POST
        self._client = httpx.Client(timeout=120)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _relay(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if method == "POST":
                    proxy.hits.append((self.path, self.headers.get("host", "")))
                if proxy.fail:
                    status, ctype = 500, "application/json"
                    data = b'{"error": {"message": "injected failure", "type": "server_error"}}'
                else:
                    if method == "POST" and proxy.delay_s:
                        time.sleep(proxy.delay_s)
                    keep = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                    r = proxy._client.request(method, f"{proxy.target}{self.path}", content=body, headers=keep)
                    status, ctype, data = r.status_code, r.headers.get("content-type", "application/json"), r.content
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._relay("GET")

            def do_POST(self) -> None:
                self._relay("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def posts(self) -> int:
        return len(self.hits)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()


@dataclass
class Platform:
    url: str
    key: str
    db: Engine
    data: Path
    env: dict[str, str]
    tenant_id: int
    proxies: dict[str, Proxy]
    spec: dict[str, Any]  # the serving spec's common fields

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {self.key}"})

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = run_tierline(*args, env=self.env)
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def usage(self, ids: list[str], timeout: float = 10.0) -> dict[str, UsageRecord]:
        deadline = time.monotonic() + timeout
        while True:
            with Session(self.db) as s:
                rows = {r.id: r for r in s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids)))}
            if len(rows) == len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)


def metric(text: str, name: str, model: str, endpoint: str | None = None) -> float | None:
    for line in text.splitlines():
        is_it = line.startswith(f"{name}{{") and f'model="{model}"' in line
        if is_it and (endpoint is None or f'endpoint="{endpoint}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return None


def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def platform(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path
) -> Iterator[Platform]:
    data = seed_data_dir(tmp_path_factory.mktemp("registry-backends"), tiny_zoo, session_data_dir)
    lm_dir = ZooLayout(tiny_zoo).artifact_dir("lm-cloud")
    tokenizer = data / "tokenizer"  # the LM's tokenizer without its weights: what an openai version carries
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(lm_dir / name, tokenizer / name)
    secrets = data / "upstream-keys"  # the operator's secrets directory: serving specs name key files in it
    secrets.mkdir()
    key_file = secrets / "upstream.key"
    key_file.write_text("sk-upstream-secret\n")
    key_file.chmod(0o600)
    db_url = migrated_sqlite(data)
    # A one-host setup: the operator lets serving specs name upstreams on loopback, keys from secrets/.
    operator = {"TIERLINE_CLOUD_UPSTREAM_ALLOW_LOOPBACK": "true", "TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR": str(secrets)}
    upstream_port = free_port()
    upstream = f"http://127.0.0.1:{upstream_port}"
    proxies = {n: Proxy(upstream) for n in ("canary", "a", "b", "affine-1", "affine-2")}
    common = {
        "backend": "openai",
        "upstream_model": "lm-cloud",
        "api_key_file": key_file.name,
        "eject_after_failures": 3,
        "eject_s": 60.0,
        "probe_interval_s": 0.3,
    }
    backends = data / "backends.json"
    affine = {
        "type": "openai",
        "tokenizer": str(lm_dir),
        **{k: v for k, v in common.items() if k != "backend"},
        "api_key_file": str(key_file),  # the operator's own file: any path
        # by name: resolved to 127.0.0.1 every probe interval, sent as Host
        "endpoints": [f"http://localhost:{proxies['affine-1'].port}", proxies["affine-2"].url],
        "resolve_dns": True,
        "affinity_prefix_chars": 24,
    }
    backends.write_text(json.dumps({"models": {AFFINE: affine}}))
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="none",
        TIERLINE_CLOUD_KV_CACHE_MB="8",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_CANARY_REFRESH_S="0.3",
        TIERLINE_CLOUD_REGISTRY_MODELS=f"{CANARY},{REMOTE}",
        TIERLINE_CLOUD_BACKENDS=str(backends),
        **operator,
    )
    db = create_engine(db_url)
    store = LocalArtifactStore(data / "artifacts")
    signing = load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519")
    mp = pytest.MonkeyPatch()  # specs set in this process are checked against the same operator settings
    request.addfinalizer(mp.undo)
    for name, value in operator.items():
        mp.setenv(name, value)
    with Session(db) as s:
        push_path(s, store, lm_dir, name=CANARY, actor=ACTOR, signing_key=signing)
        registry.move_alias(s, registry.get_model(s, CANARY), "stable", 1, actor=ACTOR)
        push_path(
            s,
            store,
            tokenizer,
            name=REMOTE,
            alias="stable",
            actor=ACTOR,
            signing_key=signing,
            serving={**common, "endpoints": [proxies["a"].url]},
        )
        tenant = create_tenant(s, "acme")
        secret = create_api_key(s, tenant).secret
        s.commit()
        tenant_id = tenant.id or 0
    spec_file = data / "canary-spec.json"
    spec_file.write_text(json.dumps({**common, "endpoints": [proxies["canary"].url]}))
    p = Platform("", secret, db, data, env, tenant_id, proxies, common)
    # The CLI: the tokenizer directory is an hf-tokenizer artifact, the spec makes the version an openai one.
    pushed = json.loads(
        p.cli("models", "push", str(tokenizer), "--name", CANARY, "--serving", str(spec_file), "--json").stdout
    )
    assert pushed["number"] == 2 and [a["format"] for a in pushed["artifacts"]] == ["hf-tokenizer"]
    assert pushed["serving"]["endpoints"] == [proxies["canary"].url] and pushed["serving"]["backend"] == "openai"
    upstream_env = base_env(data, TIERLINE_CLOUD_KV_CACHE_MB="32", TIERLINE_CLOUD_NUM_THREADS="1")
    upstream_args = ["engine", "serve", "--model", str(lm_dir), "--name", "lm-cloud", "--api-key-file", str(key_file)]
    port = free_port()
    try:
        with (
            server_process(
                upstream_args, upstream_env, upstream_port, ready_path="/health", timeout=180, log=data / "up.log"
            ),
            server_process(["cloud", "serve"], env, port, timeout=180, log=data / "gateway.log"),
        ):
            p.url = f"http://127.0.0.1:{port}"
            yield p
    finally:
        for proxy in proxies.values():
            proxy.close()
        db.dispose()


def complete(http: httpx.Client, model: str, prompt: str = "def f(x):", **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return http.post("/v1/completions", json=body)


def test_a_serving_spec_is_checked_like_the_backends_file(platform: Platform) -> None:
    bad = platform.data / "bad-spec.json"
    bad.write_text(json.dumps({**platform.spec, "endpoints": ["http://127.0.0.1:1"], "max_concurent": 4}))
    proc = platform.cli("models", "serving", REMOTE, "1", str(bad), check=False)
    assert proc.returncode != 0 and "serving.max_concurent: Extra inputs are not permitted" in proc.stderr
    with Session(platform.db) as s:
        model = registry.get_model(s, CANARY)
        with pytest.raises(ApplicationError, match="no ready cloud hf-tokenizer"):  # v1 has one: a checkpoint; make v3
            v = registry.register_version(s, model, actor=ACTOR)
            registry.set_serving(s, model, v.number, {**platform.spec, "endpoints": ["http://x:1"]}, actor=ACTOR)
        s.rollback()
        with pytest.raises(ApplicationError, match="resolve_dns: endpoints must be plain http"):
            spec = {**platform.spec, "endpoints": ["https://vllm.svc:8000"], "resolve_dns": True}
            registry.set_serving(s, model, 2, spec, actor=ACTOR)


def test_a_spec_the_gateway_cannot_start_leaves_the_running_backend_serving(platform: Platform) -> None:
    a = platform.proxies["a"]
    open_key = platform.data / "upstream-keys" / "open.key"
    open_key.write_text("sk-other\n")
    open_key.chmod(0o644)
    good = {**platform.spec, "endpoints": [a.url]}
    with platform.http() as http:
        assert complete(http, REMOTE).status_code == 200
        with Session(platform.db) as s:
            model = registry.get_model(s, REMOTE)
            registry.set_serving(s, model, 1, {**good, "api_key_file": open_key.name}, actor=ACTOR)
            s.commit()
        log = platform.data / "gateway.log"
        until(lambda: "readable by others" in log.read_text(), "the gateway reports the bad key file")
        time.sleep(1.0)  # several refreshes: reported once, not at each
        assert log.read_text().count("readable by others") == 1
        before = a.posts
        assert complete(http, REMOTE).status_code == 200 and a.posts == before + 1  # the old backend serves on
        with Session(platform.db) as s:
            registry.set_serving(s, registry.get_model(s, REMOTE), 1, good, actor=ACTOR)
            s.commit()


def test_an_openai_registry_version_serves_and_its_endpoints_reload_and_drain(platform: Platform) -> None:
    a, b = platform.proxies["a"], platform.proxies["b"]
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.key, max_retries=0)
    sent = a.posts
    raw = client.chat.completions.with_raw_response.create(
        model=REMOTE, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    answer = raw.parse()
    assert answer.model == REMOTE and answer.usage is not None and answer.usage.completion_tokens >= 1
    assert raw.headers["x-tierline-model-version"] == "1" and a.posts == sent + 1
    usage_id = raw.headers["x-tierline-usage-id"]
    row = platform.usage([usage_id])[usage_id]
    assert (row.model, row.model_version, row.usage_source) == (REMOTE, 1, "upstream")
    assert row.completion_tokens == answer.usage.completion_tokens

    # A new endpoint list through the CLI: b joins without a restart, a stays.
    both = platform.data / "both.json"
    both.write_text(json.dumps({**platform.spec, "endpoints": [a.url, b.url]}))
    assert "2 endpoint(s)" in platform.cli("models", "serving", REMOTE, "1", str(both)).stdout
    with platform.http() as http:
        until(lambda: complete(http, REMOTE).status_code == 200 and b.posts > 0, "b takes requests")

        # Hold one request on a, then drop a from the list: it drains.
        a.delay_s = 20.0
        held: list[httpx.Response] = []
        before = a.posts

        def hold() -> None:
            held.append(complete(http, REMOTE, max_tokens=8, ignore_eos=True))

        for _ in range(6):
            t = threading.Thread(target=hold)
            t.start()
            until(
                functools.partial(lambda t: a.posts > before or not t.is_alive(), t), "the request reaches an endpoint"
            )
            if a.posts > before:
                break
            t.join()
        assert a.posts == before + 1, "no request reached a"
        with Session(platform.db) as s:
            model = registry.get_model(s, REMOTE)
            registry.set_serving(s, model, 1, {**platform.spec, "endpoints": [b.url]}, actor=ACTOR)
            s.commit()
        until(
            lambda: metric(platform.metrics(), "tierline_backend_endpoint_draining", f"{REMOTE}@1", a.url) == 1.0,
            "a drains",
        )
        at_a, at_b = a.posts, b.posts
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: complete(http, REMOTE), range(6)))
        assert [r.status_code for r in answers] == [200] * 6
        assert a.posts == at_a and b.posts == at_b + 6  # nothing new goes to a draining endpoint
        assert t.is_alive()  # a's request is still in flight ...
        t.join(60)
        assert held and held[-1].status_code == 200, held  # ... and finishes
        assert held[-1].json()["usage"]["completion_tokens"] == 8
        # ... then a leaves the pool (and /metrics)
        until(
            lambda: metric(platform.metrics(), "tierline_backend_requests_total", f"{REMOTE}@1", a.url) is None,
            "a leaves",
        )
        assert metric(platform.metrics(), "tierline_backend_requests_total", f"{REMOTE}@1", b.url) is not None
        a.delay_s = 0.0


def test_a_canary_from_a_builtin_to_an_openai_version_shifts_by_weight_and_rolls_back_on_upstream_errors(
    platform: Platform,
) -> None:
    proxy = platform.proxies["canary"]
    with Session(platform.db) as s:
        spec = rollouts.RolloutSpec(
            CANARY,
            "1",
            "2",
            scope="cloud",
            steps=[25.0, 50.0, 100.0],
            min_step_s=0,
            min_samples=10,
            # judged on errors only: the two arms run on different processes, their latencies differ anyway
            checks={"p95_latency_ms": None, "p95_ttft_ms": None, "cost_per_request": None},
        )
        rollout_id = rollouts.create_rollout(s, spec, actor=ACTOR).id or 0
        s.commit()
    assert [r.action for r in rollouts.run_controller_pass(platform.db)] == ["start"]

    def served(http: httpx.Client, subjects: list[str]) -> dict[str, httpx.Response]:
        def one(subject: str) -> httpx.Response:
            body = {"model": CANARY, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
            return http.post("/v1/completions", json=body, headers={"x-tierline-subject": subject})

        with ThreadPoolExecutor(8) as pool:
            return dict(zip(subjects, pool.map(one, subjects), strict=True))

    def share(answers: dict[str, httpx.Response]) -> float:
        assert {r.status_code for r in answers.values()} == {200}, [r.text for r in answers.values()][:3]
        versions = [r.headers["x-tierline-model-version"] for r in answers.values()]
        assert set(versions) <= {"1", "2"}
        return versions.count("2") / len(versions)

    subjects = [f"user-{i}" for i in range(80)]
    with platform.http() as http:
        until(lambda: complete(http, f"{CANARY}@1").status_code == 200, "v1 loaded")
        # both arms loaded: the candidate (upstream) takes its weight's share; each record carries its arm
        until(lambda: share(served(http, subjects[:16])) > 0, "v2 loaded and routed")
        first = served(http, subjects)
        assert 0.1 <= share(first) <= 0.45, share(first)
        rows = platform.usage([r.headers["x-tierline-usage-id"] for r in first.values()])
        assert {(r.model_version, r.rollout_arm) for r in rows.values()} == {(1, "baseline"), (2, "candidate")}
        assert {r.usage_source for r in rows.values() if r.model_version == 2} == {"upstream"}

        # healthy: the controller moves it to 50 %
        results = rollouts.run_controller_pass(platform.db)
        assert [(r.action, r.weight) for r in results] == [("advance", 50.0)], results
        until(lambda: share(served(http, subjects)) >= 0.3, "weight 50 % routed")
        assert 0.3 <= share(served(http, subjects)) <= 0.7

        # the upstream starts failing: candidate requests fail (502, then 503 once ejected), baseline ones do not
        proxy.fail = True
        body = {"model": CANARY, "prompt": "def f(x):", "max_tokens": 2}
        failing = [http.post("/v1/completions", json=body, headers={"x-tierline-subject": s}) for s in subjects[:40]]
        codes = sorted({r.status_code for r in failing})
        assert codes == [200, 502, 503] or codes == [200, 502], codes
        assert all("retry-after" in r.headers for r in failing if r.status_code >= 500)
        results = rollouts.run_controller_pass(platform.db)
        assert [r.action for r in results] == ["rollback"], results
        assert "error_rate" in results[0].reason
        with Session(platform.db) as s:
            rollout = s.get(Rollout, rollout_id)
            assert rollout is not None and rollout.status == "rolled_back"

        # rolled back by itself: everyone on the built-in version again, counted in no arm
        def all_on_v1() -> bool:
            answers = served(http, subjects[:16]).values()
            return all(r.status_code == 200 and r.headers["x-tierline-model-version"] == "1" for r in answers)

        until(all_on_v1, "rollback routed")
        after = served(http, subjects)
        assert share(after) == 0.0
        rows = platform.usage([r.headers["x-tierline-usage-id"] for r in after.values()])
        assert {(r.model_version, r.rollout_arm) for r in rows.values()} == {(1, None)}
    proxy.fail = False


def test_prefix_affinity_and_dns_names_on_a_backend(platform: Platform) -> None:
    one, two = platform.proxies["affine-1"], platform.proxies["affine-2"]
    resolved = f"http://127.0.0.1:{one.port}"  # localhost's A record
    text = platform.metrics()
    assert metric(text, "tierline_backend_endpoint_admitted", AFFINE, resolved) == 1.0
    assert metric(text, "tierline_backend_endpoint_admitted", AFFINE, f"http://localhost:{one.port}") is None
    with platform.http() as http:
        # one prefix: always the same endpoint (the gateway is otherwise idle, so never over its bound)
        start = {p: p.posts for p in (one, two)}
        for i in range(8):
            assert complete(http, AFFINE, f"The same long shared prefix, then question {i}").status_code == 200
        moved = {p: p.posts - start[p] for p in (one, two)}
        assert sorted(moved.values()) == [0, 8], moved
        preferred = one if moved[one] else two
        root = resolved if preferred is one else two.url
        assert metric(platform.metrics(), "tierline_backend_affinity_hits_total", AFFINE, root) == 8.0
        # the name's endpoint is sent its name as Host
        if preferred is one:
            assert {h for _, h in one.hits} == {f"localhost:{one.port}"}

        # many prefixes spread over both
        start = {p: p.posts for p in (one, two)}
        for i in range(16):
            assert complete(http, AFFINE, f"prefix number {i:03d} differs here; the rest").status_code == 200
        assert all(p.posts > start[p] for p in (one, two))

        # bounded load: the preferred endpoint, busy, sheds the same prefix to the other one
        preferred.delay_s = 3.0
        start = {p: p.posts for p in (one, two)}
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(lambda i: complete(http, AFFINE, f"The same long shared prefix, then question {i}"), range(6))
            )
        preferred.delay_s = 0.0
        assert [r.status_code for r in answers] == [200] * 6
        other = two if preferred is one else one
        assert other.posts > start[other] and preferred.posts > start[preferred]
        assert (metric(platform.metrics(), "tierline_backend_affinity_misses_total", AFFINE) or 0) >= 1
