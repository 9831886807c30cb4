"""The agent's moving parts behind the local API: per-version stats, the outbox of usage records, and the sync
loop that delivers them to the cloud and brings back the desired state."""

from __future__ import annotations

import asyncio
import logging
import platform
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version as package_version
from typing import Any

from edge_agent.cloud_link import CloudLink, CloudUnavailableError
from edge_agent.outbox import Outbox
from edge_agent.tiering import Served
from shared.edge_protocol import (
    MAX_BATCH,
    MAX_USAGE_SUBJECT,
    Allowance,
    DesiredModel,
    DesiredPolicy,
    EventItem,
    ModelPairing,
    SyncRequest,
    SyncResponse,
    UsageItem,
)

logger = logging.getLogger(__name__)

AGENT_VERSION = package_version("tierline")


def memory_mb() -> int | None:
    """The host's physical memory in MiB (None where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20))
    except (AttributeError, ValueError, OSError):
        return None


def runtimes() -> list[str]:
    """The inference runtimes this agent can run: ONNX Runtime, LiteRT (``tflite``) and llama.cpp (GGUF,
    ``tierline[edge-gguf]``), each when installed."""
    from edge_agent.runtime import installed_runtimes

    return installed_runtimes()


def runtime_summary() -> dict[str, Any]:
    """The device's facts, reported at enrollment and every sync; releases and policies target them
    (``shared.targeting``: device.arch, device.memory_mb, device.cpus, device.runtime, device.system)."""
    import os

    found = runtimes()
    summary: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count() or 0,
        "memory_mb": memory_mb(),
        "runtimes": found,
    }
    if "onnxruntime" in found:
        import onnxruntime

        summary["onnxruntime"] = onnxruntime.__version__
    return summary


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


@dataclass(slots=True)
class VersionStats:
    requests: int = 0
    local: int = 0  # answered on the device (degraded ones included)
    escalations: int = 0  # answered by the cloud
    errors: int = 0
    degraded: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2048))

    def as_json(self) -> dict[str, Any]:
        lat = list(self.latencies_ms)
        return {
            "requests": self.requests,
            "local": self.local,
            "errors": self.errors,
            "escalations": self.escalations,
            "degraded": self.degraded,
            "escalation_rate": round(self.escalations / self.requests, 4) if self.requests else 0.0,
            "p50_ms": _quantile(lat, 0.5),
            "p95_ms": _quantile(lat, 0.95),
        }


class AgentStats:
    """Counters per local model version (``model@version``), for sync heartbeats and ``/metrics``."""

    def __init__(self, versions: dict[str, str]) -> None:
        self.versions = versions  # model id -> version loaded now
        self.by_key: dict[str, VersionStats] = {}

    def key(self, model: str) -> str:
        return f"{model}@{self.versions.get(model, 'cloud')}"

    def observe(self, served: Served) -> None:
        s = self.by_key.setdefault(self.key(served.model), VersionStats())
        s.requests += 1
        if served.status == "error":
            s.errors += 1
        elif served.tier == "cloud":
            s.escalations += 1
        else:
            s.local += 1
        s.degraded += served.degraded
        s.prompt_tokens += served.prompt_tokens
        s.completion_tokens += served.completion_tokens
        s.latencies_ms.append(served.latency_ms)

    def snapshot(self) -> dict[str, Any]:
        return {k: v.as_json() for k, v in sorted(self.by_key.items())}

    def prometheus(self, outbox: dict[str, Any], breaker: str | None) -> str:
        lines = [
            "# HELP tierline_edge_requests_total Requests per local model version, by outcome.",
            "# TYPE tierline_edge_requests_total counter",
        ]
        for key, s in sorted(self.by_key.items()):
            model, _, version = key.partition("@")
            labels = f'model="{model}",version="{version}"'
            lines.append(f'tierline_edge_requests_total{{{labels},outcome="local"}} {s.local}')
            lines.append(f'tierline_edge_requests_total{{{labels},outcome="escalated"}} {s.escalations}')
            lines.append(f'tierline_edge_requests_total{{{labels},outcome="error"}} {s.errors}')
        lines += [
            "# HELP tierline_edge_degraded_total Requests answered locally because the cloud was unreachable.",
            "# TYPE tierline_edge_degraded_total counter",
            f"tierline_edge_degraded_total {sum(s.degraded for s in self.by_key.values())}",
            "# HELP tierline_edge_outbox_pending Records waiting for delivery to the cloud, by kind.",
            "# TYPE tierline_edge_outbox_pending gauge",
        ]
        for kind, n in sorted(outbox.get("pending", {}).items()):
            lines.append(f'tierline_edge_outbox_pending{{kind="{kind}"}} {n}')
        if breaker is not None:
            lines += [
                "# HELP tierline_edge_cloud_breaker_open 1 while the circuit breaker to the cloud is open.",
                "# TYPE tierline_edge_cloud_breaker_open gauge",
                f"tierline_edge_cloud_breaker_open {int(breaker == 'open')}",
            ]
        return "\n".join(lines) + "\n"


class Agent:
    """Records what the device served and syncs it with the cloud."""

    def __init__(self, outbox: Outbox, stats: AgentStats, link: CloudLink | None, interval_s: float) -> None:
        self.outbox = outbox
        self.stats = stats
        self.link = link
        self.interval_s = interval_s
        self.on_desired: Callable[[list[DesiredModel]], None] | None = None
        self.on_outcome: Callable[[str, str | None, bool], None] | None = None  # model id, version, ok
        self.on_allowance: Callable[[Allowance | None], None] | None = None
        self.on_policies: Callable[[list[DesiredPolicy]], None] | None = None
        self.on_pairings: Callable[[list[ModelPairing]], None] | None = None
        self.policy_sources: Callable[[], dict[str, str]] = dict  # model -> policy in use, for the sync report
        # model -> the runtime guard's choice and numbers, reported as runtime["serving"] (edge_agent.runtime_guard)
        self.serving: Callable[[], dict[str, Any]] = dict
        self.last_sync: SyncResponse | None = None
        self.synced_records = 0

    def record(self, served: Served) -> None:
        """Called for every answered request, before its answer leaves (usage records are never lost)."""
        self.stats.observe(served)
        if served.tier != "edge":
            return  # the cloud metered it under the same request id
        if self.on_outcome is not None:  # a client that hangs up mid-stream ("abandoned") is no model fault
            self.on_outcome(served.model, self.stats.versions.get(served.model), served.status != "error")
        item = UsageItem(
            id=served.request_id,
            model=served.model,
            model_version=self.stats.versions.get(served.model),
            tier="edge",
            prompt_tokens=served.prompt_tokens,
            completion_tokens=served.completion_tokens,
            status="degraded" if served.degraded else served.status,
            latency_ms=served.latency_ms,
            ttft_ms=served.ttft_ms,
            escalation_reason=served.escalation_reason,
            occurred_at=time.time(),
            subject=served.subject[:MAX_USAGE_SUBJECT] if served.subject else None,
        )
        self.outbox.put("usage", item.model_dump(mode="json"), record_id=served.request_id)

    def event(self, kind: str, payload: dict[str, Any]) -> None:
        self.outbox.put("event", {"type": kind, **payload})

    async def sync_once(self) -> SyncResponse | None:
        """One heartbeat with one outbox batch; None when the cloud is unreachable (the batch stays)."""
        if self.link is None:
            return None
        records = await asyncio.to_thread(self.outbox.batch, MAX_BATCH)
        usage = [UsageItem.model_validate(r.payload) for r in records if r.kind == "usage"]
        events = [
            EventItem(
                id=r.id,
                kind="telemetry" if r.kind == "telemetry" else "event",
                payload=r.payload,
                occurred_at=r.created_at,
            )
            for r in records
            if r.kind != "usage"
        ]
        request = SyncRequest(
            agent_version=AGENT_VERSION,
            runtime={**runtime_summary(), **({"serving": serving} if (serving := self.serving()) else {})},
            models=dict(self.stats.versions),
            policies=self.policy_sources(),
            metrics=self.stats.snapshot(),
            usage=usage,
            events=events,
        )
        try:
            answer = await self.link.sync(request)
        except CloudUnavailableError:
            await asyncio.to_thread(self.outbox.nack, [r.id for r in records])
            return None
        await asyncio.to_thread(self.outbox.ack, [r.id for r in records])
        self.synced_records += len(records)
        self.last_sync = answer
        if self.on_allowance is not None:
            self.on_allowance(answer.allowance)
        if self.on_policies is not None:
            self.on_policies(answer.policies)
        if self.on_pairings is not None:
            self.on_pairings(answer.pairings)
        if answer.desired and self.on_desired is not None:
            self.on_desired(answer.desired)
        if "sync_interval_s" in answer.config:
            self.interval_s = float(answer.config["sync_interval_s"])
        return answer

    async def drain(self) -> bool:
        """A heartbeat, then more batches until the outbox is empty; False when the cloud did not answer."""
        while True:
            if await self.sync_once() is None:
                return False
            if sum(self.outbox.stats()["pending"].values()) == 0:
                return True

    def sample(self) -> None:
        """A telemetry sample per sync tick, so the cloud sees the device's history across an outage."""
        box = self.outbox.stats()
        metrics = self.stats.snapshot()
        sample = {"metrics": metrics, "outbox": box["pending"], "dropped": box["dropped_telemetry"]}
        self.outbox.put("telemetry", sample)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s * random.uniform(0.8, 1.2))
            try:
                await asyncio.to_thread(self.sample)
                await self.drain()
            except Exception:
                logger.exception("sync failed; records stay in the outbox and are retried")
