"""Where a request is answered: on the device, or escalated to the cloud.

Modes (per model from its policy, per request from the ``x-tierline-tier`` header or the ``tier`` field):
- ``local-first`` (default): pre-signals first (model not on the device, prompt too long for the local
  context, ``max_tokens`` above the policy's bound, ``quality: "high"``, a cloud-only feature such as
  ``n > 1``, penalties or the prompt's logprobs) send the request up at once; otherwise the local answer is
  generated and its confidence (the policy's signal against its calibrated threshold) decides whether it is returned or
  the request is escalated.
- ``cloud-first``: the cloud answers; when it is unreachable, the local model does (marked degraded).
- ``local-only`` / ``cloud-only``: no fallback.
``tier: "edge"`` and ``tier: "cloud"`` are accepted as ``local-only`` and ``cloud-only``.

Streams in local-first mode: the agent generates the first ``stream_window`` tokens locally before sending
anything, decides on them, and then either streams those tokens and the rest from the device, or drops
them and relays the cloud's stream. The trade-off: time to first token grows by the window's local decode
time, and the decision sees only the window (a confident start can still end badly), in exchange for never
showing the client tokens that are later replaced.

Which cloud model an edge model escalates to is its *pairing*, sent by the cloud at sync
(:class:`shared.edge_protocol.ModelPairing`, by the model's id or its plain id): an edge model with no pairing
never escalates. On an enrolled device it answers locally with ``x-tierline-escalation: unpaired``, and a
``cloud-only`` request to it is refused (400 ``no_cloud_pair``). A pairing with ``resend: "text"`` (the two
models' tokenizers differ) sends a completions prompt given as token ids up as the text the edge model's
tokenizer decodes it to.

When the cloud cannot be reached in time (or the breaker is open), a request that can be answered locally
is, with ``x-tierline-degraded: cloud-unreachable``. Every request answered on the device becomes a usage
record in the outbox; an escalated one is metered by the cloud under the same request id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent import serving
from edge_agent.allowance import QUOTA_REASON, AllowanceGuard
from edge_agent.cloud_link import CloudLink, CloudUnavailableError
from edge_agent.generation import LocalStep, ModelFaultError
from edge_agent.shadow_sampler import ShadowSampler
from edge_agent.tensors import LocalClassifier, row_confidences
from shared.edge_protocol import MAX_USAGE_SUBJECT, ModelPairing
from shared.errors import ApplicationError, NotFoundError, ServiceUnavailableError, ValidationError, default_code
from shared.escalation import COPY_SIGNALS, HIDDEN_PROBE, MODES, EdgePolicy, copy_signals
from shared.logs import server_request_id
from shared.openai_schema import ChatCompletionRequest, CompletionRequest, InferenceRequest, check_end_user

logger = logging.getLogger(__name__)

TIER_ALIASES = {"edge": "local-only", "cloud": "cloud-only"}
LOCAL_SUFFIXES = ("-onnx-int8", "-onnx", "-tflite", "-gguf")
ZOO_NAMESPACE = "tierline/"
UNPAIRED = "unpaired"  # x-tierline-escalation on an answer of an edge model that has no cloud pair
STRIP_FIELDS = ("tier", "quality")
DEFAULT_MARGIN = 0.5  # uncalibrated classifiers: a top-1 minus top-2 probability below this escalates


@dataclass(slots=True)
class Answer:
    body: dict[str, Any] | AsyncIterator[bytes]
    tier: str  # edge | cloud
    reason: str | None = None
    degraded: str | None = None
    status_code: int = 200
    request_id: str = ""  # the usage id: the outbox record's for edge answers, the cloud's for escalations
    escalation: str | None = None  # "unpaired": the model has no cloud pair, so it never escalates
    # An escalated answer's ``model`` is the cloud model that produced it (OpenAI's "the model used"); the model
    # the client asked the device for travels in ``x-tierline-requested-model``.
    requested_model: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        h = {"x-tierline-tier": self.tier}
        if self.requested_model:
            h["x-tierline-requested-model"] = self.requested_model
        if self.escalation:
            h["x-tierline-escalation"] = self.escalation
        if self.request_id:
            h["x-tierline-usage-id"] = self.request_id
        if self.reason:
            h["x-tierline-escalation-reason"] = self.reason
        if self.degraded:
            h["x-tierline-degraded"] = self.degraded
        return h


@dataclass(slots=True, kw_only=True)
class Served:
    """What the usage record and the per-version stats need about one answered request."""

    request_id: str
    model: str
    tier: str
    prompt_tokens: int
    completion_tokens: int
    status: str
    latency_ms: float
    ttft_ms: float | None
    escalation_reason: str | None
    degraded: bool
    subject: str | None = None  # the end user (x-tierline-subject, else the request's user): whose budgets it counts


def family(model: str) -> str:
    for suffix in LOCAL_SUFFIXES:
        if model.endswith(suffix):
            return model[: -len(suffix)]
    return model


@dataclass(slots=True)
class Tiering:
    local: serving.LocalModels
    link: CloudLink | None
    policies: dict[str, EdgePolicy]
    on_served: Callable[[Served], None]
    classifiers: dict[str, LocalClassifier] = field(default_factory=dict)
    pairings: dict[str, ModelPairing] = field(default_factory=dict)  # edge model -> its cloud pair (the sync's)
    families: dict[str, str] = field(default_factory=dict)  # an export's id -> its plain model id
    aliases: dict[str, str] = field(default_factory=dict)  # a plain model id -> the export's id it serves
    allowance: AllowanceGuard = field(default_factory=AllowanceGuard)
    shadow: ShadowSampler | None = None  # the quality monitor's: told the rows answered on the edge
    # The cloud's rule for the end users this device's requests may name (its last sync's config["end_users"]:
    # {"default": its billing.user, "may_name_others": bool}); None until a sync told it (the cloud still decides).
    end_users: Callable[[], dict[str, Any] | None] = lambda: None

    def policy(self, model: str) -> EdgePolicy:
        return self.policies.get(model) or self.policies.get(family(model)) or EdgePolicy(model=family(model))

    def pairing(self, model: str) -> ModelPairing | None:
        """The pairing of ``model``: its own, else (a plain model id) the export's it serves, else its plain model
        id's (the group's). The cloud names a zoo release as it was published (``lm-edge-onnx``), the device in
        the ``tierline/`` namespace: either matches."""
        for name in (model, self.aliases.get(model), self.families.get(model), family(model)):
            if name is None:
                continue
            for key in (name, name.removeprefix(ZOO_NAMESPACE)):
                if key in self.pairings:
                    return self.pairings[key]
        return None

    def cloud_model(self, model: str) -> str | None:
        """The cloud model ``model`` escalates to; None for an edge model with no pairing (it never escalates).
        A model this device does not have goes up under its own name."""
        pairing = self.pairing(model)
        if pairing is not None:
            return pairing.cloud_model
        return None if self._is_local(model) else model

    def _is_local(self, model: str) -> bool:
        return (self.local is not None and self.local.has(model)) or model in self.classifiers

    def mode(self, model: str, header: str | None, req: ChatCompletionRequest | CompletionRequest) -> str:
        wanted = header or req.tier
        if wanted:
            mode = TIER_ALIASES.get(wanted, wanted)
            if mode not in MODES:
                raise ValidationError(
                    f"x-tierline-tier: {wanted!r} is not one of {', '.join((*MODES, *TIER_ALIASES))}", param="tier"
                )
            return mode
        return self.policy(model).mode

    async def handle(
        self,
        endpoint: serving.Endpoint,
        req: ChatCompletionRequest | CompletionRequest,
        header: str | None,
        subject: str | None = None,
    ) -> Answer:
        """Answer locally or escalate. ``subject`` (``x-tierline-subject``) names the end user in place of the
        request's ``user``, for its usage record and, as ``user``, for an escalation (as the cloud reads it)."""
        started = time.monotonic()
        request_id = server_request_id()
        subject = self._end_user(subject, req.user)
        if subject:
            req = req.model_copy(update={"user": subject})
        try:
            if self.link is not None and self.cloud_model(req.model) is None:
                return await self._unpaired(endpoint, req, header, request_id, started)
            return await self._handle(endpoint, req, header, request_id, started)
        except ModelFaultError:
            # The runtime failed on a valid request: counted against the model version (the health watch rolls
            # a freshly installed version back on these), then answered as a 500 by the error handler. Bad
            # input is refused before the runtime sees it and counts against nothing.
            self._served(
                Served(
                    request_id=request_id,
                    model=req.model,
                    tier="edge",
                    prompt_tokens=0,
                    completion_tokens=0,
                    status="error",
                    latency_ms=_ms(started),
                    ttft_ms=None,
                    escalation_reason=None,
                    degraded=False,
                    subject=req.user,
                )
            )
            raise

    def _end_user(self, header: str | None, user: str | None) -> str | None:
        """The end user a request names (the header, else ``user``): refused (400, naming the one that named it)
        when it is longer than a usage record holds, or when the cloud's rule says this device may name no one
        but its own end user (its enrollment lacks ``billing.subjects=any``)."""
        user = check_end_user(user, "user", MAX_USAGE_SUBJECT)
        header = check_end_user(header, "x-tierline-subject", MAX_USAGE_SUBJECT)
        named, param = (header, "x-tierline-subject") if header else (user, "user")
        rule = self.end_users()
        if named is None or rule is None or rule.get("may_name_others") or named == rule.get("default"):
            return named
        own = f"its own end user '{rule['default']}'" if rule.get("default") else "no end user"
        raise ValidationError(
            f"{param}: this device may not name an end user: its requests count against {own} (the enrollment "
            "token's billing.user); to let them name others, enroll it with a token labelled billing.subjects=any",
            param=param,
            code="end_user_not_allowed",
        )

    async def _unpaired(
        self,
        endpoint: serving.Endpoint,
        req: ChatCompletionRequest | CompletionRequest,
        header: str | None,
        request_id: str,
        started: float,
    ) -> Answer:
        """An edge model with no cloud pair: answered here, whatever its policy says."""
        if self.mode(req.model, header, req) == "cloud-only":
            raise ValidationError(
                f"the model '{req.model}' has no cloud pair: it is answered on this device only "
                "(drop x-tierline-tier: cloud-only)",
                param="tier",
                code="no_cloud_pair",
            )
        self.allowance.must_escalate(can_escalate=False)  # refuses when the allowance is used up
        answer = await self._handle(endpoint, req, "local-only", request_id, started)
        answer.escalation = UNPAIRED
        return answer

    async def _handle(
        self,
        endpoint: serving.Endpoint,
        req: ChatCompletionRequest | CompletionRequest,
        header: str | None,
        request_id: str,
        started: float,
    ) -> Answer:
        mode = self.mode(req.model, header, req)
        if self.link is None:
            if mode == "cloud-only":
                raise ServiceUnavailableError("this device is not enrolled with a cloud (tierline edge enroll)")
            mode = "local-only"
        if self.allowance.must_escalate(can_escalate=self.link is not None):
            return await self._cloud(endpoint, req, request_id, QUOTA_REASON, fallback=None)
        if mode == "cloud-only":
            return await self._cloud(endpoint, req, request_id, "client-asked", fallback=None)
        if mode == "cloud-first":
            return await self._cloud(endpoint, req, request_id, "cloud-first", fallback=started)
        try:
            prepared = await serving.prepare(self.local, endpoint, req)
        except ApplicationError as exc:
            reason = self._pre_signal_of(exc)
            if mode == "local-only" or reason is None:
                raise
            return await self._cloud(endpoint, req, request_id, reason, fallback=None)
        policy = self.policy(req.model)
        prepared.local.keep_logits = mode == "local-first" and _probes_logits(policy)
        if mode == "local-first":
            reason = self._pre_signal(req, prepared, policy)
            if reason is not None:
                return await self._cloud(endpoint, req, request_id, reason, fallback=started, prepared=prepared)
        if not req.stream:
            body = await serving.run(prepared)
            if mode == "local-first":
                confidence = policy.confidence(_signals(prepared, policy))
                if confidence < policy.threshold:
                    return await self._cloud(
                        endpoint,
                        req,
                        request_id,
                        "low-confidence",
                        fallback=started,
                        prepared=prepared,
                        local_body=body,
                    )
                self._offer_shadow(prepared, policy, confidence)
            return self._edge(prepared, body, request_id, started, None)
        if mode == "local-only":
            return self._edge_stream(prepared, serving.steps(prepared), request_id, started, None)
        return await self._windowed(endpoint, req, prepared, policy, request_id, started)

    async def infer(self, req: InferenceRequest, header: str | None) -> Answer:
        """``/v1/inference`` on a local classifier; low-confidence rows go up to the cloud's model together."""
        started = time.monotonic()
        request_id = server_request_id()
        wanted = header or (req.parameters.get("tier") if isinstance(req.parameters.get("tier"), str) else None)
        for name in req.parameters:  # the device's models are classifiers: ``tier`` is the one parameter they read
            if name != "tier":
                raise ValidationError(
                    f"parameters.{name}: unsupported parameter: on a device /v1/inference takes only 'tier'",
                    param=f"parameters.{name}",
                    code="unsupported_parameter",
                )
        mode = TIER_ALIASES.get(wanted, wanted) if wanted else self.policy(req.model_id).mode
        if mode not in MODES:
            raise ValidationError(f"x-tierline-tier: {wanted!r} is not one of {', '.join(MODES)}", param="tier")
        if self.link is not None and self.cloud_model(req.model_id) is None:
            if mode == "cloud-only":
                raise ValidationError(
                    f"the model '{req.model_id}' has no cloud pair: it is answered on this device only",
                    param="tier",
                    code="no_cloud_pair",
                )
            self.allowance.must_escalate(can_escalate=False)
            unpaired = self.classifiers.get(req.model_id)
            if unpaired is None:
                raise NotFoundError(
                    f"The model '{req.model_id}' is not a tensor model", param="model_id", code="model_not_found"
                )
            rows = unpaired.rows(req.inputs)
            logits, _ = await unpaired.infer(rows)
            answer = self._infer_edge(req, unpaired.result(logits), len(rows), request_id, started, None)
            answer.escalation = UNPAIRED
            return answer
        if self.link is None:
            if mode == "cloud-only":
                raise ServiceUnavailableError("this device is not enrolled with a cloud (tierline edge enroll)")
            mode = "local-only"
        if self.allowance.must_escalate(can_escalate=self.link is not None):
            local = self.classifiers.get(req.model_id)
            inputs = local.rows(req.inputs).tolist() if local is not None else req.inputs
            return await self._infer_cloud(req, inputs, request_id, QUOTA_REASON)
        model = self.classifiers.get(req.model_id)
        if model is None:
            if mode == "local-only":
                raise NotFoundError(
                    f"The model '{req.model_id}' does not exist on this device",
                    param="model_id",
                    code="model_not_found",
                )
            return await self._infer_cloud(req, req.inputs, request_id, "model-not-local")
        rows = model.rows(req.inputs)
        if mode in ("cloud-only", "cloud-first"):
            try:
                return await self._infer_cloud(req, rows.tolist(), request_id, mode)
            except ServiceUnavailableError:
                if mode == "cloud-only":
                    raise
            logits, _ = await model.infer(rows)
            return self._infer_edge(req, model.result(logits), len(rows), request_id, started, "cloud-unreachable")
        logits, signals = await model.infer(rows)
        result = model.result(logits)
        policy = self.policy(req.model_id)
        confidence, threshold = row_confidences(policy, signals, rows, DEFAULT_MARGIN)
        low = np.flatnonzero(confidence < threshold) if mode == "local-first" else np.array([], dtype=np.int64)
        result["tiers"] = ["edge"] * len(rows)
        cloud_model = self.cloud_model(req.model_id)
        if mode == "local-first" and self.shadow is not None and cloud_model is not None:
            kept = np.flatnonzero(confidence >= threshold)
            self.shadow.offer(req.model_id, cloud_model, rows[kept], logits[kept], confidence[kept], time.time())
        if low.size == 0:
            return self._infer_edge(req, result, len(rows), request_id, started, None)
        try:
            cloud = await self._infer_cloud(req, rows[low].tolist(), request_id, "low-confidence")
        except ServiceUnavailableError:
            return self._infer_edge(req, result, len(rows), request_id, started, "cloud-unreachable")
        if cloud.status_code != 200 or not isinstance(cloud.body, dict):
            return cloud
        for j, i in enumerate(low.tolist()):
            result["outputs"][i] = cloud.body["outputs"][j]
            if "labels" in result and "labels" in cloud.body:
                result["labels"][i] = cloud.body["labels"][j]
            result["tiers"][i] = "cloud"
        tier = "cloud" if low.size == len(rows) else "mixed"
        local_rows = len(rows) - int(low.size)
        self._served(
            Served(
                request_id=request_id,
                model=req.model_id,
                tier="edge",
                prompt_tokens=local_rows,
                completion_tokens=0,
                status="ok",
                latency_ms=_ms(started),
                ttft_ms=None,
                escalation_reason="low-confidence",
                degraded=False,
            )
        )
        return Answer({"model_id": req.model_id, **result}, tier, "low-confidence", request_id=request_id)

    def _infer_edge(
        self,
        req: InferenceRequest,
        result: dict[str, Any],
        n_rows: int,
        request_id: str,
        started: float,
        degraded: str | None,
    ) -> Answer:
        result.setdefault("tiers", ["edge"] * n_rows)
        self._served(
            Served(
                request_id=request_id,
                model=req.model_id,
                tier="edge",
                prompt_tokens=n_rows,
                completion_tokens=0,
                status="ok",
                latency_ms=_ms(started),
                ttft_ms=None,
                escalation_reason=None,
                degraded=degraded is not None,
            )
        )
        return Answer({"model_id": req.model_id, **result}, "edge", None, degraded, request_id=request_id)

    async def _infer_cloud(self, req: InferenceRequest, inputs: list[Any], request_id: str, reason: str) -> Answer:
        assert self.link is not None
        body = {"model_id": self.cloud_model(req.model_id) or req.model_id, "inputs": inputs}
        try:
            r = await self.link.escalate("inference", body, reason, request_id)
        except CloudUnavailableError as exc:
            raise ServiceUnavailableError(f"the cloud tier is unreachable ({exc.reason})") from None
        payload = r.json()
        if r.status_code == 200:
            payload["tiers"] = ["cloud"] * len(inputs)
        usage_id = r.headers.get("x-tierline-usage-id", "")
        return Answer(payload, "cloud", reason, status_code=r.status_code, request_id=usage_id)

    # -- pre-signals ------------------------------------------------------------------------------------------
    @staticmethod
    def _pre_signal_of(exc: ApplicationError) -> str | None:
        if isinstance(exc, NotFoundError):
            return "model-not-local"
        if exc.code == "context_length_exceeded":
            return "prompt-too-long"
        if exc.code == "structured_output_unavailable":  # no grammar engine on this device: the cloud has one
            return "cloud-feature"
        if exc.code == "invalid_token_id":
            return None  # token ids name this model's vocabulary; the cloud's model would not read them alike
        if exc.param in (
            "n",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "prompt",
            "prompt_logprobs",
        ):
            return "cloud-feature"
        return None

    @staticmethod
    def _pre_signal(
        req: ChatCompletionRequest | CompletionRequest, prepared: serving.Prepared, policy: EdgePolicy
    ) -> str | None:
        if req.quality == "high":
            return "quality-high"
        limit = policy.max_prompt_tokens
        if limit is not None and prepared.prompt_tokens > limit:
            return "prompt-too-long"
        wanted = prepared.local.max_tokens
        if wanted is not None and wanted > policy.max_new_tokens:
            return "max-tokens"
        return None

    # -- the quality monitor ----------------------------------------------------------------------------------
    def _offer_shadow(self, prepared: serving.Prepared, policy: EdgePolicy, confidence: float) -> None:
        """Hand an answer the policy kept on the device to the quality monitor's sampler: greedy, unconstrained
        generations only (what the calibration's promise is about). Never raises: the answer is the client's."""
        local = prepared.local
        cloud_model = self.cloud_model(prepared.req.model)
        if self.shadow is None or local.temperature != 0.0 or local.grammar is not None or cloud_model is None:
            return
        try:
            self.shadow.offer_lm(
                policy.model,
                cloud_model,
                local.prompt_ids,
                [s.token_id for s in prepared.steps_seen],
                confidence,
                prepared.lm.tokenizer,
                time.time(),
            )
        except Exception:
            logger.exception("offering a shadow sample failed; skipped")

    # -- answers ----------------------------------------------------------------------------------------------
    def _served(self, served: Served) -> None:
        try:
            self.on_served(served)
        except Exception:  # the answer is already on its way; a failing recorder is logged, not raised
            logger.exception("recording usage for request %s failed", served.request_id)

    def _edge(
        self,
        prepared: serving.Prepared,
        body: dict[str, Any],
        request_id: str,
        started: float,
        degraded: str | None,
        reason: str | None = None,
    ) -> Answer:
        latency = (time.monotonic() - started) * 1000
        self._served(
            Served(
                request_id=request_id,
                model=prepared.req.model,
                tier="edge",
                prompt_tokens=prepared.prompt_tokens,
                completion_tokens=prepared.completion_tokens,
                status="ok",
                latency_ms=round(latency, 2),
                ttft_ms=None,
                escalation_reason=reason,
                degraded=degraded is not None,
                subject=prepared.req.user,
            )
        )
        return Answer(body, "edge", reason, degraded, request_id=request_id)

    def _edge_stream(
        self,
        prepared: serving.Prepared,
        source: AsyncIterator[LocalStep],
        request_id: str,
        started: float,
        degraded: str | None,
        reason: str | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> Answer:
        """``on_done`` runs once the whole answer was generated and streamed (not when it failed or the client left
        before its end)."""
        first: list[float] = []

        async def timed() -> AsyncIterator[LocalStep]:
            async for step in source:
                if not first:
                    first.append(time.monotonic())
                yield step

        async def body() -> AsyncIterator[bytes]:
            status = "abandoned"
            try:
                async for chunk in serving.stream(prepared, timed()):
                    yield chunk
                status = "ok"
            except Exception:
                status = "error"
                raise
            finally:
                latency = (time.monotonic() - started) * 1000
                ttft = (first[0] - started) * 1000 if first else None
                self._served(
                    Served(
                        request_id=request_id,
                        model=prepared.req.model,
                        tier="edge",
                        prompt_tokens=prepared.prompt_tokens,
                        completion_tokens=prepared.completion_tokens,
                        status=status,
                        latency_ms=round(latency, 2),
                        ttft_ms=round(ttft, 2) if ttft is not None else None,
                        escalation_reason=reason,
                        degraded=degraded is not None,
                        subject=prepared.req.user,
                    )
                )
                seen = prepared.steps_seen
                if on_done is not None and status != "error" and seen and seen[-1].finish_reason is not None:
                    on_done()  # the whole answer was generated (a client closing after the last chunk included)

        return Answer(body(), "edge", reason, degraded, request_id=request_id)

    async def _windowed(
        self,
        endpoint: serving.Endpoint,
        req: ChatCompletionRequest | CompletionRequest,
        prepared: serving.Prepared,
        policy: EdgePolicy,
        request_id: str,
        started: float,
    ) -> Answer:
        source = serving.steps(prepared)
        window: list[LocalStep] = []
        async for step in source:
            window.append(step)
            if step.finish_reason is not None or len(window) >= policy.stream_window:
                break
        confidence = policy.confidence(_signals(prepared, policy))
        if confidence >= policy.threshold:
            # Shadowed once the stream is complete (the tokens after the window are not known before).
            return self._edge_stream(
                prepared,
                _chain(window, source),
                request_id,
                started,
                None,
                on_done=lambda: self._offer_shadow(prepared, policy, confidence),
            )
        try:
            answer = await self._cloud(endpoint, req, request_id, "low-confidence", fallback=None)
        except ServiceUnavailableError:
            # Cloud unreachable: the device answers after all, continuing the generation it already started.
            return self._edge_stream(
                prepared, _chain(window, source), request_id, started, "cloud-unreachable", "low-confidence"
            )
        await source.aclose()
        return answer

    async def _cloud(
        self,
        endpoint: serving.Endpoint,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        reason: str,
        *,
        fallback: float | None,
        prepared: serving.Prepared | None = None,
        local_body: dict[str, Any] | None = None,
    ) -> Answer:
        """Escalate; on an unreachable cloud answer locally (``fallback`` = start time) or raise 503."""
        body = req.model_dump(mode="json", by_alias=True, exclude_unset=True)
        for name in STRIP_FIELDS:
            body.pop(name, None)
        body["model"] = self.cloud_model(req.model) or req.model
        pairing = self.pairing(req.model)
        if pairing is not None and pairing.resend == "text" and isinstance(req, CompletionRequest):
            body["prompt"] = await self._as_text(req, prepared)
        assert self.link is not None
        started = time.monotonic()
        try:
            if req.stream:
                response, chunks = await self.link.escalate_stream(endpoint, body, reason, request_id)
                if response.status_code != 200:
                    content = b"".join([c async for c in chunks])
                    return self._cloud_error(req, response.status_code, content, reason, request_id, started)
                usage_id = response.headers.get("x-tierline-usage-id", "")
                self._cloud_served(req, usage_id or request_id, reason, started, "ok", None)
                return Answer(chunks, "cloud", reason, request_id=usage_id, requested_model=req.model)
            r = await self.link.escalate(endpoint, body, reason, request_id)
            if r.status_code != 200:
                return self._cloud_error(req, r.status_code, r.content, reason, request_id, started)
            payload = r.json()
            usage_id = r.headers.get("x-tierline-usage-id", "")
            self._cloud_served(req, usage_id or request_id, reason, started, "ok", payload.get("usage"))
            return Answer(payload, "cloud", reason, request_id=usage_id, requested_model=req.model)
        except CloudUnavailableError as exc:
            if fallback is None:
                raise ServiceUnavailableError(f"the cloud tier is unreachable ({exc.reason})") from None
            if prepared is None:
                try:
                    prepared = await serving.prepare(self.local, endpoint, req)
                except ApplicationError:
                    raise ServiceUnavailableError(f"the cloud tier is unreachable ({exc.reason})") from None
            if local_body is not None:
                return self._edge(prepared, local_body, request_id, fallback, "cloud-unreachable", reason)
            if req.stream:
                return self._edge_stream(
                    prepared, serving.steps(prepared), request_id, fallback, "cloud-unreachable", reason
                )
            answer = await serving.run(prepared)
            return self._edge(prepared, answer, request_id, fallback, "cloud-unreachable", reason)

    async def _as_text(self, req: CompletionRequest, prepared: serving.Prepared | None) -> str | list[str]:
        """The prompt as text: token ids decoded with the edge model's tokenizer (its cloud pair reads another
        vocabulary)."""
        texts: list[str] = []
        for p in req.prompts():
            if not isinstance(p, str):
                lm = prepared.lm if prepared is not None else await asyncio.to_thread(self.local.get, req.model)
                p = lm.tokenizer.decode(p)
            texts.append(p)
        return texts[0] if len(texts) == 1 else texts

    def _cloud_served(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        reason: str,
        started: float,
        status: str,
        usage: dict[str, Any] | None,
    ) -> None:
        """Stats only: the cloud meters an escalated request itself, under the same request id."""
        usage = usage or {}
        latency = round((time.monotonic() - started) * 1000, 2)
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        self._served(
            Served(
                request_id=request_id,
                model=req.model,
                tier="cloud",
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                latency_ms=latency,
                ttft_ms=None,
                escalation_reason=reason,
                degraded=False,
            )
        )

    def _cloud_error(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        status: int,
        content: bytes,
        reason: str,
        request_id: str,
        started: float,
    ) -> Answer:
        """The cloud refused the request (4xx): relay its OpenAI-shaped error as it is (with its status's ``code``
        where it has none: an older cloud's, or a body that is not JSON)."""
        try:
            payload = json.loads(content)
        except ValueError:
            error_type = "invalid_request_error" if status < 500 else "server_error"
            payload = {"error": {"message": content[:200].decode(errors="replace"), "type": error_type}}
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict) and not error.get("code"):
            error.setdefault("param", None)
            error["code"] = default_code(status)
        self._cloud_served(req, request_id, reason, started, "error", None)
        return Answer(payload, "cloud", reason, status_code=status)


def _probes_logits(policy: EdgePolicy) -> bool:
    """The policy reads an LM hidden-state probe: as its signal, or as a feature of its router (the bench's
    ``router_gain_probe``)."""
    if policy.probe is None or policy.probe.input != "mean_logits":
        return False
    return policy.signal == HIDDEN_PROBE or (policy.router is not None and HIDDEN_PROBE in policy.router.features)


def _uses_copy_signals(policy: EdgePolicy) -> bool:
    features = policy.router.features if policy.router is not None else []
    return policy.signal in COPY_SIGNALS or any(f in COPY_SIGNALS for f in features)


def _signals(prepared: serving.Prepared, policy: EdgePolicy | None = None) -> dict[str, float]:
    """The policy's inputs: the answer's confidence signals, the prompt's length (the router uses it), for a policy
    that reads them the prompt-side copy signals (token ids only, ~0.05 ms) and, for a policy with an LM hidden-state
    probe, the probe's confidence on the generated tokens' mean logits (the bench's ``lm`` tasks compute the same,
    ``bench.cascade_tasks._EdgeRun``)."""
    signals = {**prepared.signals(), "prompt_tokens": float(prepared.prompt_tokens)}
    if policy is not None and _uses_copy_signals(policy):
        signals.update(copy_signals(prepared.local.prompt_ids, [s.token_id for s in prepared.steps_seen]))
    if policy is not None and _probes_logits(policy):
        mean = prepared.mean_logits()
        # No sampled token (nothing generated, or every token forced): nothing to doubt, as ``lm_signals`` says.
        signals.update(policy.probe_signal(mean) if mean is not None else {HIDDEN_PROBE: 1.0})
    return signals


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 2)


async def _chain(first: list[LocalStep], rest: AsyncIterator[LocalStep]) -> AsyncIterator[LocalStep]:
    for step in first:
        yield step
    async for step in rest:
        yield step
