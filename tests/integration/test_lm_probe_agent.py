"""The LM hidden-state probe on the device: the agent's LM path builds the running mean of the generated tokens'
logits and applies the policy's probe (``EdgePolicy.probe``, input ``mean_logits``); on the same prompts it
decides exactly as ``bench cascade`` does (``bench.cascade_tasks._greedy`` and ``_EdgeRun``, the probe folded onto the
logits through the tied embedding as the bench ships it). The tiny zoo's INT8 edge LM, through the agent's
``Tiering`` with a cloud link that is unreachable, so an escalation shows as a degraded local answer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent import serving
from edge_agent.cloud_link import CloudUnavailableError
from edge_agent.models import zoo_models
from edge_agent.tiering import Tiering
from shared.artifacts import load_public_key
from shared.escalation import HIDDEN_PROBE, EdgePolicy, LearnedRouter, fold_hidden_probe
from shared.openai_schema import CompletionRequest
from tests.integration.edge_support import ZOO_PAIRINGS

pytestmark = pytest.mark.integration
INT8 = "tierline/lm-edge-onnx-int8"
NUM_ITEMS = 16


class _Unreachable:
    """A cloud link whose cloud never answers: an escalated request falls back to the device (degraded)."""

    def __init__(self) -> None:
        self.escalated = 0

    async def escalate(self, *args: Any, **kwargs: Any) -> Any:
        self.escalated += 1
        raise CloudUnavailableError("cloud-unreachable")


def _random_probe(layout: Any, mean_logits: np.ndarray, seed: int) -> Any:
    """A random linear probe on the hidden state the mean logits give through ``pinv(E)``, folded onto the logits
    as ``bench cascade`` folds it (only the agent's agreement with the bench is tested, not the probe's skill)."""
    from bench.cascade_tasks import tied_embedding_projection

    projection = tied_embedding_projection(layout)  # pinv(E): logits -> the final normalised hidden state
    hidden = mean_logits @ projection.T
    d = hidden.shape[1]
    on_hidden = LearnedRouter(
        [f"h{j:03d}" for j in range(d)],
        np.random.default_rng(seed).normal(size=d).tolist(),
        0.0,
        hidden.mean(axis=0).tolist(),
        (hidden.std(axis=0) + 1e-6).tolist(),
    )
    return fold_hidden_probe(on_hidden, projection, "mean_logits", d)


def _median_split(confidences: np.ndarray) -> tuple[float, np.ndarray]:
    """A threshold between the two middle confidences (half of the items escalate) and which ones do."""
    ranked = np.sort(confidences)
    threshold = float((ranked[NUM_ITEMS // 2 - 1] + ranked[NUM_ITEMS // 2]) / 2)
    escalates = confidences < threshold
    assert 0 < escalates.sum() < NUM_ITEMS
    return threshold, escalates


def _agent_escalations(tiny_zoo: Path, public_key: Path, policy: EdgePolicy, prompts: list[list[int]]) -> list[bool]:
    """Which prompts the agent's tiering (local-first, the cloud unreachable) escalates under ``policy``."""
    from bench.cascade_tasks import NEXT_TOKENS

    models = zoo_models(tiny_zoo, [load_public_key(public_key)])
    lms = serving.LocalModels({INT8: (models[INT8].path, models[INT8].manifest)}, num_threads=1)
    tiering = Tiering(lms, _Unreachable(), {"tierline/lm-edge": policy}, lambda served: None, pairings=ZOO_PAIRINGS)  # type: ignore[arg-type]

    async def ask_all() -> list[bool]:
        out = []
        for prompt in prompts:
            req = CompletionRequest.model_validate(
                {"model": INT8, "prompt": prompt, "max_tokens": NEXT_TOKENS, "temperature": 0, "ignore_eos": True}
            )
            out.append((await tiering.handle("completions", req, None)).reason == "low-confidence")
        return out

    return asyncio.run(ask_all())


def test_the_agent_applies_the_lm_probe_and_decides_as_the_bench(tiny_zoo: Path, tiny_zoo_public_key: Path) -> None:
    from tokenizers import Tokenizer

    from bench.cascade_tasks import NEXT_TOKENS, _EdgeRun, _greedy, token_items
    from edge_agent.runtime.lm import load_causal_lm
    from shared.zoo.corpus import held_out_files
    from shared.zoo.registry import ZooLayout

    layout = ZooLayout(tiny_zoo)
    edge_dir = layout.artifact_dir("lm-edge-onnx-int8")
    runtime = load_causal_lm(edge_dir, num_threads=1)
    tokenizer = Tokenizer.from_file(str(edge_dir / "tokenizer.json"))
    items = token_items(tokenizer, [f.text for f in held_out_files()], NUM_ITEMS, 3, runtime.max_context - NEXT_TOKENS)
    assert len(items) == NUM_ITEMS

    # The bench: greedy NEXT_TOKENS tokens, the mean of their logits, the probe folded as bench cascade folds it.
    run = _EdgeRun()
    for item in items:
        _greedy(runtime, item.prompt, NEXT_TOKENS, run)
    probe = _random_probe(layout, np.stack(run.mean_logits), seed=0)
    bench_conf = probe.confidences(np.stack(run.mean_logits))
    threshold, bench_escalates = _median_split(bench_conf)  # half of them escalate

    # The agent: the same prompts through its tiering, local-first, under a policy carrying that probe.
    keys = [load_public_key(tiny_zoo_public_key)]
    models = zoo_models(tiny_zoo, keys)
    lms = serving.LocalModels({INT8: (models[INT8].path, models[INT8].manifest)}, num_threads=1)
    policy = EdgePolicy("tierline/lm-edge", signal=HIDDEN_PROBE, threshold=threshold, probe=probe)
    link = _Unreachable()
    tiering = Tiering(lms, link, {"tierline/lm-edge": policy}, lambda served: None, pairings=ZOO_PAIRINGS)  # type: ignore[arg-type]

    async def ask(prompt: list[int]) -> bool:
        req = CompletionRequest.model_validate(
            {"model": INT8, "prompt": prompt, "max_tokens": NEXT_TOKENS, "temperature": 0, "ignore_eos": True}
        )
        answer = await tiering.handle("completions", req, None)
        assert isinstance(answer.body, dict) and answer.body["usage"]["completion_tokens"] == NEXT_TOKENS
        return answer.reason == "low-confidence"

    async def ask_all() -> list[bool]:
        return [await ask(item.prompt) for item in items]

    assert asyncio.run(ask_all()) == bench_escalates.tolist()
    assert link.escalated == int(bench_escalates.sum())  # an escalation was tried exactly for those


def test_the_agent_computes_the_copy_signals_as_the_bench(tiny_zoo: Path, tiny_zoo_public_key: Path) -> None:
    """A router reading the prompt-side copy signals (``prompt_novelty``, ``copy_kept``; token ids only) decides on
    the device exactly as ``bench cascade``'s ``lm-next8`` computes them (``_EdgeRun(with_copy=True)``)."""
    from tokenizers import Tokenizer

    from bench.cascade_tasks import NEXT_TOKENS, _EdgeRun, _greedy, token_items
    from edge_agent.runtime.lm import load_causal_lm
    from shared.escalation import ROUTER
    from shared.zoo.corpus import held_out_files
    from shared.zoo.registry import ZooLayout

    edge_dir = ZooLayout(tiny_zoo).artifact_dir("lm-edge-onnx-int8")
    runtime = load_causal_lm(edge_dir, num_threads=1)
    tokenizer = Tokenizer.from_file(str(edge_dir / "tokenizer.json"))
    items = token_items(tokenizer, [f.text for f in held_out_files()], NUM_ITEMS, 5, runtime.max_context - NEXT_TOKENS)
    run = _EdgeRun(with_copy=True)
    for item in items:
        _greedy(runtime, item.prompt, NEXT_TOKENS, run)
    features = ["prompt_novelty", "copy_kept", "mean_logprob"]
    table = {f: np.array([s[f] for s in run.signals]) for f in features}
    assert len(set(table["prompt_novelty"].tolist())) > 1, "the items' prompts do not differ in copyability"
    router = LearnedRouter(features, [-1.0, 1.0, 0.5], 0.0, [float(table[f].mean()) for f in features], [1.0, 1.0, 1.0])
    threshold, bench_escalates = _median_split(router.confidences(table))
    policy = EdgePolicy("tierline/lm-edge", signal=ROUTER, threshold=threshold, router=router)
    prompts = [item.prompt for item in items]
    assert _agent_escalations(tiny_zoo, tiny_zoo_public_key, policy, prompts) == bench_escalates.tolist()


def test_the_agent_runs_a_router_stacked_on_the_probe_as_the_bench(tiny_zoo: Path, tiny_zoo_public_key: Path) -> None:
    """The policy ``bench cascade`` ships for ``router_gain_probe``: signal ``router`` whose features include the
    probe's confidence (``hidden_probe``, the probe on the mean logits in the policy) and the copy signals of the
    first generated token and the repeated suffix (``copy_run_missed`` among them). The agent builds the mean logits
    and the copy signals for it and decides on the same prompts exactly as the bench computes them."""
    from tokenizers import Tokenizer

    from bench.cascade_tasks import NEXT_TOKENS, _EdgeRun, _greedy, token_items
    from edge_agent.runtime.lm import load_causal_lm
    from shared.escalation import ROUTER
    from shared.zoo.corpus import held_out_files
    from shared.zoo.registry import ZooLayout

    layout = ZooLayout(tiny_zoo)
    edge_dir = layout.artifact_dir("lm-edge-onnx-int8")
    runtime = load_causal_lm(edge_dir, num_threads=1)
    tokenizer = Tokenizer.from_file(str(edge_dir / "tokenizer.json"))
    items = token_items(tokenizer, [f.text for f in held_out_files()], NUM_ITEMS, 7, runtime.max_context - NEXT_TOKENS)
    run = _EdgeRun(with_copy=True)
    for item in items:
        _greedy(runtime, item.prompt, NEXT_TOKENS, run)
    probe = _random_probe(layout, np.stack(run.mean_logits), seed=1)
    features = ["suffix_novelty", "copy_first_kept", "prompt_novelty_all", "copy_run_missed", "mean_logprob"]
    features.append(HIDDEN_PROBE)
    table = {f: np.array([s[f] for s in run.signals]) for f in features[:-1]}
    assert len(set(table["copy_run_missed"].tolist())) > 1, "no item's answer broke off a repeated stretch"
    table[HIDDEN_PROBE] = probe.confidences(np.stack(run.mean_logits))
    router = LearnedRouter(
        features,
        [0.7, 0.5, -0.4, 0.6, 0.3, 2.0],
        0.0,
        [float(table[f].mean()) for f in features],
        [1.0] * len(features),
    )
    threshold, bench_escalates = _median_split(router.confidences(table))
    policy = EdgePolicy("tierline/lm-edge", signal=ROUTER, threshold=threshold, router=router, probe=probe)
    prompts = [item.prompt for item in items]
    assert _agent_escalations(tiny_zoo, tiny_zoo_public_key, policy, prompts) == bench_escalates.tolist()
