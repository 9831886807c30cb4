"""The wire protocol between edge agents and the cloud: enroll, sync (outbox up, desired state down), escalate.

Pydantic models, so both sides validate the same shapes and errors name the field. Record ids are chosen by
the device (uuid4 hex); the cloud stores a device's usage under an id namespaced by its tenant and device, so
re-sending a batch never counts a record twice and no device can take an id another source uses.

What a device sends is bounded to what the cloud's arithmetic and database hold: integers to 32 bits, floats
finite (``inf`` and ``nan`` refused) and within range, free-form objects (runtime facts, metrics, event payloads,
an escalation's body) at most ``MAX_JSON_DEPTH`` levels deep, checked before anything walks them
(``shared.json_bounds``). A value out of bounds is a 400 naming the field, never a 500.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from shared.json_bounds import check_json

MAX_BATCH = 1000
MAX_INT32 = (1 << 31) - 1
MAX_UNIX_S = 253402300799.0  # 9999-12-31T23:59:59Z: the last second a datetime (and the database) can hold
MAX_DURATION_MS = 1e9  # about 11.6 days: no request's latency comes near it
MAX_LABELS = 64


def _bounded(value: dict[str, Any]) -> dict[str, Any]:
    check_json(value)
    return value


# A free-form object from a device: stored as JSON and walked by the cloud, so bounded in depth before it is.
FreeJson = Annotated[dict[str, Any], AfterValidator(_bounded)]
UnixSeconds = Annotated[float, Field(ge=0, le=MAX_UNIX_S, allow_inf_nan=False)]
Duration = Annotated[float, Field(ge=0, le=MAX_DURATION_MS, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class _Strict(BaseModel):
    """What a device sends: the cloud refuses a field it does not know (a typo must not be silently dropped)."""

    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    """What the cloud answers: a device ignores fields newer than itself, so a cloud upgraded before its fleet
    (the usual order) never breaks the agents still running the previous release."""

    model_config = ConfigDict(extra="ignore")


class EnrollRequest(_Strict):
    token: str = Field(min_length=8, max_length=256, description="one-time enrollment token (tle-...)")
    name: str = Field("", max_length=128, description="a human name for the device")
    labels: dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=MAX_LABELS, description="merged over the token's labels"
    )
    agent_version: str = Field("", max_length=32)
    runtime: FreeJson = Field(default_factory=dict, description="host and runtime summary")


class EnrollResponse(_Answer):
    device_id: str
    device_token: str = Field(description="the device's bearer credential (tld-...); shown once")
    tenant: str
    signing_public_keys: list[str] = Field(description="PEM Ed25519 public keys that sign model artifacts")
    sync_interval_s: float


MAX_USAGE_SUBJECT = 128  # an end user id on an edge usage record; an agent truncates a longer one
# A usage record's token count: what the cloud's BIGINT columns hold (more: 400). A count the device could not have
# served (past its model's context) is quarantined, not billed (``controlplane.fleet.devices.UsageBounds``).
MAX_TOKEN_COUNT = 2**63 - 1


class UsageItem(_Strict):
    id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    model: str = Field(max_length=128)
    model_version: str | None = Field(None, max_length=64)
    tier: Literal["edge", "cloud"] = "edge"
    prompt_tokens: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    completion_tokens: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    status: Literal["ok", "error", "abandoned", "degraded"] = "ok"
    latency_ms: Duration | None = None
    ttft_ms: Duration | None = None
    escalation_reason: str | None = Field(None, max_length=32)
    occurred_at: UnixSeconds = Field(description="unix seconds on the device")
    subject: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_USAGE_SUBJECT,
        description="the request's end user (x-tierline-subject, else its user field): whose budgets the record "
        "counts against; absent, the device's billing.user label. Optional: older agents and clouds omit it",
    )


class EventItem(_Strict):
    id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    kind: Literal["telemetry", "event"]
    payload: FreeJson = Field(default_factory=dict)
    occurred_at: UnixSeconds


class SyncRequest(_Strict):
    agent_version: str = Field("", max_length=32)
    runtime: FreeJson = Field(default_factory=dict)
    models: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=256)]] = Field(
        default_factory=dict, max_length=MAX_BATCH, description="model -> version loaded now"
    )
    policies: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=256)]] = Field(
        default_factory=dict,
        description="model -> escalation policy in use: the cloud's version number, 'override' (the device's own "
        "policy file) or 'default'",
        max_length=MAX_BATCH,
    )
    metrics: FreeJson = Field(default_factory=dict, description="per model version: requests, errors, p50...")
    usage: list[UsageItem] = Field(default_factory=list, max_length=MAX_BATCH)
    events: list[EventItem] = Field(default_factory=list, max_length=MAX_BATCH)


class DesiredModel(_Answer):
    name: str
    version: str
    sha256: str
    manifest_url: str = Field(description="relative to the cloud's base URL")


class DesiredPolicy(_Answer):
    """An escalation policy version the cloud wants the device to use, signed with the registry's key."""

    model: str = Field(max_length=128)
    version: int
    target: list[dict[str, str]] = Field(default_factory=list, description="the device selector it was sent under")
    policy: dict[str, Any] = Field(description="the EdgePolicy JSON (shared.escalation)")
    key_id: str
    signature: str = Field(description="base64 Ed25519 over shared.policy_signing.canonical_bytes")


class ModelPairing(_Answer):
    """Which cloud model an edge model escalates to, from the registry (``tierline models pair``), sent at sync.

    An edge model with no pairing (or ``cloud_model`` null) never escalates: it answers locally and says so
    (``x-tierline-escalation: unpaired``)."""

    model: str = Field(max_length=128, description="the edge model, by the name the device serves it under")
    cloud_model: str | None = Field(description="the cloud model its escalations go to; null: it answers locally")
    resend: Literal["as-sent", "text"] = Field(
        "as-sent",
        description="as-sent: the request body goes up unchanged (the two tokenizers share a vocabulary); text: "
        "a prompt given as token ids is decoded with the edge model's tokenizer and sent as text (they do not)",
    )


class Allowance(_Answer):
    """What the device may still spend, as of the sync (records just synced included): what is left of the
    tightest hard budget its traffic counts against (its tenant's, and its key's, project's, end user's)."""

    remaining: Decimal | None = Field(
        description="budget minus settled spend minus open reservations, never below 0; null: no budget (unlimited)"
    )
    currency: str = Field(max_length=3)
    period: str = Field(description="YYYY-MM (UTC)")
    budget: str | None = Field(
        None, max_length=300, description='the budget that sets it, e.g. "the daily budget of API key 12"'
    )

    @property
    def is_exhausted(self) -> bool:
        return self.remaining is not None and self.remaining <= 0


class SyncResponse(_Answer):
    accepted: int = Field(description="records new to the cloud")
    duplicates: int = Field(description="records the cloud already had (a retried batch)")
    conflicts: int = Field(0, description="usage records not stored: their id holds a record with another payload")
    clamped: int = Field(0, description="usage records dated outside the accepted window, booked at its edge")
    quarantined: int = Field(
        0,
        description="usage records beyond what the device could have done (its model's context, its rate): stored "
        "for the operator, not billed",
    )
    desired: list[DesiredModel] = Field(default_factory=list)
    policies: list[DesiredPolicy] = Field(default_factory=list, description="escalation policies for this device")
    pairings: list[ModelPairing] = Field(
        default_factory=list, description="edge model -> cloud model, for every model this device is sent"
    )
    config: dict[str, Any] = Field(default_factory=dict)
    server_time: float
    allowance: Allowance | None = Field(None, description="the tenant's remaining allowance (absent: unknown)")


class EscalateRequest(_Strict):
    endpoint: Literal["chat.completions", "completions", "inference"]
    reason: str = Field(
        max_length=32,
        pattern=r"^(?:[!-~](?:[ -~]*[!-~])?)?$",
        description="why the device escalated (policy signal or pre-signal); printable ASCII without leading or "
        "trailing spaces, as it is echoed in the x-tierline-escalation-reason response header",
    )
    request_id: str | None = Field(None, max_length=64, description="the device's record id, reused for metering")
    body: FreeJson = Field(description="the OpenAI request body, as the client sent it")


def version_number(version: str | None) -> int | None:
    """A cloud version number from an agent's version string; edge versions are names (``tiny-2``): ``None``.

    ASCII digits only: ``str.isdigit`` also accepts characters such as ``²`` that ``int`` refuses; a number past
    32 bits is no version the registry gave (its column could not hold it): ``None`` as well.
    """
    if not (version and version.isascii() and version.isdigit()) or len(version) > 20:
        return None
    number = int(version)
    return number if number <= MAX_INT32 else None


MAX_SHADOW_ROWS = 64
MAX_SHADOW_TOKENS = 32  # an LM sample's generated tokens: the exact-line task's lines (24 tokens at most) fit whole
MAX_SHADOW_PROMPT_TOKENS = 32768
MAX_SHADOW_LM_SAMPLES = 8


def vocabulary_sha256(tokenizer: Any) -> str:
    """What makes token ids comparable between two models: the sha256 of the id -> token map of a ``tokenizers``
    tokenizer (added tokens included). Two models with the same map read the same ids as the same text, whatever
    their normalisers (the ids are compared, never re-encoded)."""
    import hashlib
    import json

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    ordered = sorted(((int(i), str(t)) for t, i in vocab.items()), key=lambda it: it[0])
    return hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode()).hexdigest()


class LMShadowSample(_Strict):
    """One LM request the device answered itself: the prompt's token ids and the first generated token ids."""

    prompt_ids: list[TokenId] = Field(
        min_length=1, max_length=MAX_SHADOW_PROMPT_TOKENS, description="the prompt as the edge model read it"
    )
    edge_tokens: list[TokenId] = Field(
        min_length=1,
        max_length=MAX_SHADOW_TOKENS,
        description="the edge's generated token ids (greedy), the first MAX_SHADOW_TOKENS of them",
    )
    confidence: Finite = Field(description="the policy's signal for the answer")


class ShadowRequest(_Strict):
    """Edge-answered inputs for the cloud to answer again in the background (the live quality monitor): never
    returned to a client; the cloud bills the work as ``shadow`` usage once per ``id``.

    A classifier batch carries ``inputs``, ``edge_answers`` and ``confidences`` (one per row; what every agent
    sends); an LM batch carries ``lm_samples`` and ``vocabulary_sha256`` instead (agents from this release on).
    """

    id: str = Field(min_length=8, max_length=48, pattern=r"^[A-Za-z0-9_-]+$", description="the device's batch id")
    model: str = Field(max_length=128, description="the edge model that answered")
    cloud_model: str = Field(max_length=128, description="the cloud model to answer again with")
    policy_version: int = Field(ge=1, le=MAX_INT32, description="the cloud's escalation policy version the device ran")
    inputs: list[list[Finite]] = Field(default_factory=list, max_length=MAX_SHADOW_ROWS)
    edge_answers: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] = Field(
        default_factory=list, max_length=MAX_SHADOW_ROWS, description="the predicted classes"
    )
    confidences: list[Finite] = Field(
        default_factory=list, max_length=MAX_SHADOW_ROWS, description="the policy's signal"
    )
    lm_samples: list[LMShadowSample] = Field(default_factory=list, max_length=MAX_SHADOW_LM_SAMPLES)
    vocabulary_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="the edge LM's vocabulary (``vocabulary_sha256``): the cloud compares token ids only when its "
        "model's is the same",
    )
    occurred_at: UnixSeconds

    @property
    def is_lm(self) -> bool:
        return bool(self.lm_samples)

    @model_validator(mode="after")
    def _one_kind(self) -> ShadowRequest:
        if self.lm_samples:
            if self.inputs or self.edge_answers or self.confidences:
                raise ValueError("a batch carries either lm_samples or inputs, edge_answers and confidences, not both")
            if self.vocabulary_sha256 is None:
                raise ValueError("vocabulary_sha256: required with lm_samples")
            return self
        if not self.inputs:
            raise ValueError("inputs: a batch needs at least one input (or lm_samples)")
        if len(self.edge_answers) != len(self.inputs) or len(self.confidences) != len(self.inputs):
            raise ValueError("edge_answers and confidences: one per input")
        return self


class ShadowResponse(_Answer):
    num_samples: int
    num_agreements: int
    duplicate: bool = Field(False, description="a retry of a batch the cloud already has: nothing was redone")
    token_agreement: float | None = Field(
        None, description="LM batches: the share of the edge's generated positions where the cloud chose the same token"
    )
