"""The two cascade tasks, run on both tiers: per held-out item, the edge's escalation signals and whether the
edge's and the cloud's answers were right.

- ``digits``: the held-out digits (never trained on); ``digits-small`` at the edge, ``digits-large`` in the cloud,
  both through ONNX Runtime. Right = the predicted class is the label. Signals: ``classifier_signals`` of the edge
  logits. The near-equal pair.
- ``digits-micro``: the same with ``digits-micro`` (INT8 logistic regression on 2x2-pooled pixels) at the edge:
  the pair with a real gap.
- ``lm``: line completion on the held-out standard-library files. An item is a line start: the prompt is up to
  ``CONTEXT_TOKENS`` tokens of the file before it, cut at a token boundary of the file's own tokenisation (so
  the prompt is tokenised as in training); the answer is the rest of the line. Both tiers decode greedily until
  they emit a token holding a newline (or EOS), at most ``MAX_LINE_TOKENS`` tokens. Right = the generated line
  is exactly the true line. Items skip blank lines, lines shorter than ``MIN_LINE_CHARS`` characters once
  stripped (a lone ``)`` or ``]``: nothing to predict), lines that need more than the generation cap (no tier
  could get them right, so they would only dilute both qualities alike) and the first ``MIN_CONTEXT_TOKENS``
  tokens of each file (no context to go on). The edge runs the ONNX INT8 export with
  ``edge_agent.runtime.lm`` (the device runtime; signals from ``step_signals`` over every generated token,
  the newline included); the cloud runs ``lm-cloud`` on the project's engine, all prompts in one batch.
  The near-equal LM pair: the tiers differ by about a point of exact-line match.
- ``lm-next8``: next-tokens completion of held-out code with the LM pair's real gap. An item is a token
  position of a held-out file (drawn uniformly over all tokens past ``MIN_CONTEXT_TOKENS``); the prompt is the
  file before it, up to the edge model's context minus ``NEXT_TOKENS`` (the file so far, as an editor sends
  it); the reference is the file's next ``NEXT_TOKENS`` tokens. Both tiers decode exactly ``NEXT_TOKENS``
  tokens greedily (no stop); an item's quality is graded: the share of the ``NEXT_TOKENS`` positions where the
  tier's token is the reference token (top-1 agreement with the reference over the next 8 tokens). The edge's
  signals come from its own generated tokens, as on a device. ``agrees`` is the same share against the
  cloud's tokens (the router's target).
- ``lm-traffic``: the demo's own LM requests, the ones its calibrated policy decides (what ``tierline up``
  calibrates ``tierline/lm-edge`` on). Items come from ``tierline.demo_traffic.policy_items``, the generator
  ``tierline demo traffic`` sends: easy (whole lines of context and half a line, 16 tokens, stop at the newline)
  and hard (two lines, 48 tokens, no stop) in the default mix's shares, requests with ``quality: "high"`` left
  out (the request sends those to the cloud, not the policy). The edge runs each request through the agent's own
  code (``edge_agent.serving``: tokenisation, generation defaults, stop handling on ``LocalLM``) and its signals
  are the agent's (``edge_agent.tiering._signals``: the generation's signals, the copy signals and
  ``prompt_tokens``). The cloud LM decodes the same prompt ids greedily for the request's ``max_tokens``. Right:
  easy, the answer (up to the newline) is exactly the rest of the line (as ``lm``); hard, graded: the share of
  the first ``NEXT_TOKENS`` positions where the tier's token is the reference's (the file's text after the two
  lines, tokenised alone), as ``lm-next8``. ``agrees``: the edge's first ``MAX_SHADOW_TOKENS`` generated tokens
  are the cloud's, every one (what the live quality monitor compares on a shadow sample, so the agreement it
  checks against the promise is the same measure).
- ``lm-micro-next8``: the LM pair with a real gap inside the training window. The same items (token positions
  and references) as ``lm-next8``, with ``lm-micro`` (the zoo's smallest LM, ONNX INT8, on the same device
  runtime) at the edge and ``lm-cloud`` in the cloud; every prompt is cut to the trained context minus
  ``NEXT_TOKENS`` (248 tokens demo, 120 tiny) so both models run inside the windows they were trained on.
  Graded, signals and agreement as ``lm-next8``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.escalation import classifier_signals, copy_signals, lm_signals, step_signals
from shared.routing_eval import DEFAULT_RESAMPLES, bootstrap_weights
from shared.zoo.registry import ZooLayout

CONTEXT_TOKENS = 128
MIN_CONTEXT_TOKENS = 16
MAX_LINE_TOKENS = 24
MIN_LINE_CHARS = 3
NEXT_TOKENS = 8
EDGE_LM_ARTIFACT = "lm-edge-onnx-int8"
MICRO_LM_ARTIFACT = "lm-micro-onnx-int8"
KV_CACHE_BYTES = 256 << 20
CLOUD_CHUNK = 512  # prompts handed to the cloud engine at once: its queue holds 1,024 requests


@dataclass(slots=True)
class TaskResults:
    """One task's items as columns; ``signal_s`` is the time the edge spent computing each item's signals."""

    task: str
    edge_model: str
    cloud_model: str
    signals: dict[str, np.ndarray]
    prompt_tokens: np.ndarray | None
    edge_good: np.ndarray
    cloud_good: np.ndarray
    agrees: np.ndarray  # the edge's answer is the cloud's
    signal_s: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_texts: list[str] | None = None  # what a pre-generation router reads (text tasks)
    # The hidden-state probe's input per item (``LinearProbe.input``), the projection from it to the hidden
    # state (LM: pinv of the tied embedding; None: the input is the probe's feature vector) and the seconds the
    # edge spent building it.
    probe_input: str | None = None
    probe_inputs: np.ndarray | None = None
    probe_projection: np.ndarray | None = None
    probe_s: np.ndarray | None = None
    kinds: list[str] | None = None  # per item, the kind of request (``lm-traffic``: easy | hard)

    def __len__(self) -> int:
        return len(self.edge_good)


DIGITS_PAIRS = {"digits": "digits-small", "digits-micro": "digits-micro"}  # task -> edge artifact


def run_digits(layout: ZooLayout, task: str = "digits") -> TaskResults:
    """Both classifiers of ``task`` (its edge artifact in ``DIGITS_PAIRS``, ``digits-large`` in the cloud) on
    every held-out digit."""
    import onnxruntime as ort

    edge = DIGITS_PAIRS[task]
    with np.load(layout.artifact_dir("digits-held-out") / "digits-held-out.npz") as held_out:
        x, y = held_out["x"].astype(np.float32), held_out["y"]
    logits = {}
    for name in (edge, "digits-large"):
        model_dir = layout.artifact_dir(name)
        meta = json.loads((model_dir / "classifier.json").read_text())
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        logits[name] = session.run([meta["output"]], {meta["input"]: x})[0]
    signal_s = np.empty(len(x))
    for i in range(len(x)):  # per request, as the agent sees them one at a time
        started = time.perf_counter()
        classifier_signals(logits[edge][i])
        signal_s[i] = time.perf_counter() - started
    return TaskResults(
        task=task,
        edge_model=f"tierline/{edge}",
        cloud_model="tierline/digits-large",
        signals=classifier_signals(logits[edge]),
        prompt_tokens=None,
        edge_good=logits[edge].argmax(-1) == y,
        cloud_good=logits["digits-large"].argmax(-1) == y,
        agrees=logits[edge].argmax(-1) == logits["digits-large"].argmax(-1),
        signal_s=signal_s,
        probe_input="pixels",
        probe_inputs=x.astype(np.float64),
        probe_s=np.zeros(len(x)),  # the request's own input: nothing to build
    )


@dataclass(frozen=True, slots=True)
class LineItem:
    prompt: list[int]
    line: str  # the rest of the line after the prompt, without the newline


class _LineEnds:
    """Which token ids end a line (hold a newline) or the text (EOS), and how a generation reads as a line."""

    def __init__(self, tokenizer: Any, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.has_newline = np.array(["\n" in tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())])

    def is_end(self, token: int) -> bool:
        return bool(self.has_newline[token]) or token in self.eos_ids

    def line(self, ids: list[int]) -> str | None:
        """The generated line, or None when the cap came before the line ended."""
        if not ids or not self.is_end(ids[-1]):
            return None
        if ids[-1] in self.eos_ids:
            return str(self.tokenizer.decode(ids[:-1]))
        return str(self.tokenizer.decode(ids)).split("\n", 1)[0]


def line_items(ends: _LineEnds, texts: list[str], num_items: int, seed: int) -> list[LineItem]:
    """``num_items`` line starts drawn at random (seeded) from every file's eligible lines."""
    encodings = ends.tokenizer.encode_batch(texts)
    starts: list[tuple[int, int, int]] = []  # (file, first token of the line, its newline token)
    for f, enc in enumerate(encodings):
        newlines = np.flatnonzero(ends.has_newline[np.asarray(enc.ids, dtype=np.int64)])
        first, last = newlines[:-1] + 1, newlines[1:]
        ok = (first < last) & (last - first + 1 <= MAX_LINE_TOKENS) & (first >= MIN_CONTEXT_TOKENS)
        starts.extend((f, int(a), int(b)) for a, b in zip(first[ok], last[ok], strict=True))
    items: list[LineItem] = []
    for k in np.random.default_rng(seed).permutation(len(starts)):
        f, start, newline = starts[int(k)]
        ids = encodings[f].ids
        line = str(ends.tokenizer.decode(ids[start : newline + 1])).split("\n", 1)[0]
        if len(line.strip()) >= MIN_LINE_CHARS:
            items.append(LineItem(list(ids[max(0, start - CONTEXT_TOKENS) : start]), line))
            if len(items) == num_items:
                break
    return items


@dataclass(slots=True)
class _EdgeRun:
    """What the edge produced per item: its tokens, signals, mean logits (the probe's input) and timings.
    ``with_copy``: add ``copy_signals`` (prompt-side, token ids only) to each item's signals."""

    with_copy: bool = False
    outputs: list[list[int]] = field(default_factory=list)
    signals: list[dict[str, float]] = field(default_factory=list)
    mean_logits: list[np.ndarray] = field(default_factory=list)
    signal_s: list[float] = field(default_factory=list)
    probe_s: list[float] = field(default_factory=list)

    def add(self, prompt: list[int], out: list[int], rows: list[np.ndarray]) -> None:
        """The evidence for the whole answer in one vectorised pass (what a device pays to decide)."""
        started = time.perf_counter()
        logits = np.stack(rows)  # [T, V], stacked once for the signals and the probe's input
        signals = lm_signals(step_signals(logits, out))
        if self.with_copy:
            signals |= copy_signals(prompt, out)
        self.signals.append(signals)
        self.signal_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        self.mean_logits.append(np.asarray(np.mean(logits, axis=0, dtype=np.float64)))
        self.probe_s.append(time.perf_counter() - started)
        self.outputs.append(out)

    def columns(self) -> dict[str, Any]:
        s = self.signals
        return {
            "signals": {k: np.array([x[k] for x in s]) for k in s[0]} if s else {},
            "signal_s": np.array(self.signal_s),
            "probe_input": "mean_logits",
            "probe_inputs": np.stack(self.mean_logits) if self.mean_logits else None,
            "probe_s": np.array(self.probe_s),
        }


def tied_embedding_projection(layout: ZooLayout, lm: str = "lm-edge") -> np.ndarray:
    """``pinv(E)`` of the tied embedding of the edge LM ``lm`` (``[d, V]``): logits to the final normalised
    hidden state."""
    from safetensors.numpy import load_file

    from shared.escalation import hidden_from_logits

    weights = load_file(str(layout.artifact_dir(lm) / "model.safetensors"))
    return hidden_from_logits(weights["model.embed_tokens.weight"].astype(np.float64))


def _greedy(
    runtime: Any, prompt: list[int], limit: int, run: _EdgeRun, is_end: Callable[[int], bool] | None = None
) -> list[int]:
    """Greedy tokens from ``prompt`` (up to ``limit``, or through the first token ``is_end`` accepts), with the
    evidence of every step added to ``run``."""
    runtime.reset()
    logits = runtime.prefill(prompt)
    out: list[int] = []
    rows: list[np.ndarray] = []
    while True:
        token = int(np.argmax(logits))
        rows.append(logits)
        out.append(token)
        if len(out) == limit or (is_end is not None and is_end(token)):
            break
        logits = runtime.decode(token)
    run.add(prompt, out, rows)
    return out


def _edge_lines(model_dir: Path, ends: _LineEnds, items: list[LineItem]) -> tuple[list[str | None], _EdgeRun]:
    from edge_agent.runtime.lm import load_causal_lm

    runtime = load_causal_lm(model_dir, num_threads=1)
    lines: list[str | None] = []
    run = _EdgeRun(with_copy=True)  # exported rows carry the copy signals: calibration can fit on them
    for item in items:
        out = _greedy(runtime, item.prompt, MAX_LINE_TOKENS, run, ends.is_end)
        lines.append(ends.line(out))
    return lines, run


def _cloud_lines(model_dir: Path, ends: _LineEnds, items: list[LineItem]) -> list[str | None]:
    from cloud.engine.llm import LLM
    from cloud.engine.sampling_params import SamplingParams

    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_LINE_TOKENS, stop=["\n"])
    outputs = _generate(llm, [item.prompt for item in items], params)
    return [ends.line(out.token_ids) for out in outputs]


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    """``llm.generate`` in chunks of ``CLOUD_CHUNK`` prompts (in order): more items than the engine's queue
    holds at once (``--next-items`` past 1,024) would be refused."""
    out: list[Any] = []
    for start in range(0, len(prompts), CLOUD_CHUNK):
        out.extend(llm.generate(prompts[start : start + CLOUD_CHUNK], params))
    return out


def run_lm(layout: ZooLayout, num_lines: int, seed: int) -> TaskResults:
    """Greedy line completion on ``num_lines`` held-out lines by the edge LM (INT8) and the cloud LM."""
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    edge_dir = layout.artifact_dir(EDGE_LM_ARTIFACT)
    generation = json.loads((edge_dir / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", [])
    ends = _LineEnds(
        Tokenizer.from_file(str(edge_dir / "tokenizer.json")), set(eos if isinstance(eos, list) else [eos])
    )
    items = line_items(ends, [f.text for f in held_out_files()], num_lines, seed)
    edge_lines, run = _edge_lines(edge_dir, ends, items)
    cloud_lines = _cloud_lines(layout.artifact_dir("lm-cloud"), ends, items)
    truth = [item.line for item in items]
    return TaskResults(
        task="lm",
        edge_model="tierline/lm-edge",
        cloud_model="tierline/lm-cloud",
        prompt_tokens=np.array([len(item.prompt) for item in items], dtype=np.float64),
        edge_good=np.array([e == t for e, t in zip(edge_lines, truth, strict=True)], dtype=bool),
        cloud_good=np.array([c == t for c, t in zip(cloud_lines, truth, strict=True)], dtype=bool),
        agrees=np.array([e is not None and e == c for e, c in zip(edge_lines, cloud_lines, strict=True)], dtype=bool),
        **run.columns(),
        probe_projection=tied_embedding_projection(layout),
        extra={
            "edge_lines_finished": round(float(np.mean([e is not None for e in edge_lines])), 4),
            "context_tokens": CONTEXT_TOKENS,
            "max_line_tokens": MAX_LINE_TOKENS,
        },
        prompt_texts=[str(ends.tokenizer.decode(item.prompt)) for item in items],
    )


TRAFFIC_MODEL = "tierline/lm-edge-onnx-int8"  # the model id ``demo traffic`` sends its LM requests to


def _traffic_edge(model_dir: Path, items: list[Any]) -> tuple[list[list[int]], list[str], list[list[int]], Any]:
    """Each request through the agent's local path: ``serving``'s preparation, ``LocalLM.generate`` and
    ``tiering._signals`` (the policy's inputs, copy signals included). Returns the prompt ids, the answer texts,
    the generated ids and an ``_EdgeRun`` holding the signals, mean logits and timings."""
    from edge_agent import serving
    from edge_agent.generation import LocalLM
    from edge_agent.tiering import _signals
    from shared.escalation import EdgePolicy
    from shared.openai_schema import CompletionRequest

    lm = LocalLM(model_dir, num_threads=1)
    reads_copy = EdgePolicy(TRAFFIC_MODEL, signal="copy_kept")  # any policy that reads the copy signals
    prompts: list[list[int]] = []
    texts: list[str] = []
    outputs: list[list[int]] = []
    run = _EdgeRun()
    for item in items:
        req = CompletionRequest(**item.body)
        ids = lm.tokenizer.encode(item.body["prompt"])
        prepared = serving.Prepared("completions", req, lm, serving._request(lm, ids, req, req.max_tokens, None))
        prepared.local.keep_logits = True  # the probe's input (mean logits), as a probing policy asks the agent
        for step in lm.generate(prepared.local):
            prepared.record(step)
        started = time.perf_counter()
        signals = _signals(prepared, reads_copy)
        run.signal_s.append(time.perf_counter() - started)
        signals.pop("prompt_tokens")
        run.signals.append(signals)
        mean = prepared.mean_logits()
        run.mean_logits.append(mean if mean is not None else np.zeros(lm.vocab_size))
        run.probe_s.append(0.0)
        prompts.append(prepared.local.prompt_ids)
        texts.append("".join(s.delta_text for s in prepared.steps_seen))
        outputs.append([s.token_id for s in prepared.steps_seen])
    return prompts, texts, outputs, run


def run_lm_traffic(layout: ZooLayout, num_items: int, seed: int) -> TaskResults:
    """The demo's LM requests (``tierline.demo_traffic.policy_items``, seeded) on the edge LM (INT8, through the
    agent's code) and the cloud LM: what the demo's policy is calibrated on."""
    import random

    from cloud.engine.llm import LLM
    from cloud.engine.sampling_params import SamplingParams
    from shared.edge_protocol import MAX_SHADOW_TOKENS
    from tierline.demo_traffic import policy_items, prompt_fits

    items = policy_items(TRAFFIC_MODEL, random.Random(seed), num_items, prompt_fits(layout.root, TRAFFIC_MODEL))
    edge_dir = layout.artifact_dir(EDGE_LM_ARTIFACT)
    prompts, edge_texts, edge_out, run = _traffic_edge(edge_dir, items)
    llm = LLM(layout.artifact_dir("lm-cloud"), kv_cache_bytes=KV_CACHE_BYTES)
    params = [SamplingParams(temperature=0.0, max_tokens=int(item.body["max_tokens"])) for item in items]
    cloud_out: list[list[int]] = []
    for start in range(0, len(prompts), CLOUD_CHUNK):
        done = llm.generate(prompts[start : start + CLOUD_CHUNK], params[start : start + CLOUD_CHUNK])
        cloud_out.extend(list(out.token_ids) for out in done)
    tokenizer = llm.tokenizer
    edge_q, cloud_q, agrees = [], [], []
    for item, text, mine, theirs in zip(items, edge_texts, edge_out, cloud_out, strict=True):
        if item.kind == "easy":  # the answer is the line's rest, exactly (the cloud's cut at its newline)
            edge_q.append(float(text == item.reference))
            cloud_q.append(float(str(tokenizer.decode(theirs)).split("\n", 1)[0] == item.reference))
        else:  # graded over the reference's first NEXT_TOKENS tokens
            reference = list(tokenizer.tokenizer.encode(item.reference, add_special_tokens=False).ids)[:NEXT_TOKENS]
            edge_q.append(_match_share(mine, reference) if reference else 0.0)
            cloud_q.append(_match_share(theirs, reference) if reference else 0.0)
        shadowed = mine[:MAX_SHADOW_TOKENS]  # what a shadow sample carries and the monitor compares
        agrees.append(bool(shadowed) and list(theirs[: len(shadowed)]) == shadowed)
    kinds = [item.kind for item in items]
    edge_good, cloud_good = np.array(edge_q), np.array(cloud_q)
    by_kind = {
        kind: _gap(edge_good[np.array(kinds) == kind], cloud_good[np.array(kinds) == kind])
        for kind in sorted(set(kinds))
    }
    return TaskResults(
        task="lm-traffic",
        edge_model="tierline/lm-edge",
        cloud_model="tierline/lm-cloud",
        prompt_tokens=np.array([len(p) for p in prompts], dtype=np.float64),
        edge_good=edge_good,
        cloud_good=cloud_good,
        agrees=np.array(agrees, dtype=bool),
        **run.columns(),
        probe_projection=tied_embedding_projection(layout),
        extra={
            "quality_measure": "easy: the rest of the line exactly; hard: top-1 agreement with the reference over "
            f"its first {NEXT_TOKENS} tokens",
            "kinds": dict(sorted(Counter(kinds).items())),
            "by_kind": by_kind,
        },
        prompt_texts=[str(item.body["prompt"]) for item in items],
        kinds=kinds,
    )


@dataclass(frozen=True, slots=True)
class TokenItem:
    prompt: list[int]
    reference: list[int]  # the file's next NEXT_TOKENS tokens


def token_items(tokenizer: Any, texts: list[str], num_items: int, seed: int, max_prompt: int) -> list[TokenItem]:
    """``num_items`` token positions drawn uniformly (seeded) over every file's tokens that have
    ``MIN_CONTEXT_TOKENS`` before them and ``NEXT_TOKENS`` after; each prompt is the file before the position,
    cut to its last ``max_prompt`` tokens."""
    encodings = [enc.ids for enc in tokenizer.encode_batch(texts)]
    counts = np.array([max(0, len(ids) - NEXT_TOKENS - MIN_CONTEXT_TOKENS + 1) for ids in encodings])
    if counts.sum() == 0:
        return []
    offsets = np.concatenate([[0], np.cumsum(counts)])
    rng = np.random.default_rng(seed)
    draws = rng.choice(int(offsets[-1]), size=min(num_items, int(offsets[-1])), replace=False)
    items = []
    for k in draws:
        f = int(np.searchsorted(offsets, k, side="right") - 1)
        pos = MIN_CONTEXT_TOKENS + int(k - offsets[f])
        ids = encodings[f]
        items.append(TokenItem(list(ids[max(0, pos - max_prompt) : pos]), list(ids[pos : pos + NEXT_TOKENS])))
    return items


def _match_share(tokens: list[int], reference: list[int]) -> float:
    """Share of the reference positions where ``tokens`` holds the same token (a short answer misses the rest)."""
    return sum(a == b for a, b in zip(tokens, reference, strict=False)) / len(reference)


def _edge_next_tokens(runtime: Any, items: list[TokenItem]) -> _EdgeRun:
    run = _EdgeRun(with_copy=True)
    for item in items:
        _greedy(runtime, item.prompt, NEXT_TOKENS, run)
    return run


def _cloud_next_tokens(model_dir: Path, items: list[TokenItem]) -> list[list[int]]:
    from cloud.engine.llm import LLM
    from cloud.engine.sampling_params import SamplingParams

    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=NEXT_TOKENS, ignore_eos=True)
    return [list(out.token_ids) for out in _generate(llm, [item.prompt for item in items], params)]


def training_window(layout: ZooLayout, edge: str = "edge") -> int:
    """The shorter of the training sequence lengths of the ``edge`` (or ``micro``) LM and the cloud LM (the
    longest context both were trained on)."""
    from shared.zoo.presets import get_preset

    preset = get_preset(str(layout.report()["preset"]))
    edge_training = preset.micro_training if edge == "micro" else preset.edge_training
    return min(edge_training.seq_len, preset.cloud_training.seq_len)


def _within_window(runtime: Any, cloud_dir: Path, items: list[TokenItem], window: int, seed: int) -> dict[str, Any]:
    """Both tiers again on the same items with each prompt cut to its last ``window`` tokens: how much of the
    gap comes from running the models past the context they were trained on."""
    cut = [TokenItem(item.prompt[-window:], item.reference) for item in items]
    edge_out = _edge_next_tokens(runtime, cut).outputs
    cloud_out = _cloud_next_tokens(cloud_dir, cut)
    edge_q = np.array([_match_share(e, it.reference) for e, it in zip(edge_out, items, strict=True)])
    cloud_q = np.array([_match_share(c, it.reference) for c, it in zip(cloud_out, items, strict=True)])
    return {
        "max_prompt_tokens": window,
        **_gap(edge_q, cloud_q),
        "quality_gap": quality_gap(edge_q, cloud_q, DEFAULT_RESAMPLES, seed),
    }


def run_lm_next(layout: ZooLayout, num_items: int, seed: int) -> TaskResults:
    """Greedy next-``NEXT_TOKENS``-token completion at ``num_items`` held-out positions by the edge LM (INT8)
    and the cloud LM, graded against the file's own next tokens."""
    from tokenizers import Tokenizer

    from edge_agent.runtime.lm import load_causal_lm
    from shared.zoo.corpus import held_out_files

    edge_dir = layout.artifact_dir(EDGE_LM_ARTIFACT)
    runtime = load_causal_lm(edge_dir, num_threads=1)
    tokenizer = Tokenizer.from_file(str(edge_dir / "tokenizer.json"))
    max_prompt = runtime.max_context - NEXT_TOKENS
    items = token_items(tokenizer, [f.text for f in held_out_files()], num_items, seed, max_prompt)
    run = _edge_next_tokens(runtime, items)
    edge_out = run.outputs
    cloud_out = _cloud_next_tokens(layout.artifact_dir("lm-cloud"), items)
    edge_q = np.array([_match_share(e, it.reference) for e, it in zip(edge_out, items, strict=True)])
    cloud_q = np.array([_match_share(c, it.reference) for c, it in zip(cloud_out, items, strict=True)])
    prompt_tokens = np.array([len(item.prompt) for item in items], dtype=np.float64)
    long = prompt_tokens > max_prompt // 2
    return TaskResults(
        task="lm-next8",
        edge_model="tierline/lm-edge",
        cloud_model="tierline/lm-cloud",
        prompt_tokens=prompt_tokens,
        edge_good=edge_q,
        cloud_good=cloud_q,
        agrees=np.array([_match_share(e, c) for e, c in zip(edge_out, cloud_out, strict=True)]),
        **run.columns(),
        probe_projection=tied_embedding_projection(layout),
        extra={
            "quality_measure": f"top-1 agreement with the reference over the next {NEXT_TOKENS} tokens",
            "next_tokens": NEXT_TOKENS,
            "max_prompt_tokens": max_prompt,
            "median_prompt_tokens": float(np.median(prompt_tokens)) if len(items) else 0.0,
            # Where the gap lives: prompts past half the edge's context (longer than its training windows).
            "gap_by_prompt_length": {
                "short": _gap(edge_q[~long], cloud_q[~long]),
                "long": _gap(edge_q[long], cloud_q[long]),
                "long_from_tokens": max_prompt // 2 + 1,
            },
            # The same items with both prompts cut to the trained context (a runtime setting, not routing).
            "within_training_window": _within_window(
                runtime, layout.artifact_dir("lm-cloud"), items, training_window(layout) - NEXT_TOKENS, seed
            ),
        },
        prompt_texts=[str(tokenizer.decode(item.prompt)) for item in items],
    )


def run_lm_micro_next(layout: ZooLayout, num_items: int, seed: int) -> TaskResults:
    """``lm-next8``'s items (same ``seed`` and ``num_items``: same positions and references) on the pair with a
    real gap: the micro LM (INT8) at the edge and the cloud LM, every prompt cut to the trained context minus
    ``NEXT_TOKENS`` so both run inside their training windows."""
    from tokenizers import Tokenizer

    from edge_agent.runtime.lm import load_causal_lm
    from shared.zoo.corpus import held_out_files

    edge_dir = layout.artifact_dir(MICRO_LM_ARTIFACT)
    runtime = load_causal_lm(edge_dir, num_threads=1)
    tokenizer = Tokenizer.from_file(str(edge_dir / "tokenizer.json"))
    window = training_window(layout, "micro")
    max_prompt = window - NEXT_TOKENS
    items = token_items(tokenizer, [f.text for f in held_out_files()], num_items, seed, max_prompt)
    run = _edge_next_tokens(runtime, items)
    cloud_out = _cloud_next_tokens(layout.artifact_dir("lm-cloud"), items)
    edge_q = np.array([_match_share(e, it.reference) for e, it in zip(run.outputs, items, strict=True)])
    cloud_q = np.array([_match_share(c, it.reference) for c, it in zip(cloud_out, items, strict=True)])
    prompt_tokens = np.array([len(item.prompt) for item in items], dtype=np.float64)
    return TaskResults(
        task="lm-micro-next8",
        edge_model="tierline/lm-micro",
        cloud_model="tierline/lm-cloud",
        prompt_tokens=prompt_tokens,
        edge_good=edge_q,
        cloud_good=cloud_q,
        agrees=np.array([_match_share(e, c) for e, c in zip(run.outputs, cloud_out, strict=True)]),
        **run.columns(),
        probe_projection=tied_embedding_projection(layout, "lm-micro"),
        extra={
            "quality_measure": f"top-1 agreement with the reference over the next {NEXT_TOKENS} tokens",
            "next_tokens": NEXT_TOKENS,
            "training_window": window,
            "max_prompt_tokens": max_prompt,
            "median_prompt_tokens": float(np.median(prompt_tokens)) if len(items) else 0.0,
            "all_items": _gap(edge_q, cloud_q),
        },
        prompt_texts=[str(tokenizer.decode(item.prompt)) for item in items],
    )


def quality_gap(edge_good: np.ndarray, cloud_good: np.ndarray, resamples: int, seed: int) -> dict[str, Any]:
    """Cloud minus edge quality over all the task's items, with its 95 % paired bootstrap interval."""
    diff = np.asarray(cloud_good, dtype=np.float64) - np.asarray(edge_good, dtype=np.float64)
    boot = bootstrap_weights(len(diff), resamples, seed) @ diff / len(diff)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {
        "n": len(diff),
        "gap": round(float(diff.mean()), 4),
        "gap_ci95": [round(float(lo), 4), round(float(hi), 4)],
        "excludes_zero": bool(lo > 0 or hi < 0),
    }


def _gap(edge_q: np.ndarray, cloud_q: np.ndarray) -> dict[str, float | int | None]:
    if len(edge_q) == 0:
        return {"n": 0, "edge_quality": None, "cloud_quality": None}
    return {
        "n": len(edge_q),
        "edge_quality": round(float(edge_q.mean()), 4),
        "cloud_quality": round(float(cloud_q.mean()), 4),
    }
