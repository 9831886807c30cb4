"""Escalation-signal math and the edge policy that decides whether a local answer is good enough.

Pure numpy, shared by the edge agent (deciding per request), the cascade benchmark and calibration.
Every signal is oriented as a *confidence*: higher means the local answer is more likely right, and the
policy escalates when ``confidence < threshold``.

Signals per generated token (from the raw model distribution at that step):
- ``mean_logprob``: mean log-probability of the chosen tokens (≤ 0).
- ``min_margin``: the smallest top-1 minus top-2 probability over the tokens, in [0, 1].
- ``norm_entropy``: 1 - mean normalised entropy (entropy / log V), in [0, 1].
For a classifier (one distribution): ``softmax_margin`` (top-1 - top-2 probability), ``max_prob`` and
``norm_entropy``.

Prompt-side LM signals (``copy_signals``, token ids only): ``prompt_novelty`` (how little of the prompt's tail an
in-context copy predictor gets right) and ``copy_kept`` (low when the text is copyable and the edge's answer does
not follow the copy). They see where a model that uses its context well gains, which the confidence signals do
not: on long prompts the edge repeats confidently.

A ``LearnedRouter`` is a logistic regression over the signals plus prompt length; its confidence is the
predicted probability that the local answer matches what the cloud would have done (or, fitted on
``no_loss_target``, that keeping the request local loses nothing against the cloud).

A ``LinearProbe`` (signal ``hidden_probe``) is a linear layer on the edge model's own hidden state, trained on
validation data and shipped in the policy (``EdgePolicy.probe``). It reads what the runtime already produces:
- ``mean_logits`` (LM): the logits averaged over the generated tokens. With tied embeddings the logits are
  ``E @ h`` (``h`` the final normalised hidden state), so a linear layer on the mean hidden state is a linear
  layer on the mean logits: the probe is trained on ``h = pinv(E) @ logits`` and shipped folded onto the logits
  (``fold_hidden_probe``), with no change to the exported model.
- ``pixels`` (classifier): the request's input features, the logits' inputs of the micro model (its pooling is
  linear and folded in).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigurationError

LM_SIGNALS = ("mean_logprob", "min_margin", "norm_entropy")
CLASSIFIER_SIGNALS = ("softmax_margin", "max_prob", "norm_entropy")
COPY_SIGNALS = (
    "prompt_novelty",
    "copy_kept",
    "prompt_novelty_all",
    "copy_unavailable",
    "copy_first_kept",
    "suffix_novelty",
    "copy_run_missed",
)
COPY_TAIL_TOKENS = 32
SUFFIX_CAP_TOKENS = 32
ROUTER = "router"
ROUTER_GAIN = "router_gain"  # the learned router fitted on no_loss_target; ships as signal "router"
# router_gain with the gain probe's confidence (feature ``hidden_probe``) among its features; ships as signal
# "router" with the probe in the policy (``EdgePolicy.probe``)
ROUTER_GAIN_PROBE = "router_gain_probe"
L2_GRID = (1e-3, 1e-2, 0.1, 1.0)  # the router's L2 strengths ``fit_router_cv`` chooses from
HIDDEN_PROBE = "hidden_probe"
PROBE_INPUTS = ("mean_logits", "pixels")
MODES = ("local-first", "cloud-first", "local-only", "cloud-only")
POLICY_SCHEMA = "tierline.edge-policy/v1"


def _probs(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    return p


@dataclass(frozen=True, slots=True)
class StepSignal:
    """What one generated token says about the model's confidence."""

    logprob: float
    margin: float
    norm_entropy: float  # entropy / log(V), 0 = certain, 1 = uniform


def step_signal(logits: np.ndarray, token: int) -> StepSignal:
    """One pass-light computation per generated token (it runs inside the decode loop): float32, the
    entropy from ``log Z - E[z]`` instead of ``p log p``, the runner-up by masking the top entry."""
    x = np.asarray(logits, dtype=np.float32)
    n = x.shape[-1]
    top = int(x.argmax())
    z = x - x[top]
    e = np.exp(z)
    total = float(e.sum())
    log_total = math.log(total)
    # H = -sum p log p with p = e / total and log p = z - log_total.
    entropy = log_total - float(np.dot(e, z)) / total
    if n > 1:
        saved = e[top]
        e[top] = -1.0
        second = float(e.max())
        e[top] = saved
    else:
        second = 0.0
    return StepSignal(
        logprob=float(z[token]) - log_total,
        margin=(1.0 - second) / total,
        norm_entropy=max(0.0, entropy) / math.log(n) if n > 1 else 0.0,
    )


def step_signals(logits: np.ndarray, tokens: np.ndarray | list[int]) -> list[StepSignal]:
    """``step_signal`` for every generated token at once (logits ``[T, V]``): one vectorised pass, so a
    whole answer's evidence costs about what one token's did."""
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2 or len(x) == 0:
        return []
    t = np.asarray(tokens, dtype=np.int64)
    n = x.shape[-1]
    rows = np.arange(len(x))
    top = x.argmax(axis=-1)
    z = x - x[rows, top][:, None]
    e = np.exp(z)
    total = e.sum(axis=-1)
    log_total = np.log(total)
    entropy = np.maximum(log_total - np.einsum("tv,tv->t", e, z) / total, 0.0)
    if n > 1:
        e[rows, top] = -1.0
        second = e.max(axis=-1)
    else:
        second = np.zeros(len(x), dtype=np.float32)
    logprob = z[rows, t] - log_total
    margin = (1.0 - second) / total
    norm = entropy / math.log(n) if n > 1 else np.zeros(len(x))
    return [StepSignal(float(a), float(b), float(c)) for a, b, c in zip(logprob, margin, norm, strict=True)]


def lm_signals(steps: list[StepSignal]) -> dict[str, float]:
    """Summarise a generation; an empty generation is maximally confident (there is nothing to doubt)."""
    if not steps:
        return {"mean_logprob": 0.0, "min_margin": 1.0, "norm_entropy": 1.0}
    return {
        "mean_logprob": sum(s.logprob for s in steps) / len(steps),
        "min_margin": min(s.margin for s in steps),
        "norm_entropy": 1.0 - sum(s.norm_entropy for s in steps) / len(steps),
    }


def copy_lookup(ids: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per position, whether an in-context copy predictor has a prediction (``has``: the two tokens before it
    occurred earlier) and whether it gets the token right (``hits``: the token that followed the latest earlier
    occurrence of those two tokens is this one). Positions 0-1 have neither. One stable sort, no per-token loop."""
    t = np.asarray(ids, dtype=np.int64)
    has = np.zeros(len(t), dtype=bool)
    hits = np.zeros(len(t), dtype=bool)
    if len(t) < 3:
        return has, hits
    keys = t[:-2] * (int(t.max()) + 1) + t[1:-1]  # keys[j - 2]: the bigram before position j
    order = np.argsort(keys, kind="stable")  # equal bigrams stay in position order
    same = keys[order[1:]] == keys[order[:-1]]
    later, earlier = order[1:][same] + 2, order[:-1][same] + 2  # a position and the latest earlier one like it
    has[later] = True
    hits[later] = t[earlier] == t[later]
    return has, hits


def copy_hits(ids: np.ndarray | list[int]) -> np.ndarray:
    """Per position, whether an in-context copy predictor gets the token right: the token that followed the latest
    earlier occurrence of the two tokens before it (an induction-style bigram lookup; positions 0-1 and bigrams
    seen for the first time are misses)."""
    return copy_lookup(ids)[1]


def suffix_match(ids: np.ndarray | list[int], cap: int = SUFFIX_CAP_TOKENS) -> tuple[int, int]:
    """The length (up to ``cap``) of the longest suffix of ``ids`` that also occurs earlier in ``ids``, and where
    the latest such earlier occurrence ends (-1 when the last token never occurred before). One comparison matrix
    (earlier occurrences of the last token x the ``cap`` tokens back from it), no per-token loop."""
    t = np.asarray(ids, dtype=np.int64)
    n = len(t)
    if n < 2 or cap < 1:
        return 0, -1
    ends = np.flatnonzero(t[:-1] == t[-1])  # where an earlier occurrence of the suffix may end, ascending
    if len(ends) == 0:
        return 0, -1
    back = np.arange(min(cap, n - 1))  # an occurrence ending at e can match at most e + 1 <= n - 1 tokens
    before = ends[:, None] - back  # [occurrences, back]: the token ``back`` before each end
    same = (before >= 0) & (t[np.maximum(before, 0)] == t[n - 1 - back])
    lengths = np.where(same.all(axis=1), len(back), same.argmin(axis=1))  # matched tokens up to the first miss
    length = int(lengths.max())
    return length, int(ends[lengths == length][-1])


def copy_signals(
    prompt: np.ndarray | list[int], output: np.ndarray | list[int], tail: int = COPY_TAIL_TOKENS
) -> dict[str, float]:
    """How much the request could be answered by copying from its own prompt, and whether the edge did.

    - ``prompt_novelty``: 1 - the share of the prompt's last ``tail`` tokens that ``copy_hits`` predicts. Low on
      repetitive text (tables, parallel branches), where a model that attends well over the context (the cloud)
      gains most.
    - ``copy_kept``: 1 - (copy share of the prompt tail) x (share of the output tokens the copy predictor misses):
      low when the text is copyable but the edge's answer does not follow it.
    - ``prompt_novelty_all``: ``prompt_novelty`` over the whole prompt.
    - ``copy_unavailable``: 1 when the copy predictor has no prediction for the first generated token (the prompt's
      last two tokens never occurred before), else 0.
    - ``copy_first_kept``: 0 when it has one and the edge's first token is not it (a missed copy derails the
      greedy continuation from its first token), else 1.
    - ``suffix_novelty``: -log(1 + ``suffix_match(prompt)``'s length): low when the prompt ends in a long stretch it has
      seen before.
    - ``copy_run_missed``: ``suffix_novelty`` x (the share of the output tokens that differ from the prompt's
      tokens after the latest earlier occurrence of that stretch, compared position by position over as many as
      the prompt has; 0 when it has none): low when the prompt ends in a long repeated stretch and the edge did not
      continue it as it went on before (what a model that copies its context, the cloud, would have answered).

    All are oriented as confidences (escalate when low) and need only token ids, no model output."""
    p = np.asarray(prompt, dtype=np.int64)
    seq = np.concatenate([p, np.asarray(output, dtype=np.int64)])
    has, hits = copy_lookup(seq)
    n_prompt = len(p)
    window = hits[max(2, n_prompt - tail) : n_prompt]
    prompt_share = float(window.mean()) if len(window) else 0.0
    output_share = float(hits[n_prompt:].mean()) if len(output) else 1.0
    whole = hits[2:n_prompt]
    first_has = bool(has[n_prompt]) if len(output) else False
    first_hit = bool(hits[n_prompt]) if len(output) else False
    repeat, end = suffix_match(p)
    out = np.asarray(output, dtype=np.int64)
    continued = p[end + 1 : end + 1 + len(out)] if repeat > 0 else p[:0]
    m = len(continued)
    missed = float(np.mean(continued != out[:m])) if m else 0.0
    suffix_novelty = -math.log1p(repeat)
    return {
        "prompt_novelty": 1.0 - prompt_share,
        "copy_kept": 1.0 - prompt_share * (1.0 - output_share),
        "prompt_novelty_all": 1.0 - float(whole.mean()) if len(whole) else 1.0,
        "copy_unavailable": 0.0 if first_has else 1.0,
        "copy_first_kept": 0.0 if first_has and not first_hit else 1.0,
        "suffix_novelty": suffix_novelty,
        "copy_run_missed": suffix_novelty * missed,
    }


def classifier_signals(logits: np.ndarray) -> dict[str, np.ndarray]:
    """Signals for a batch of classifier outputs ``[batch, classes]`` (one value per row)."""
    p = _probs(np.atleast_2d(logits))
    top2 = np.sort(p, axis=-1)[:, -2:]
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)
    return {
        "softmax_margin": top2[:, 1] - top2[:, 0],
        "max_prob": top2[:, 1],
        "norm_entropy": 1.0 - ent / math.log(p.shape[-1]),
    }


@dataclass(slots=True)
class LearnedRouter:
    """Logistic regression over standardised features; ``confidence`` = P(local answer is good).

    ``low``/``high``: each feature's range on the items it was fitted on. A feature outside it is clipped to it
    before weighting: a linear model extrapolates without bound, and a request unlike any calibration item (a
    3-token prompt against prompts of ~125 tokens, 10 standard deviations away) would otherwise drive the
    confidence to an extreme the calibration never saw. ``None`` (a router stored before the range was kept):
    no clipping, as it was fitted."""

    features: list[str]
    weights: list[float]
    bias: float
    mean: list[float]
    std: list[float]
    low: list[float] | None = None
    high: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.features)
        for name in ("weights", "mean", "std", "low", "high"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ConfigurationError(f"learned router: {len(values)} {name} for {n} features")

    def _clip(self, x: np.ndarray) -> np.ndarray:
        if self.low is not None:
            x = np.maximum(x, np.array(self.low, dtype=np.float64))
        if self.high is not None:
            x = np.minimum(x, np.array(self.high, dtype=np.float64))
        return x

    def confidence(self, values: dict[str, float]) -> float:
        try:
            x = np.array([values[f] for f in self.features], dtype=np.float64)
        except KeyError as exc:
            raise ConfigurationError(f"learned router needs signal {exc.args[0]!r}") from exc
        x = self._clip(x)
        z = float(((x - np.array(self.mean)) / np.array(self.std)) @ np.array(self.weights) + self.bias)
        return 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))

    def confidences(self, table: dict[str, np.ndarray]) -> np.ndarray:
        x = self._clip(np.stack([np.asarray(table[f], dtype=np.float64) for f in self.features], axis=1))
        z = ((x - np.array(self.mean)) / np.array(self.std)) @ np.array(self.weights) + self.bias
        return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))


def fit_router(
    table: dict[str, np.ndarray], good: np.ndarray, features: list[str], l2: float = 1e-2, steps: int = 500
) -> LearnedRouter:
    """Fit the router by full-batch gradient descent with L2 (no scikit-learn on devices); it keeps each feature's
    range on these items (``LearnedRouter.low``/``high``) to clip new inputs to."""
    x = np.stack([np.asarray(table[f], dtype=np.float64) for f in features], axis=1)
    y = np.asarray(good, dtype=np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)
    xs = (x - mean) / std
    w = np.zeros(x.shape[1])
    b = float(np.log((y.mean() + 1e-6) / (1 - y.mean() + 1e-6)))
    lr = 0.5
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(xs @ w + b, -60, 60)))
        g = p - y
        w -= lr * (xs.T @ g / len(y) + l2 * w)
        b -= lr * float(g.mean())
    return LearnedRouter(
        features, w.tolist(), b, mean.tolist(), std.tolist(), x.min(axis=0).tolist(), x.max(axis=0).tolist()
    )


def fit_router_cv(
    table: dict[str, np.ndarray],
    target: np.ndarray,
    features: list[str],
    edge_good: np.ndarray,
    cloud_good: np.ndarray,
    grid: tuple[float, ...] = L2_GRID,
    folds: int = 5,
    seed: int = 0,
) -> tuple[LearnedRouter, float]:
    """``fit_router`` with the L2 strength of ``grid`` whose out-of-fold confidences (``folds``-fold cross-validation
    within these items) route best (``auc_gain_vs_random`` of the pooled out-of-fold confidences: on a fixed item
    set an increasing function of APGR). Returns the router fitted on all the items and the strength chosen;
    fewer than ``4 * folds`` items: the first strength of ``grid`` without cross-validation."""
    y = np.asarray(target, dtype=np.float64)
    n = len(y)
    if n < 4 * folds or len(grid) == 1:
        return fit_router(table, y, features, l2=grid[0]), grid[0]
    fold = np.random.default_rng(seed).permutation(n) % folds
    best: tuple[float, float] | None = None
    for l2 in grid:
        out = np.empty(n)
        for f in range(folds):
            train, held = fold != f, fold == f
            router = fit_router({k: np.asarray(table[k])[train] for k in features}, y[train], features, l2=l2)
            out[held] = router.confidences({k: np.asarray(table[k])[held] for k in features})
        score = auc_gain_vs_random(out, edge_good, cloud_good)
        if best is None or score > best[0] + 1e-12:
            best = (score, l2)
    assert best is not None
    return fit_router(table, y, features, l2=best[1]), best[1]


def no_loss_target(edge_good: np.ndarray, cloud_good: np.ndarray) -> np.ndarray:
    """A soft label in [0, 1] for a router that ranks by what escalation gains: ``(1 - (cloud - edge)) / 2``
    (1: only the edge is right, 0.5: no difference, 0: only the cloud is right; graded qualities in between).
    Its fitted probability falls as the expected gain of escalating rises, which is the order PGR rewards."""
    gain = np.asarray(cloud_good, dtype=np.float64) - np.asarray(edge_good, dtype=np.float64)
    return np.asarray((1.0 - gain) / 2.0)


@dataclass
class LinearProbe:
    """``confidence = sigmoid(weights . x + bias)`` on the probe input ``x`` (``input``: one of
    ``PROBE_INPUTS``); ``hidden_size`` and ``target`` say what it was trained on. The weights are read as an array
    once (not a field: the policy's JSON keeps the list); a vocabulary-wide list converted on every request cost
    more than the dot product."""

    input: str
    weights: list[float]
    bias: float
    hidden_size: int | None = None
    target: str = "agrees_with_cloud"

    def __post_init__(self) -> None:
        if self.input not in PROBE_INPUTS:
            raise ConfigurationError(f"probe input must be one of {', '.join(PROBE_INPUTS)}, not {self.input!r}")

    def confidences(self, x: np.ndarray) -> np.ndarray:
        """One confidence per row of ``x`` (``[n, len(weights)]``), or one for a single vector."""
        v = np.asarray(x, dtype=np.float64)
        if v.shape[-1] != len(self.weights):
            raise ConfigurationError(f"probe takes {len(self.weights)} inputs, got {v.shape[-1]}")
        z = v @ self._weights() + self.bias
        return np.asarray(1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0))))

    def _weights(self) -> np.ndarray:
        cached = self.__dict__.get("_weights_array")
        if cached is None or cached[0] is not self.weights:  # weights replaced: read them again
            cached = self.__dict__["_weights_array"] = (self.weights, np.asarray(self.weights, dtype=np.float64))
        return np.asarray(cached[1])

    def confidence(self, x: np.ndarray) -> float:
        return float(self.confidences(np.asarray(x).reshape(-1)))


def fold_hidden_probe(
    router: LearnedRouter, projection: np.ndarray | None, input: str, hidden_size: int | None = None
) -> LinearProbe:
    """A ``LearnedRouter`` fitted on hidden states ``h = projection @ x`` (standardised) as one ``LinearProbe`` on
    the raw input ``x`` (``projection``: ``[d, V]``, e.g. ``pinv(E)``; None when the input is the hidden state)."""
    a = np.asarray(router.weights) / np.asarray(router.std)
    bias = router.bias - float(np.asarray(router.mean) @ a)
    weights = a if projection is None else np.asarray(projection, dtype=np.float64).T @ a
    return LinearProbe(input, [float(w) for w in weights], float(bias), hidden_size)


def hidden_from_logits(embedding: np.ndarray) -> np.ndarray:
    """``pinv(E)`` (``[d, V]``): recovers the final normalised hidden state from logits of a tied-embedding LM."""
    return np.linalg.pinv(np.asarray(embedding, dtype=np.float64))


@dataclass(slots=True)
class EdgePolicy:
    """When a device answers locally. Stored as JSON next to the agent's config or delivered at sync."""

    model: str
    signal: str = "mean_logprob"
    threshold: float = -3.0  # uncalibrated default: escalate when the mean token logprob is below it
    mode: str = "local-first"
    max_prompt_tokens: int | None = None  # None: the local model's context
    max_new_tokens: int = 256  # pre-signal: asking for more goes to the cloud in local-first mode
    stream_window: int = 8  # tokens generated locally before a local-first stream commits to the edge
    router: LearnedRouter | None = None
    calibration: dict[str, Any] = field(default_factory=dict)  # how the threshold was chosen, and the curve
    probe: LinearProbe | None = None  # signal ``hidden_probe``: the agent computes it with ``probe_signal``

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"edge policy for {self.model}: mode must be one of {', '.join(MODES)}")
        if self.signal == ROUTER and self.router is None:
            raise ConfigurationError(f"edge policy for {self.model}: signal 'router' needs router weights")
        if self.signal == HIDDEN_PROBE and self.probe is None:
            raise ConfigurationError(f"edge policy for {self.model}: signal 'hidden_probe' needs probe weights")
        if self.signal not in (*LM_SIGNALS, *COPY_SIGNALS, *CLASSIFIER_SIGNALS, ROUTER, HIDDEN_PROBE):
            raise ConfigurationError(f"edge policy for {self.model}: unknown signal {self.signal!r}")

    def confidence(self, signals: dict[str, float]) -> float:
        if self.signal == ROUTER:
            assert self.router is not None
            return self.router.confidence(signals)
        if self.signal not in signals:
            raise ConfigurationError(f"edge policy for {self.model}: no {self.signal!r} signal for this model")
        return signals[self.signal]

    def probe_signal(self, probe_input: np.ndarray | None) -> dict[str, float]:
        """``{"hidden_probe": confidence}`` for this request's probe input, or nothing without a probe (or
        input): merge it into the signals handed to ``should_escalate``."""
        if self.probe is None or probe_input is None:
            return {}
        return {HIDDEN_PROBE: self.probe.confidence(probe_input)}

    def should_escalate(self, signals: dict[str, float]) -> bool:
        return self.confidence(signals) < self.threshold

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = POLICY_SCHEMA
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EdgePolicy:
        values = {k: v for k, v in data.items() if k != "schema"}
        router = values.pop("router", None)
        probe = values.pop("probe", None)
        try:
            return cls(
                **values,
                router=LearnedRouter(**router) if router else None,
                probe=LinearProbe(**probe) if probe else None,
            )
        except TypeError as exc:
            raise ConfigurationError(f"invalid edge policy: {exc}") from exc


def policy_path(directory: Path, model: str) -> Path:
    return directory / f"{model.replace('/', '__')}.json"


def save_policy(directory: Path, policy: EdgePolicy) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = policy_path(directory, policy.model)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(policy.to_json(), indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def load_policy(directory: Path | None, model: str) -> EdgePolicy | None:
    if directory is None:
        return None
    path = policy_path(directory, model)
    if not path.is_file():
        return None
    try:
        return EdgePolicy.from_json(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"cannot read edge policy {path}: {exc}") from exc


def threshold_for_quality(
    confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray, max_quality_loss: float
) -> tuple[float, float]:
    """The lowest threshold (most edge answers) whose routed quality stays within ``max_quality_loss`` of
    cloud-only. Returns ``(threshold, edge_share)``; ``(inf, 0.0)`` when no threshold qualifies."""
    conf = np.asarray(confidence, dtype=np.float64)
    eg, cg = np.asarray(edge_good, dtype=np.float64), np.asarray(cloud_good, dtype=np.float64)
    target = cg.mean() - max_quality_loss
    best = (math.inf, 0.0)
    for t in np.unique(conf):
        local = conf >= t
        quality = float(np.where(local, eg, cg).mean())
        if quality >= target - 1e-12:
            share = float(local.mean())
            if share > best[1]:
                best = (float(t), share)
    return best


def routed_quality(
    confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray, threshold: float
) -> tuple[float, float]:
    """``(edge_share, quality)`` when items with ``confidence >= threshold`` are answered at the edge."""
    local = np.asarray(confidence, dtype=np.float64) >= threshold
    quality = np.where(local, np.asarray(edge_good, dtype=np.float64), np.asarray(cloud_good, dtype=np.float64))
    return float(local.mean()), float(quality.mean())


def quality_curve(
    confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Edge share and routed quality at every distinct threshold, from all-cloud ``(0, cloud quality)`` to all-edge
    ``(1, edge quality)``. Items with equal confidence move together, so the curve only bends where a threshold
    can actually cut."""
    conf = np.asarray(confidence, dtype=np.float64)
    gain = np.asarray(edge_good, dtype=np.float64) - np.asarray(cloud_good, dtype=np.float64)
    n = len(conf)
    if n == 0:
        raise ValueError("quality_curve needs at least one item")
    order = np.argsort(-conf, kind="stable")
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(conf[order])) + 1, [n]])
    cum = np.concatenate([[0.0], np.cumsum(gain[order])])
    cloud_quality = float(np.mean(np.asarray(cloud_good, dtype=np.float64)))
    return cuts / n, cloud_quality + cum[cuts] / n


def auc_gain_vs_random(confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray) -> float:
    """Area under quality-vs-edge-share over [0, 1] minus that of random routing (the straight line from
    cloud-only to edge-only quality). Positive: the signal sends the right requests up."""
    if len(confidence) == 0:
        return 0.0
    shares, quality = quality_curve(confidence, edge_good, cloud_good)
    area = float(np.sum(np.diff(shares) * (quality[1:] + quality[:-1]) / 2.0))
    return area - (float(np.mean(edge_good)) + float(np.mean(cloud_good))) / 2.0


@dataclass(frozen=True, slots=True)
class SignalChoice:
    """How one signal does on one data set: its threshold for the quality bound, and its whole curve's gain."""

    signal: str
    threshold: float
    edge_share: float
    quality: float
    auc_gain: float


def rank_signals(
    confidences: dict[str, np.ndarray], edge_good: np.ndarray, cloud_good: np.ndarray, max_quality_loss: float
) -> list[SignalChoice]:
    """Every signal's threshold for the bound (``threshold_for_quality``), best first: the largest edge share,
    then the largest ``auc_gain_vs_random``; on a full tie the signal listed first wins (list simple signals
    before the router)."""
    choices = []
    for name, conf in confidences.items():
        threshold, _ = threshold_for_quality(conf, edge_good, cloud_good, max_quality_loss)
        share, quality = routed_quality(conf, edge_good, cloud_good, threshold)
        choices.append(SignalChoice(name, threshold, share, quality, auc_gain_vs_random(conf, edge_good, cloud_good)))
    return sorted(choices, key=lambda c: (-c.edge_share, -c.auc_gain))
