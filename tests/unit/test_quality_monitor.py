"""The quality monitor's pure parts: the Wilson bound that decides an alert, the threshold a proposal re-reads from
shadow samples, and the device's bounded, background-only sampler."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from controlplane.policies.monitor import (
    MIN_SAMPLES,
    device_group,
    is_below_promise,
    propose_threshold,
    wilson_lower,
    wilson_upper,
)
from edge_agent.cloud_link import CloudUnavailableError
from edge_agent.shadow_sampler import ShadowSampler
from tests.integration.edge_support import ZOO_PAIRINGS


def test_the_wilson_bounds_bracket_the_observed_share_and_narrow_with_samples() -> None:
    assert wilson_lower(90, 100) < 0.9 < wilson_upper(90, 100)
    assert wilson_upper(900, 1000) < wilson_upper(90, 100)
    assert wilson_upper(0, 0) == 1.0 and wilson_upper(100, 100) == 1.0


def test_an_alert_needs_confidence_not_just_a_lower_share() -> None:
    promised = 0.99
    assert not is_below_promise(MIN_SAMPLES - 10, MIN_SAMPLES - 1, promised)  # far below, but too few samples
    assert not is_below_promise(196, 200, promised)  # 0.98: within what chance allows
    assert is_below_promise(176, 200, promised)  # 0.88: below with 99 % confidence
    assert is_below_promise(36, 40, promised)


def test_the_proposal_is_the_lowest_threshold_whose_samples_meet_the_promise() -> None:
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0, 1, 400)
    agrees = confidence > 0.4  # the edge is right exactly above 0.4
    threshold = propose_threshold(confidence, agrees, 0.99)
    assert 0.38 < threshold < 0.45
    assert agrees[confidence >= threshold].mean() >= 0.99
    # No threshold meets it: one above every sampled confidence.
    assert propose_threshold(confidence, np.zeros(400, dtype=bool), 0.9) > confidence.max()


def test_the_device_group_is_its_group_label_else_its_ring() -> None:
    assert device_group({"group": "lab", "ring": "beta"}) == "lab"
    assert device_group({"ring": "beta"}) == "beta"
    assert device_group({}) == "" and device_group(None) == ""


class _Link:
    def __init__(self, answers: list[int | Exception]) -> None:
        self.answers = answers
        self.sent: list[dict[str, Any]] = []

    async def shadow(self, batch: dict[str, Any]) -> int:
        self.sent.append(batch)
        answer = self.answers.pop(0) if self.answers else 200
        if isinstance(answer, Exception):
            raise answer
        return answer


def _offer(sampler: ShadowSampler, rows: int = 3) -> bool:
    x = np.ones((rows, 4))
    logits = np.tile(np.array([0.0, 2.0, 1.0]), (rows, 1))
    return sampler.offer("tierline/digits-micro", "tierline/digits-large", x, logits, np.full(rows, 0.9), 1.0)


def test_the_sampler_only_queues_and_drops_when_full() -> None:
    link = _Link([])
    sampler = ShadowSampler(lambda: link, lambda: 1.0, lambda m: 2, queue_size=2)  # type: ignore[arg-type,return-value]
    assert _offer(sampler) and _offer(sampler)
    assert not _offer(sampler)  # full: dropped at once, nothing waits
    assert sampler.stats.dropped == 1 and link.sent == []


def test_the_sampler_samples_nothing_off_without_a_cloud_policy_version_or_share() -> None:
    link = _Link([])
    assert not _offer(ShadowSampler(lambda: link, lambda: 0.0, lambda m: 2))  # type: ignore[arg-type,return-value]
    assert not _offer(ShadowSampler(lambda: link, lambda: 1.0, lambda m: None))  # type: ignore[arg-type,return-value]
    assert not _offer(ShadowSampler(lambda: None, lambda: 1.0, lambda m: 2))
    half = ShadowSampler(lambda: link, lambda: 0.5, lambda m: 2, draw=iter([0.7, 0.2]).__next__)  # type: ignore[arg-type,return-value]
    assert not _offer(half) and _offer(half)


def test_a_batch_is_retried_under_its_id_and_sent_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_agent.shadow_sampler as module

    monkeypatch.setattr(module, "RETRY_S", 0.0)
    link = _Link([CloudUnavailableError("cloud-unreachable"), 200])
    sampler = ShadowSampler(lambda: link, lambda: 1.0, lambda m: 2)  # type: ignore[arg-type,return-value]

    async def run() -> None:
        await sampler.start()
        assert _offer(sampler, rows=100)
        for _ in range(200):
            if sampler.stats.sent:
                break
            await asyncio.sleep(0.01)
        await sampler.close()

    asyncio.run(run())
    assert sampler.stats.sent == 1 and len(link.sent) == 2 and link.sent[0]["id"] == link.sent[1]["id"]
    batch = link.sent[0]
    assert len(batch["inputs"]) == 64 and batch["edge_answers"][:2] == [1, 1] and batch["policy_version"] == 2


# -- LM answers --------------------------------------------------------------------------------------------------


class _Vocab:
    """A stand-in for the model's ChatTokenizer: ``.tokenizer`` is what ``vocabulary_sha256`` reads."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.tokenizer = self
        self.vocab = vocab

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self.vocab)


def _offer_lm(sampler: ShadowSampler, tokens: list[int], vocab: _Vocab | None = None) -> bool:
    return sampler.offer_lm(
        "tierline/lm-edge", "tierline/lm-cloud", [5, 6, 7], tokens, 0.8, vocab or _Vocab({"a": 0, "b": 1}), 1.0
    )


def test_an_lm_answer_is_sent_with_its_prompt_ids_capped_tokens_and_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.edge_protocol import MAX_SHADOW_TOKENS, ShadowRequest, vocabulary_sha256

    link = _Link([200, 409, 200])
    sampler = ShadowSampler(lambda: link, lambda: 1.0, lambda m: 3)  # type: ignore[arg-type,return-value]
    vocab = _Vocab({"a": 0, "b": 1})

    async def run() -> None:
        await sampler.start()
        assert _offer_lm(sampler, list(range(100)), vocab)
        assert _offer_lm(sampler, [1, 2], vocab)  # the cloud answers 409: vocabularies differ
        for _ in range(200):
            if sampler.stats.sent + sampler.stats.refused == 2:
                break
            await asyncio.sleep(0.01)
        await sampler.close()

    asyncio.run(run())
    batch = link.sent[0]
    ShadowRequest.model_validate(batch)  # what the cloud accepts
    (sample,) = batch["lm_samples"]
    assert sample["prompt_ids"] == [5, 6, 7] and sample["edge_tokens"] == list(range(MAX_SHADOW_TOKENS))
    assert batch["vocabulary_sha256"] == vocabulary_sha256(vocab) and batch["policy_version"] == 3
    # After a 409 the pair is not sampled again; other pairs are.
    assert not _offer_lm(sampler, [1]) and sampler.as_json()["unmonitorable"] == [
        "tierline/lm-edge -> tierline/lm-cloud"
    ]


def test_the_vocabulary_fingerprint_names_the_id_to_token_map() -> None:
    from shared.edge_protocol import vocabulary_sha256

    same = vocabulary_sha256(_Vocab({"a": 0, "b": 1}))
    assert same == vocabulary_sha256(_Vocab({"b": 1, "a": 0}))  # order of the map does not matter
    assert same != vocabulary_sha256(_Vocab({"a": 1, "b": 0}))  # the same tokens under other ids do


def test_the_shadow_request_takes_classifier_batches_as_before_and_lm_batches() -> None:
    from pydantic import ValidationError

    from shared.edge_protocol import ShadowRequest

    head = {"id": "batch-0001", "model": "m", "cloud_model": "c", "policy_version": 1, "occurred_at": 1.0}
    old = {**head, "inputs": [[0.0, 1.0]], "edge_answers": [1], "confidences": [0.9]}  # what every agent sends
    assert not ShadowRequest.model_validate(old).is_lm
    lm = {
        **head,
        "lm_samples": [{"prompt_ids": [1], "edge_tokens": [2], "confidence": 0.5}],
        "vocabulary_sha256": "a" * 64,
    }
    assert ShadowRequest.model_validate(lm).is_lm
    bad = [
        ({**head}, "at least one input"),
        ({**old, "confidences": []}, "confidences"),
        ({**lm, "vocabulary_sha256": None}, "vocabulary_sha256"),
        ({**lm, "inputs": [[0.0]]}, "not both"),
        ({**lm, "lm_samples": [{"prompt_ids": [1], "edge_tokens": [], "confidence": 0.5}]}, "edge_tokens"),
    ]
    for body, message in bad:
        with pytest.raises(ValidationError, match=message):
            ShadowRequest.model_validate(body)


def test_an_lm_sample_agrees_as_its_policy_defines_agreement() -> None:
    from cloud.edge.quality_monitor import lm_agrees, min_token_share

    assert lm_agrees([1, 2, 3], [1, 2, 3]) == (True, 1.0)
    assert lm_agrees([1, 2, 3, 4], [1, 2, 3, 5]) == (False, 0.75)  # exact by default: one token differs
    assert lm_agrees([1, 2, 3, 4], [1, 2]) == (False, 0.5)  # a shorter cloud answer misses the rest
    assert lm_agrees([1, 2, 3, 4], [1, 2, 3, 5], 0.75) == (True, 0.75)
    assert min_token_share({"calibration": {"agreement_min_token_share": 0.5}}) == 0.5
    assert min_token_share({"calibration": {}}) == min_token_share(None) == 1.0
    assert min_token_share({"calibration": {"agreement_min_token_share": 7}}) == 1.0  # out of range: exact


def test_a_probe_policy_promises_what_its_probe_keeps_on_the_validation_set(tmp_path: Any) -> None:
    """The promise of a ``hidden_probe`` policy ranks the validation items by the probe's own confidence (not by
    the quality-loss bound): here the probe keeps exactly the items that agree."""
    import json

    from controlplane.policies.monitor import _validation_agreement
    from shared.calibration import validation_row
    from shared.escalation import HIDDEN_PROBE, EdgePolicy, LinearProbe

    rows = []
    for i in range(40):
        agrees = i % 2 == 0
        x = np.array([1.0 if agrees else -1.0, 0.0])
        signals = {"softmax_margin": 0.5, "max_prob": 0.7, "norm_entropy": 0.5}
        row = validation_row(
            "m", signals, None, edge_good=agrees, cloud_good=True, agrees_with_cloud=agrees, probe=("pixels", x)
        )
        rows.append(json.dumps(row))
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(rows) + "\n")
    policy = EdgePolicy("m", signal=HIDDEN_PROBE, threshold=0.5, probe=LinearProbe("pixels", [5.0, 0.0], 0.0))
    found = _validation_agreement(str(path), 1, "m", json.dumps(policy.to_json(), sort_keys=True), 0.5)
    assert found == 1.0  # the half the probe is surest of is the half that agrees


def test_the_agent_offers_greedy_unconstrained_lm_answers_only() -> None:
    """A sampled or grammar-constrained answer says nothing about a promise calibrated on greedy answers."""
    from types import SimpleNamespace

    from edge_agent.generation import LocalRequest
    from edge_agent.tiering import Tiering
    from shared.escalation import EdgePolicy

    link = _Link([])
    sampler = ShadowSampler(lambda: link, lambda: 1.0, lambda m: 1)  # type: ignore[arg-type,return-value]
    tiering = Tiering(None, None, {}, lambda served: None, shadow=sampler, pairings=ZOO_PAIRINGS)  # type: ignore[arg-type]
    policy = EdgePolicy("tierline/lm-edge")

    def prepared(**choice: Any) -> Any:
        steps = [SimpleNamespace(token_id=t) for t in (4, 5)]
        req = SimpleNamespace(model="tierline/lm-edge-onnx-int8")
        local = LocalRequest(prompt_ids=[1, 2, 3], **choice)
        return SimpleNamespace(local=local, steps_seen=steps, req=req, lm=SimpleNamespace(tokenizer=_Vocab({})))

    tiering._offer_shadow(prepared(temperature=1.0), policy, 0.5)
    tiering._offer_shadow(prepared(temperature=0.0, grammar='start: "a"'), policy, 0.5)
    assert sampler.stats.lm_offered == 0
    tiering._offer_shadow(prepared(temperature=0.0), policy, 0.5)
    assert sampler.stats.lm_offered == 1
    (batch,) = [sampler._queue.get_nowait()]
    assert batch["cloud_model"] == "tierline/lm-cloud" and batch["lm_samples"][0]["edge_tokens"] == [4, 5]
