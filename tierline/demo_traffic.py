"""``tierline demo traffic``: realistic load on the local edge agent, so the console fills with real numbers.

Requests are built from data no model was trained on: line starts from the held-out standard-library files
(``shared.zoo.corpus.held_out_files``, what the cascade benchmark scores) and the zoo's held-out digits
(``<zoo>/data/digits-held-out.npz``). Three kinds, interleaved evenly in the shares ``--mix`` gives:

- ``easy``: complete a line given the file's preceding lines (a few hundred characters of context) and the
  line's first half, at most 16 tokens, stopping at the newline: what the device is good at;
- ``hard``: continue a file from two of its lines only, 48 tokens: little to go on; one in three carries
  ``quality: "high"`` (a client marking a request that matters, which goes to the cloud at once, whatever the
  policy says);
- ``digits``: one held-out 8x8 digit to ``tierline/digits-small`` on ``/v1/inference``; a low-confidence
  one is answered by the cloud's larger classifier.

The LM requests come from ``lm_items``, the one generator of demo LM requests: the demo's escalation policy is
calibrated on the same requests (``policy_items``, the ``lm-traffic`` task of ``tierline bench cascade``), so the
share it promises on the edge is the share of these requests it keeps there (``tierline policies list`` shows both).

Arrivals are a Poisson process at ``--rate`` per second with at most ``--concurrency`` requests in flight (an
arrival waits for a free slot, so the achieved rate is reported). The agent decides each request's tier; its
``x-tierline-tier`` and ``x-tierline-escalation-reason`` headers are counted, with the latency per tier.
The agent and its zoo are found in ``$TIERLINE_DATA_DIR/up.json``, which ``tierline up`` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import click
import httpx
import numpy as np

KINDS = ("easy", "hard", "digits")
DEFAULT_MIX = "easy=0.6,hard=0.25,digits=0.15"
LM_MODELS = ("tierline/lm-edge-onnx-int8", "tierline/lm-edge-onnx", "tierline/lm-edge-tflite", "tierline/lm-edge")
DIGITS_MODEL = "tierline/digits-small"
EASY_CONTEXT_CHARS = 360  # about 120 tokens of the zoo's tokenizer: inside every preset's local context
HARD_CONTEXT_LINES = 2
MIN_LINE_CHARS = 8
MAX_LINE_CHARS = 80
HARD_REFERENCE_CHARS = 400  # of the file after a hard prompt: the reference its first tokens are graded on
HARD_QUALITY_HIGH_SHARE = 1 / 3  # of hard requests carry ``quality: "high"``
REQUEST_TIMEOUT_S = 120.0
DRAIN_S = 60.0  # how long in-flight requests may finish after the duration
TTY_REFRESH_S = 0.5
PLAIN_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class Item:
    kind: str
    path: str
    body: dict[str, Any]
    label: int | None = None  # a digit's true class
    # An LM request's reference, what the file holds after the prompt (calibration grades the tiers on it): easy,
    # the rest of the line; hard, the text that follows the two lines.
    reference: str | None = None


@dataclass(slots=True)
class Stats:
    """What came back, per tier (edge | cloud | mixed), escalation reason and kind."""

    started: float = field(default_factory=time.monotonic)
    stopped: float | None = None  # when the last arrival was due (the end of the duration, or Ctrl-C)
    sent: int = 0
    in_flight: int = 0
    tiers: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    kinds: dict[str, Counter[str]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    degraded: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    digits_right: Counter[str] = field(default_factory=Counter)
    digits_total: Counter[str] = field(default_factory=Counter)

    def answered(self, item: Item, tier: str, reason: str | None, degraded: bool, ms: float) -> None:
        self.tiers[tier] += 1
        if reason:
            self.reasons[reason] += 1
        if degraded:
            self.degraded += 1
        self.kinds.setdefault(item.kind, Counter())[tier] += 1
        self.latencies.setdefault(tier, []).append(ms)

    def failed(self, item: Item, what: str) -> None:
        self.errors[what] += 1
        self.kinds.setdefault(item.kind, Counter())["error"] += 1

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def line(self) -> str:
        """The one-line progress display."""
        parts = [f"{self.elapsed():5.1f}s sent {self.sent}"]
        for tier in sorted(self.tiers):
            parts.append(f"{tier} {self.tiers[tier]} (p95 {_fmt_ms(p95(self.latencies.get(tier, [])))})")
        errors = sum(self.errors.values())
        if errors:
            parts.append(f"errors {errors}")
        if self.reasons:
            parts.append("| " + ", ".join(f"{r} {n}" for r, n in self.reasons.most_common()))
        return "  ".join(parts)

    def summary(self, agent: str, rate: float, duration: float, mix: dict[str, float]) -> dict[str, Any]:
        answered = sum(self.tiers.values())
        edge_rows = self.tiers.get("edge", 0)
        elapsed = self.elapsed()
        sending = (self.stopped or time.monotonic()) - self.started
        return {
            "agent": agent,
            "rate_per_s": rate,
            "duration_s": duration,
            "elapsed_s": round(elapsed, 1),
            "achieved_rate_per_s": round(self.sent / sending, 2) if sending > 0 else 0.0,
            "mix": mix,
            "sent": self.sent,
            "answered": answered,
            "errors": dict(self.errors),
            "edge_share": round(edge_rows / answered, 4) if answered else 0.0,
            "tiers": {
                tier: {"requests": n, "p95_ms": _round(p95(self.latencies.get(tier, [])))}
                for tier, n in sorted(self.tiers.items())
            },
            "escalation_reasons": dict(self.reasons.most_common()),
            "degraded": self.degraded,
            "by_kind": {kind: dict(sorted(c.items())) for kind, c in sorted(self.kinds.items())},
            "digits_accuracy": {
                tier: round(self.digits_right[tier] / n, 4) for tier, n in sorted(self.digits_total.items()) if n
            },
        }


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _round(ms: float | None) -> float | None:
    return round(ms, 1) if ms is not None else None


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f} ms"


# -- flags ------------------------------------------------------------------------------------------------------
def parse_positive(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise click.ClickException(f"{flag}: {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise click.ClickException(f"{flag}: must be above 0, not {text}")
    return value


def parse_rate(text: str) -> float:
    """``2``, ``2/s`` or ``120/min``: requests per second."""
    value, _, unit = text.strip().partition("/")
    per = {"": 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0}.get(unit.strip())
    if per is None:
        raise click.ClickException(f"--rate: {text!r}: the unit is /s or /min")
    return parse_positive(value, "--rate") / per


def parse_mix(text: str) -> dict[str, float]:
    """``easy=0.6,hard=0.25,digits=0.15`` (weights, normalised to shares; a kind left out gets none)."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq:
            raise click.ClickException(f"--mix: {part.strip()!r} is not KIND=WEIGHT (kinds: {', '.join(KINDS)})")
        if name not in KINDS:
            raise click.ClickException(f"--mix: unknown kind {name!r} (kinds: {', '.join(KINDS)})")
        if name in weights:
            raise click.ClickException(f"--mix: {name} is given twice")
        try:
            weight = float(value)
        except ValueError:
            raise click.ClickException(f"--mix: {name}={value.strip()!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise click.ClickException(f"--mix: {name} must be 0 or more, not {value.strip()}")
        weights[name] = weight
    total = sum(weights.values())
    if total <= 0:
        raise click.ClickException(f"--mix: {text!r} gives no kind a weight above 0")
    return {k: round(weights[k] / total, 4) for k in KINDS if weights.get(k, 0) > 0}


# -- where the agent is --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Target:
    agent: str
    key: str | None
    zoo: Path


def find_target(agent: str | None, key: str | None, zoo: Path | None) -> Target:
    """The agent's URL and the zoo: the flags, else ``$TIERLINE_DATA_DIR/up.json`` (``tierline up``'s), else
    the configured edge host and port and ``$TIERLINE_ZOO_DIR/demo``. The agent's local key: ``--key``, else
    ``$TIERLINE_EDGE_API_KEY`` (what ``tierline up`` passes its agent)."""
    from shared.settings import CoreSettings, ServiceSettings

    core = CoreSettings()
    try:
        up = json.loads((core.data_dir / "up.json").read_text())
    except (OSError, ValueError):
        up = {}
    if agent is None:
        svc = ServiceSettings()
        agent = str(up.get("edge_url") or f"http://{svc.edge_host}:{svc.edge_port}")
    if not agent.startswith(("http://", "https://")):
        raise click.ClickException(f"--agent: {agent!r} is not an http:// or https:// URL")
    if zoo is None:
        zoo = Path(up["zoo"]) if isinstance(up.get("zoo"), str) else core.zoo_dir / "demo"
    return Target(agent.rstrip("/"), key or os.environ.get("TIERLINE_EDGE_API_KEY") or None, zoo)


# -- the requests ---------------------------------------------------------------------------------------------
def prompt_fits(zoo: Path, model: str) -> Callable[[str, int], bool]:
    """Whether a prompt and ``max_tokens`` fit the device model's context, by its own tokenizer in the zoo (a
    dense stretch of code, a table of hex numbers say, can take more tokens than its characters suggest); every
    prompt fits when the tokenizer or the ``tokenizers`` package is not there (the agent then escalates or
    refuses what does not)."""
    directory = zoo / "artifacts" / model.removeprefix("tierline/")
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        context = int(json.loads((directory / "config.json").read_text())["max_position_embeddings"])
    except Exception:  # no tokenizers package, no tokenizer or config in the zoo, or an unreadable one
        return lambda prompt, max_tokens: True
    return lambda prompt, max_tokens: len(tokenizer.encode(prompt).ids) + max_tokens <= context


def lm_items(
    model: str, rng: random.Random, count: int, fits: Callable[[str, int], bool] | None = None
) -> tuple[list[Item], list[Item]]:
    """``count`` easy and ``count`` hard line-completion requests from the held-out standard-library files, each
    with its reference (``Item.reference``). The one generator of demo LM requests: ``demo traffic`` sends them and
    the ``lm-traffic`` calibration task (``bench.cascade_tasks.run_lm_traffic``) runs both tiers on them, so the
    demo's policy is calibrated on the traffic it is promised for."""
    from shared.zoo.corpus import held_out_files

    fits = fits or (lambda prompt, max_tokens: True)

    files = [f.text for f in held_out_files() if len(f.text) > 2 * EASY_CONTEXT_CHARS]
    if not files:
        raise click.ClickException("no held-out standard-library files to take prompts from")
    easy: list[Item] = []
    hard: list[Item] = []
    for _ in range(count * 20):
        if len(easy) >= count and len(hard) >= count:
            break
        text = rng.choice(files)
        lines = text.splitlines(keepends=True)
        if len(easy) < count:
            i = rng.randrange(1, len(lines))
            line = lines[i].rstrip("\n")
            before = "".join(lines[:i])
            if MIN_LINE_CHARS <= len(line.strip()) <= MAX_LINE_CHARS and len(before) >= EASY_CONTEXT_CHARS:
                context = before[-EASY_CONTEXT_CHARS:]
                context = context[context.find("\n") + 1 :]  # whole lines only
                head = line[: len(line) - len(line.lstrip()) + len(line.strip()) // 2]
                body = {"model": model, "prompt": context + head, "max_tokens": 16, "temperature": 0, "stop": ["\n"]}
                if fits(context + head, 16):
                    easy.append(Item("easy", "/v1/completions", body, reference=line[len(head) :]))
        if len(hard) < count:
            j = rng.randrange(0, max(1, len(lines) - HARD_CONTEXT_LINES))
            start = "".join(lines[j : j + HARD_CONTEXT_LINES])
            if len(start.strip()) >= MIN_LINE_CHARS and len(start) <= EASY_CONTEXT_CHARS and fits(start, 48):
                body = {"model": model, "prompt": start, "max_tokens": 48, "temperature": 0}
                if len(hard) % 3 == 2:
                    body["quality"] = "high"
                following = "".join(lines[j + HARD_CONTEXT_LINES :])[:HARD_REFERENCE_CHARS]
                hard.append(Item("hard", "/v1/completions", body, reference=following))
    return easy, hard


def policy_shares(mix: dict[str, float]) -> dict[str, float]:
    """The shares of the LM requests the edge's policy decides under ``mix``: easy, and the hard requests without
    ``quality: "high"`` (one in three hard requests carries it and goes to the cloud whatever the policy says);
    digits are another model's. Empty when the mix has no LM kind."""
    weights = {"easy": mix.get("easy", 0.0), "hard": mix.get("hard", 0.0) * (1 - HARD_QUALITY_HIGH_SHARE)}
    total = sum(weights.values())
    return {k: round(w / total, 4) for k, w in weights.items() if w > 0} if total > 0 else {}


def policy_items(
    model: str,
    rng: random.Random,
    num_items: int,
    fits: Callable[[str, int], bool] | None = None,
    mix: dict[str, float] | None = None,
) -> list[Item]:
    """``num_items`` requests of ``lm_items`` that the edge's policy decides, in ``mix``'s shares
    (``policy_shares``; default the traffic's ``DEFAULT_MIX``), shuffled: what the demo policy is calibrated on.
    Requests with ``quality: "high"`` are left out (the request, not the policy, sends them to the cloud)."""
    shares = policy_shares(mix if mix is not None else parse_mix(DEFAULT_MIX))
    want = {kind: round(num_items * share) for kind, share in shares.items()}
    if want and sum(want.values()) != num_items:  # rounding: the first kind takes the difference
        first = next(iter(want))
        want[first] += num_items - sum(want.values())
    count = max(want.get("easy", 0), math.ceil(want.get("hard", 0) / (1 - HARD_QUALITY_HIGH_SHARE)) + 1)
    easy, hard = lm_items(model, rng, count, fits)
    decided = [item for item in hard if item.body.get("quality") != "high"]
    items = easy[: want.get("easy", 0)] + decided[: want.get("hard", 0)]
    rng.shuffle(items)
    return items


def digits_items(zoo: Path) -> list[Item]:
    path = zoo / "data" / "digits-held-out.npz"
    if not path.is_file():
        raise click.ClickException(f"no held-out digits at {path} (pass --zoo, or --mix without digits)")
    with np.load(path) as held_out:
        x, y = held_out["x"], held_out["y"]
    return [
        Item("digits", "/v1/inference", {"model_id": DIGITS_MODEL, "inputs": [np.round(row, 4).tolist()]}, int(label))
        for row, label in zip(x, y, strict=True)
    ]


def _lm_model(models: set[str]) -> str | None:
    return next((m for m in LM_MODELS if m in models), None)


def build_items(
    models: set[str], mix: dict[str, float], zoo: Path, rng: random.Random, count: int
) -> dict[str, list[Item]]:
    items: dict[str, list[Item]] = {}
    if mix.get("easy") or mix.get("hard"):
        model = _lm_model(models)
        if model is None:
            raise click.ClickException(
                f"the agent serves none of {', '.join(LM_MODELS)} (use --mix digits=1 for the classifier only)"
            )
        easy, hard = lm_items(model, rng, count, prompt_fits(zoo, model))
        items["easy"], items["hard"] = easy, hard
    if mix.get("digits"):
        if DIGITS_MODEL not in models:
            raise click.ClickException(f"the agent does not serve {DIGITS_MODEL} (use --mix without digits)")
        digits = digits_items(zoo)
        rng.shuffle(digits)
        items["digits"] = digits
    return {k: v for k, v in items.items() if mix.get(k)}


def mixer(weights: dict[str, float]) -> Callable[[], str]:
    """The next kind by smooth weighted round robin: every run, however short, holds the mix's shares (a
    random draw could send no digits at all in 40 requests); the arrivals stay random."""
    total = sum(weights.values())
    current = dict.fromkeys(weights, 0.0)

    def next_kind() -> str:
        for kind, weight in weights.items():
            current[kind] += weight
        kind = max(current, key=lambda k: current[k])
        current[kind] -= total
        return kind

    return next_kind


# -- sending --------------------------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, item: Item, stats: Stats) -> None:
    started = time.monotonic()
    try:
        r = await client.post(item.path, json=item.body)
    except httpx.TimeoutException:
        stats.failed(item, "timeout")
        return
    except httpx.HTTPError as exc:
        stats.failed(item, type(exc).__name__)
        return
    ms = (time.monotonic() - started) * 1000
    if r.status_code != 200:
        stats.failed(item, f"http {r.status_code}")
        return
    tier = r.headers.get("x-tierline-tier", "unknown")
    reason = r.headers.get("x-tierline-escalation-reason")
    stats.answered(item, tier, reason, "x-tierline-degraded" in r.headers, ms)
    if item.label is not None:
        try:
            outputs = r.json()["outputs"][0]
            right = int(np.argmax(np.asarray(outputs, dtype=np.float64))) == item.label
        except (ValueError, KeyError, IndexError, TypeError):
            return
        stats.digits_total[tier] += 1
        stats.digits_right[tier] += int(right)


async def run_traffic(
    target: Target,
    items: dict[str, list[Item]],
    mix: dict[str, float],
    rate: float,
    duration: float,
    concurrency: int,
    rng: random.Random,
    stats: Stats,
    progress: IO[str],
) -> None:
    headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
    next_kind = mixer({k: mix[k] for k in items})
    cursor = dict.fromkeys(items, 0)
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()
    show = asyncio.create_task(_show(stats, progress))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=target.agent, headers=headers, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:

        async def one(item: Item) -> None:
            try:
                await send(client, item, stats)
            finally:
                stats.in_flight -= 1
                slots.release()

        stats.started = time.monotonic()
        deadline = stats.started + duration
        next_at = stats.started
        try:
            while True:
                next_at += rng.expovariate(rate)
                if next_at >= deadline:
                    break
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                await slots.acquire()
                if time.monotonic() >= deadline:
                    slots.release()
                    break
                kind = next_kind()
                pool = items[kind]
                item = pool[cursor[kind] % len(pool)]
                cursor[kind] += 1
                stats.sent += 1
                stats.in_flight += 1
                task = asyncio.create_task(one(item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            stats.stopped = deadline
            if tasks:
                _, pending = await asyncio.wait(set(tasks), timeout=DRAIN_S)
                for task in pending:
                    task.cancel()
                    stats.errors["unfinished"] += 1
        finally:
            if stats.stopped is None:
                stats.stopped = min(time.monotonic(), deadline)
            for task in tasks:
                task.cancel()
            show.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await show
            _emit(stats, progress, final=True)


def _emit(stats: Stats, out: IO[str], *, final: bool = False) -> None:
    if out.isatty():
        out.write("\r\x1b[K" + stats.line() + ("\n" if final else ""))
    else:
        out.write(stats.line() + "\n")
    out.flush()


async def _show(stats: Stats, out: IO[str]) -> None:
    every = TTY_REFRESH_S if out.isatty() else PLAIN_EVERY_S
    while True:
        await asyncio.sleep(every)
        _emit(stats, out)


def check_agent(target: Target) -> set[str]:
    """The models the agent serves; a one-line error when it cannot be reached or refuses the key."""
    headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
    try:
        r = httpx.get(f"{target.agent}/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise click.ClickException(
            f"cannot reach the edge agent at {target.agent} ({type(exc).__name__}); is `tierline up` running? "
            "(or pass --agent URL)"
        ) from None
    if r.status_code == 401:
        raise click.ClickException(
            f"the edge agent at {target.agent} wants its local API key (--key or TIERLINE_EDGE_API_KEY)"
        )
    if r.status_code != 200:
        raise click.ClickException(f"the edge agent at {target.agent} answered /v1/models with {r.status_code}")
    try:
        status = httpx.get(f"{target.agent}/v1/agent", headers=headers, timeout=10.0).json()
    except (httpx.HTTPError, ValueError):
        status = {}
    if not status.get("enrolled"):
        click.echo("warning: the agent is not enrolled with a cloud: every request is answered on the device", err=True)
    return {str(m.get("id")) for m in r.json().get("data", [])}


def _report(summary: dict[str, Any]) -> str:
    lines = [
        f"sent {summary['sent']} in {summary['elapsed_s']} s ({summary['achieved_rate_per_s']}/s), "
        f"answered {summary['answered']}, edge share {summary['edge_share']:.1%}"
    ]
    for tier, row in summary["tiers"].items():
        lines.append(f"  {tier:<6} {row['requests']:>5} requests  p95 {_fmt_ms(row['p95_ms'])}")
    for reason, n in summary["escalation_reasons"].items():
        lines.append(f"  escalated: {reason} {n}")
    for what, n in summary["errors"].items():
        lines.append(f"  failed: {what} {n}")
    for tier, accuracy in summary["digits_accuracy"].items():
        lines.append(f"  digits right on {tier}: {accuracy:.1%}")
    return "\n".join(lines)


@click.group()
def demo() -> None:
    """Demo helpers for the platform ``tierline up`` runs."""


@demo.command("traffic")
@click.option("--rate", "rate_text", default="2/s", show_default=True, help="mean arrivals (Poisson): N/s or N/min")
@click.option("--duration", "duration_text", default="60", show_default=True, help="seconds to send for")
@click.option(
    "--mix", "mix_text", default=DEFAULT_MIX, show_default=True, help="weights of the kinds: easy, hard, digits"
)
@click.option("--concurrency", "concurrency_text", default="4", show_default=True, help="most requests in flight")
@click.option("--agent", default=None, help="the edge agent's URL [default: from $TIERLINE_DATA_DIR/up.json]")
@click.option("--key", default=None, help="the agent's local API key [default: $TIERLINE_EDGE_API_KEY]")
@click.option(
    "--zoo",
    "zoo_dir",
    default=None,
    type=click.Path(path_type=Path, file_okay=False),
    help="the zoo preset to take held-out digits from [default: up.json's]",
)
@click.option("--seed", "seed_text", default="0", show_default=True, help="random seed (items and arrivals)")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON (progress goes to stderr)")
def traffic(
    rate_text: str,
    duration_text: str,
    mix_text: str,
    concurrency_text: str,
    agent: str | None,
    key: str | None,
    zoo_dir: Path | None,
    seed_text: str,
    as_json: bool,
) -> None:
    """Send held-out prompts and digits, easy and hard, through the local edge agent at a Poisson rate, with a
    live line of counts per tier and escalation reason; a summary at the end (Ctrl-C stops early)."""
    rate = parse_rate(rate_text)
    duration = parse_positive(duration_text, "--duration")
    mix = parse_mix(mix_text)
    concurrency_f = parse_positive(concurrency_text, "--concurrency")
    if concurrency_f != int(concurrency_f) or concurrency_f > 256:
        raise click.ClickException(f"--concurrency: a whole number from 1 to 256, not {concurrency_text}")
    try:
        seed = int(seed_text)
    except ValueError:
        raise click.ClickException(f"--seed: {seed_text!r} is not a whole number") from None
    target = find_target(agent, key, zoo_dir)
    models = check_agent(target)
    rng = random.Random(seed)
    count = max(50, min(2000, math.ceil(rate * duration)))
    items = build_items(models, mix, target.zoo, rng, count)
    stats = Stats()
    progress = sys.stderr if as_json else sys.stdout
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even when a shell started us ignoring it
    try:
        asyncio.run(run_traffic(target, items, mix, rate, duration, int(concurrency_f), rng, stats, progress))
    except KeyboardInterrupt:
        progress.write("\n")
    summary = stats.summary(target.agent, round(rate, 4), duration, mix)
    click.echo(json.dumps(summary, indent=2) if as_json else _report(summary))
