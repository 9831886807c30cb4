"""deploy/ for real: the image built (``deploy/images.sh``, what ``make images`` runs) and the compose topology run
in containers: PostgreSQL, Redis, the migrations job, the model server, two gateways behind nginx and the console.
The ``openai`` SDK streams through the load balancer; one gateway is killed (SIGKILL) under load and no request
that had not started fails, every answered request has exactly one usage record, and the other gateway serves;
``compose down`` leaves nothing but the volumes.

Skipped, saying why, where docker or its daemon is missing (``.ci/run`` installs and starts them) or the image
cannot be built. Where ``postgres:16``, ``redis:7`` and ``nginx`` cannot be pulled (this CI), the topology runs with
``deploy/compose.local.yaml``: the same services from Debian packages on the local base that ``make images`` made.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import yaml
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import REPO, free_port

DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
LOCAL_FILE = DEPLOY / "compose.local.yaml"
IMAGE = "tierline:latest"
MODEL = "tierline/lm-cloud"
KUBERNETES_BASE = DEPLOY / "kubernetes" / "base"


def _compose_command() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def _docker_problem() -> str | None:
    if os.environ.get("TIERLINE_TEST_SKIP_IMAGES"):  # .ci/run: its `make images` failed (the output says why)
        return os.environ["TIERLINE_TEST_SKIP_IMAGES"]
    if shutil.which("docker") is None:
        return "docker is not installed here (.ci/run installs Debian's docker.io)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode:
        why = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        return f"dockerd is not running or cannot start here ({why})"
    if _compose_command() is None:
        return "neither `docker compose` nor `docker-compose` is installed here"
    return None


DOCKER_PROBLEM = _docker_problem()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(2400),  # a cold image build is minutes; cached, seconds
    pytest.mark.skipif(DOCKER_PROBLEM is not None, reason=DOCKER_PROBLEM or ""),
]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise AssertionError(f"docker {' '.join(args)}: {out.stderr}")
    return out


@pytest.fixture(scope="module")
def image() -> str:
    """tierline:latest, built as `make images` builds it (layers cached: seconds when nothing changed)."""
    build = subprocess.run([str(DEPLOY / "images.sh")], cwd=REPO, capture_output=True, text=True, timeout=2100)
    if build.returncode:
        tail = "\n".join((build.stdout + build.stderr).strip().splitlines()[-15:])
        pytest.skip(f"the image could not be built here (deploy/images.sh exit {build.returncode}):\n{tail}")
    return IMAGE


def test_the_image_runs_as_the_manifests_expect(image: str) -> None:
    """One image, entrypoint `tierline`, uid 10001 (the pods' runAsUser), a health check, the CPU torch of
    constraints.txt, and the model directory the model server and the gateways' backends name."""
    [config] = json.loads(docker("image", "inspect", image).stdout)
    cfg = config["Config"]
    assert cfg["Entrypoint"] == ["tierline"]
    assert cfg["User"] == "10001:10001"
    assert cfg["Healthcheck"]["Test"][0] == "CMD"
    for manifest in ("gateway.yaml", "console.yaml", "model-server.yaml", "migrate-job.yaml"):
        for doc in yaml.safe_load_all((KUBERNETES_BASE / manifest).read_text()):
            pod = doc["spec"]["template"]["spec"] if doc and doc["kind"] in ("Deployment", "Job") else None
            if pod is not None:
                assert pod["securityContext"]["runAsUser"] == 10001, manifest
    torch_pin = next(
        line.split("==")[1]
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line.startswith("torch==")
    )
    probe = docker(
        "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python", image, "-c",
        "import os, pathlib, torch, tierline; "
        "print(os.getuid(), torch.__version__, torch.version.cuda, "
        "pathlib.Path('/opt/tierline/shared/zoo/weights/demo/lm-cloud/config.json').is_file())",
        timeout=180,
    )  # fmt: skip
    uid, version, cuda, weights = probe.stdout.split()
    assert (uid, cuda, weights) == ("10001", "None", "True")
    assert version.split("+")[0] == torch_pin
    usage = docker("run", "--rm", image, "db", "--help")
    assert "upgrade" in usage.stdout


# -- the compose topology --------------------------------------------------------------------------------------------
@dataclass
class Topology:
    project: str
    api: str
    console: str
    key: str
    command: list[str]
    env: dict[str, str]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([*self.command, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise AssertionError(f"compose {' '.join(args)} (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def usage_rows(self) -> dict[str, tuple[str, int]]:
        sql = "select id, status, completion_tokens from usage_record"
        out = self.compose("exec", "-T", "postgres", "psql", "-U", "tierline", "-d", "tierline", "-At", "-c", sql)
        rows = {}
        for line in out.stdout.splitlines():
            rid, status, tokens = line.split("|")
            assert rid not in rows, f"usage record {rid} twice"
            rows[rid] = (status, int(tokens))
        return rows


def _pullable(image: str) -> bool:
    return docker("image", "inspect", image, check=False).returncode == 0 or (
        docker("pull", "-q", image, check=False, timeout=300).returncode == 0
    )


@pytest.fixture(scope="module")
def topology(image: str) -> Iterator[Topology]:
    command = _compose_command()
    assert command is not None
    project = f"tierline-e2e-{secrets.token_hex(4)}"
    files = ["-f", str(COMPOSE_FILE)]
    upstream = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    if not all(_pullable(upstream[s]["image"]) for s in ("postgres", "redis", "lb")):
        files += ["-f", str(LOCAL_FILE)]
        local = yaml.safe_load(LOCAL_FILE.read_text())["services"]["postgres"]["image"]
        if docker("image", "inspect", local, check=False).returncode:
            pytest.skip(f"postgres/redis/nginx cannot be pulled here and {local} was not built (make images)")
    api_port, console_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TIERLINE_", "COMPOSE_", "POSTGRES_"))},
        "POSTGRES_PASSWORD": secrets.token_hex(16),
        "TIERLINE_SECRET_KEY": secrets.token_urlsafe(48),
        "COMPOSE_API_PORT": str(api_port),
        "COMPOSE_CONSOLE_PORT": str(console_port),
    }
    topo = Topology(project, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{console_port}", "", [], env)
    topo.command = [*command, "-p", project, *files]
    try:
        up = topo.compose("up", "-d", timeout=900, check=False)
        if up.returncode:
            logs = topo.compose("logs", "--tail", "30", timeout=60, check=False).stdout
            raise AssertionError(f"compose up failed:\n{up.stderr}\n{logs}")
        topo.compose("exec", "-T", "gateway-1", "tierline", "tenants", "create", "e2e")
        topo.key = topo.compose("exec", "-T", "gateway-1", "tierline", "keys", "create", "--tenant", "e2e").stdout
        topo.key = topo.key.strip().splitlines()[-1]
        yield topo
    finally:
        topo.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300, check=False)


def _client(topo: Topology) -> OpenAI:
    return OpenAI(base_url=f"{topo.api}/v1", api_key=topo.key, max_retries=0, timeout=120)


def test_the_openai_sdk_streams_through_the_load_balancer(topology: Topology) -> None:
    assert httpx.get(f"{topology.api}/readyz", timeout=10).status_code == 200
    with _client(topology) as client:
        assert MODEL in {m.id for m in client.models.list()}
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=12,
                temperature=0,  # (sampled, an answer can be its end token alone: empty text, a flaky test)
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and len([c for c in chunks if c.choices]) > 1  # token by token, not one buffered answer
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert httpx.get(f"{topology.console}/healthz", timeout=10).status_code == 200
    assert httpx.get(f"{topology.console}/login", timeout=10).status_code == 200


def test_the_images_health_check_finds_each_server(topology: Topology) -> None:
    """The image's own HEALTHCHECK (plain `docker run`, no orchestrator probes) asks the right endpoint."""
    for service, url in (
        ("gateway-2", "http://127.0.0.1:8400/readyz: 200"),
        ("console", "http://127.0.0.1:8401/healthz: 200"),
        ("model-server", "http://127.0.0.1:8000/health: 200"),
    ):
        check = docker("exec", topology.container(service), "python", "/usr/local/lib/tierline-healthcheck.py")
        assert check.stdout.strip() == url, service


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool = False
    request_id: str | None = None  # the usage record's id
    completion_tokens: int = 0
    error: str | None = None


def _one_request(client: OpenAI, n: int) -> Outcome:
    outcome = Outcome(time.monotonic(), 0.0, stream=bool(n % 2))
    prompt: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"Count to {n % 7 + 3}."}]
    try:
        if n % 2:  # streamed
            stream = client.chat.completions.create(
                model=MODEL, messages=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
            chunks = list(stream)
            assert chunks[-1].usage is not None, "the stream ended without its usage chunk"
            outcome.request_id, outcome.completion_tokens = chunks[-1].id, chunks[-1].usage.completion_tokens
        else:
            answer = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=8)
            assert answer.usage is not None
            outcome.request_id, outcome.completion_tokens = answer.id, answer.usage.completion_tokens
    except Exception as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended = time.monotonic()
    return outcome


def test_killing_a_gateway_under_load_fails_only_its_requests_and_loses_no_usage(topology: Topology) -> None:
    workers, outcomes, stop = 4, [], threading.Event()
    lock, answered_plain = threading.Lock(), threading.Event()

    def work(w: int) -> None:
        with _client(topology) as client:
            n = w
            while not stop.is_set():
                outcome = _one_request(client, n)
                with lock:
                    outcomes.append(outcome)
                if not outcome.stream and outcome.error is None:
                    answered_plain.set()
                n += workers

    def done_after(t: float) -> int:
        with lock:
            return sum(1 for o in outcomes if o.started > t and o.error is None)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 240
        while done_after(0) < 2 * workers and time.monotonic() < deadline:
            time.sleep(0.1)
        # The kill lands just after a (non-streamed) answer: the moment its usage record must already be safe.
        victim = topology.container("gateway-1")
        answered_plain.clear()
        answered_plain.wait(timeout=60)
        kill_started = time.monotonic()
        docker("kill", victim)
        kill_done = time.monotonic()
        while done_after(kill_done) < 4 * workers and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    answered = [o for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    assert done_after(kill_done) >= 4 * workers, f"the surviving gateway did not serve: {[o.error for o in failed]}"
    # Only a request in flight when the gateway died may fail; every later one is served by the other gateway.
    not_started = [o.error for o in failed if not (o.started < kill_done and o.ended > kill_started)]
    assert not_started == []
    assert len(failed) <= workers
    # Usage: exactly one record per answered request, with the tokens the client was told; at most one more per
    # failed request (the killed gateway may have recorded a request whose answer it could not finish sending).
    ids = {o.request_id.split("-", 1)[1]: o for o in answered if o.request_id}
    assert len(ids) == len(answered)
    deadline = time.monotonic() + 60
    rows = topology.usage_rows()
    while not set(ids) <= set(rows) and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = topology.usage_rows()
    missing = {rid: ids[rid] for rid in sorted(set(ids) - set(rows))}
    assert missing == {}, f"{len(missing)} of {len(ids)} answered requests have no usage record: " + ", ".join(
        f"{rid} ({'streamed' if o.stream else 'not streamed'}, answered {1000 * (kill_started - o.ended):.0f} ms "
        "before the kill)"
        for rid, o in missing.items()
    )
    assert {rid: rows[rid][1] for rid in ids} == {rid: o.completion_tokens for rid, o in ids.items()}
    extra = set(rows) - set(ids)
    assert len(extra) <= len(failed) + 1, extra  # + the streaming test's request
    # The survivor serves through the load balancer; the load balancer stays up.
    assert httpx.get(f"{topology.api}/readyz", timeout=10).status_code == 200
    state = json.loads(docker("inspect", topology.container("gateway-2")).stdout)[0]["State"]
    assert state["Running"] and state["Health"]["Status"] == "healthy"


def test_compose_down_leaves_only_the_volumes(topology: Topology) -> None:
    label = f"label=com.docker.compose.project={topology.project}"
    volumes_before = set(docker("volume", "ls", "-q", "--filter", label).stdout.split())
    topology.compose("down", "--timeout", "20", timeout=300)
    assert docker("ps", "-aq", "--filter", label).stdout.split() == []
    assert docker("network", "ls", "-q", "--filter", label).stdout.split() == []
    declared = set(yaml.safe_load(COMPOSE_FILE.read_text())["volumes"])
    assert set(docker("volume", "ls", "-q", "--filter", label).stdout.split()) == volumes_before
    assert volumes_before == {f"{topology.project}_{v}" for v in declared}
    topology.compose("down", "-v", timeout=300)
    assert docker("volume", "ls", "-q", "--filter", label).stdout.split() == []
