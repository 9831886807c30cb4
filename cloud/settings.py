"""Cloud tier settings (env prefix ``TIERLINE_CLOUD_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CloudSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERLINE_CLOUD_", extra="ignore")

    zoo_preset: str = Field("demo", description="which built zoo preset the cloud serves")
    device: str = Field("cpu", description="torch device for the LLM engines: cpu or cuda")
    kv_cache_mb: int = Field(256, ge=1, description="KV-cache budget per engine, MiB")
    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together per engine step")
    max_num_batched_tokens: int = Field(1024, ge=1, description="token budget per engine step")
    max_num_queued_requests: int = Field(1024, ge=1, description="waiting requests before 429 overloaded")
    speculation: Literal["draft", "ngram", "off"] = Field("draft", description="speculative decoding of lm-cloud")
    cpu_weights: Literal["fp32", "int8"] = Field(
        "fp32",
        description="the CPU engine's weights: int8 is weight-only int8 (one scale per output column) read by the "
        "fused small steps, faster at batch 1 and no longer exact (docs/engine.md)",
    )
    draft_cpu_weights: Literal["fp32", "int8"] = Field(
        "int8",
        description="the speculative draft's CPU weights: int8 makes its steps cheaper; the target verifies every "
        "token it proposes, so outputs do not change",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch threads per engine (default: all cores but one with engine_process, else all)"
    )
    engine_process: bool = Field(
        True, description="run each engine's step loop in a process of its own (false: a thread of the API process)"
    )
    engine_restart_backoff_s: float = Field(
        1.0, gt=0, description="wait before restarting a dead engine child; doubles per failed restart"
    )
    engine_restart_backoff_max_s: float = Field(
        60.0, gt=0, description="longest wait between restarts of a dead engine child"
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="tokens per streamed event at least (a stream's first tokens and its end go out at once): "
        "fewer, larger events for less API work under load",
    )
    decode_burst_ms: float = Field(
        6.0,
        ge=0,
        description="greedy decoding with nothing waiting decodes several tokens a sequence in one fused CPU call, "
        "its tokens after the first as many as fit this many milliseconds (EngineConfig.decode_burst_ms); 0: one "
        "token a step",
    )
    enforce_eager: bool = Field(
        False,
        description="on a CUDA device, run every step eagerly instead of replaying decode and verification steps "
        "from captured CUDA graphs (EngineConfig.enforce_eager)",
    )
    request_timeout_s: float = Field(300.0, gt=0, description="server-side deadline per request")
    idempotency_lease_s: float | None = Field(
        None,
        gt=0,
        description="an Idempotency-Key claim left by a crashed process is taken over by a retry after this "
        "(default: request_timeout_s + 30)",
    )
    max_prompt_bytes: int | None = Field(
        None,
        ge=1,
        description="largest prompt (UTF-8 bytes; a chat's messages together) tokenised; above it: 413 "
        "(default: a quarter of max_body_bytes)",
    )
    budget_lease_margin_s: float = Field(
        60.0, gt=0, description="a budget reservation's lease outlasts the request deadline by this much"
    )
    backends: Path | None = Field(
        None,
        description="a JSON file of served models backed by OpenAI-compatible servers (docs/backends.md)",
    )
    registry_models: str | None = Field(
        None,
        description="registry models to serve (causal-lm and tensor): unset, '*' or 'all': every one (a causal-lm "
        "version loads at its first request); a comma-separated list: only those (loaded at start-up); empty: none",
    )
    tensor_memory_mb: int = Field(
        2048,
        ge=0,
        description="memory for loaded registry tensor models (each charged its artifact's size); a model that does "
        "not fit unloads the least-recently-used idle ones; 0: no limit",
    )
    tensor_max_batch_size: int = Field(64, ge=1, description="most rows one tensor-model batch runs")
    tensor_max_queue_delay_ms: float = Field(
        2.0, ge=0, description="how long a tensor call waits for others to share its batch"
    )
    tensor_max_queue_size: int = Field(
        4096, ge=1, description="tensor calls waiting per model before 429 (the batch running not counted)"
    )
    canary_refresh_s: float = Field(5.0, gt=0, description="how often rollout plans are re-read for canary routing")
    budget_sweep_interval_s: float = Field(
        30.0, gt=0, description="how often reservations of dead processes (lease expired) are released"
    )
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest accepted request body")
    tenant_requests_per_minute: int = Field(0, ge=0, description="default per-tenant request rate; 0 = unlimited")
    tenant_tokens_per_minute: int = Field(0, ge=0, description="default per-tenant token rate; 0 = unlimited")
    tenant_max_concurrent: int = Field(0, ge=0, description="default per-tenant in-flight requests; 0 = unlimited")
    key_requests_per_minute: int = Field(0, ge=0, description="default per-key request rate; 0 = unlimited")
    key_tokens_per_minute: int = Field(0, ge=0, description="default per-key token rate; 0 = unlimited")
    key_max_concurrent: int = Field(0, ge=0, description="default per-key in-flight requests; 0 = unlimited")
    auth_cache_s: float = Field(
        1.0,
        ge=0,
        description="how long a verified API key is trusted without a database read: a key revoked or a tenant "
        "disabled elsewhere stops working within this; 0: read on every request",
    )
    jwt_issuer: str | None = Field(None, description="accept JWT bearer tokens from this issuer (iss)")
    jwt_public_key_file: Path | None = Field(None, description="the issuer's public key (PEM)")
    jwt_jwks_file: Path | None = Field(None, description="the issuer's JWKS (JSON file)")
    jwt_audience: str | None = Field(None, description="the aud claim every JWT must carry (required with an issuer)")
    jwt_verify_audience: bool = Field(
        True, description="false: accept the issuer's tokens for any audience (only for an issuer minting for us alone)"
    )
    jwt_tenant_claim: str = Field("tenant", description="claim naming the tenant")
    usage_flush_ms: int = Field(
        200, ge=10, description="usage records are written this long after the first of a batch is queued"
    )
    usage_write_through: bool = Field(
        True,
        description="a finished request's usage record is committed before its answer is sent (records awaited "
        "together share one commit); false: queued, and a kill -9 within usage_flush_ms loses it",
    )
    usage_checkpoint_tokens: int = Field(
        32,
        ge=0,
        description="a stream's usage so far is written durably before its first bytes (with its budget "
        "reservation when it has one) and then before it sends "
        "more once this many completion tokens were generated since the last write: a crash (kill -9) bills all "
        "but this tail; 0: no checkpoints (a crash mid-stream bills nothing)",
    )
    usage_checkpoint_ms: int = Field(
        1000,
        ge=0,
        description="... or once this many ms passed since the last write with new tokens (0: by tokens only)",
    )
    edge_sync_interval_s: float = Field(30.0, gt=0, description="how often enrolled agents sync (told at enroll)")
    edge_shadow_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of edge-answered requests the cloud answers again in the background for the quality "
        "monitor, billed as shadow usage (told at each sync; 0: off)",
    )
    edge_shadow_rows_per_minute: int = Field(
        600, ge=0, description="most shadow inputs the cloud answers per device and minute (more: 429)"
    )
    edge_shadow_tokens_per_minute: int = Field(
        60_000,
        ge=0,
        description="most LM shadow tokens (prompts and generated) the cloud answers per device and minute (more: 429)",
    )
    edge_usage_max_future_s: float = Field(
        300.0,
        ge=0,
        description="a device's usage record dated more than this ahead of the cloud's clock is booked now "
        "(reported_at keeps the device's time; counted in tierline_usage_clamped_total)",
    )
    edge_usage_max_age_days: float = Field(
        35.0,
        gt=0,
        description="... and one older than this when synced is booked at this age (a closed period stays closed)",
    )
    edge_usage_enrollment_margin_s: float = Field(
        3600.0,
        ge=0,
        description="... and one dated more than this before its device's enrollment is booked at that time",
    )
    edge_usage_default_context: int = Field(
        131_072,
        ge=1,
        description="context length assumed for a device's model the registry does not describe (usage bounds)",
    )
    edge_usage_max_sequences: int = Field(
        8, ge=1, description="prompts x choices one device usage record may hold (beyond: quarantined)"
    )
    edge_usage_max_tokens_per_s: float = Field(
        100_000.0, gt=0, description="a device's synced tokens per second since its previous sync, at most"
    )
    edge_usage_burst_tokens: int = Field(
        4_000_000, ge=0, description="tokens a sync may carry on top of that rate (a first sync, a short interval)"
    )
    edge_shadow_share_floor: int = Field(
        8192, ge=0, description="shadow work a device may replay beyond its share of the edge work it reported"
    )
    edge_shadow_share_window_s: float = Field(
        3600.0, gt=0, description="the window over which a device's shadow replays are held to its share"
    )

    def idempotency_lease(self) -> float:
        """How long an Idempotency-Key claim holds: past the request deadline, so a live request keeps its claim."""
        return self.idempotency_lease_s or self.request_timeout_s + 30.0

    def prompt_byte_limit(self) -> int:
        return self.max_prompt_bytes or self.max_body_bytes // 4
