"""Charts drawn on the server as inline SVG (no script): pure geometry from numbers, rendered by templates."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

NUM_COLOURS = 8  # CSS classes .c0 .. .c7 in console.css


@dataclass(frozen=True, slots=True)
class Rect:
    x: float
    y: float
    width: float
    height: float
    colour: int
    title: str


@dataclass(frozen=True, slots=True)
class StackedChart:
    """Stacked columns, one per x label; ``series`` names the colours in order."""

    width: int
    height: int
    rects: list[Rect]
    labels: list[tuple[float, str]]
    series: list[tuple[int, str]]
    max_value: float
    unit: str


def nice_ceiling(value: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``value`` (a tidy top for the axis)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return float(step * power)
    return float(10 * power)


def stacked_columns(
    values: Mapping[str, Mapping[str, float]],
    x_labels: Sequence[str],
    *,
    unit: str = "",
    width: int = 720,
    height: int = 220,
    max_series: int = NUM_COLOURS,
    display: Callable[[str], str] = str,
) -> StackedChart:
    """``values[series][x]`` stacked per x; series beyond ``max_series`` - 1 (by total) are summed as "other"."""
    totals = sorted(values, key=lambda s: -sum(values[s].values()))
    if len(totals) > max_series:
        keep, rest = totals[: max_series - 1], totals[max_series - 1 :]
        merged: dict[str, dict[str, float]] = {s: dict(values[s]) for s in keep}
        other: dict[str, float] = {}
        for s in rest:
            for x, v in values[s].items():
                other[x] = other.get(x, 0.0) + v
        merged["other"] = other
        series = [*keep, "other"]
    else:
        merged = {s: dict(values[s]) for s in totals}
        series = totals
    top = nice_ceiling(max((sum(merged[s].get(x, 0.0) for s in series) for x in x_labels), default=0.0))
    plot_h = height - 20
    slot = width / max(1, len(x_labels))
    bar_w = max(1.0, slot * 0.7)
    rects: list[Rect] = []
    for i, x in enumerate(x_labels):
        y = float(plot_h)
        for colour, s in enumerate(series):
            v = merged[s].get(x, 0.0)
            if v <= 0:
                continue
            h = plot_h * v / top
            y -= h
            rects.append(
                Rect(
                    round(i * slot + (slot - bar_w) / 2, 2),
                    round(y, 2),
                    round(bar_w, 2),
                    round(h, 2),
                    colour,
                    f"{x} {s}: {v:,.6g} {unit}".strip(),
                )
            )
    every = max(1, math.ceil(len(x_labels) / 8))
    last = len(x_labels) - 1
    labels = [
        (round(i * slot + slot / 2, 2), display(x))
        for i, x in enumerate(x_labels)
        if (i % every == 0 and last - i >= every / 2) or i == last  # the newest is always labelled
    ]
    return StackedChart(width, height, rects, labels, list(enumerate(series)), top, unit)


@dataclass(frozen=True, slots=True)
class CheckBars:
    """One rollout check: baseline and candidate as bars against the limit, scaled to one width."""

    label: str
    outcome: str
    baseline: float | None
    candidate: float | None
    limit: float | None
    baseline_w: float
    candidate_w: float
    limit_x: float | None
    width: int = 300


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(Decimal(str(value)))
    except (ArithmeticError, ValueError):
        return None
    return number if math.isfinite(number) else None


def check_bars(checks: Sequence[Mapping[str, Any]], width: int = 300) -> list[CheckBars]:
    """Bars for the checks of a rollout's last analysis (``last_analysis["checks"]``)."""
    out = []
    for c in checks:
        b, cand, lim = _number(c.get("baseline")), _number(c.get("candidate")), _number(c.get("limit"))
        scale = max((v for v in (b, cand, lim) if v is not None), default=0.0) or 1.0
        out.append(
            CheckBars(
                label=f"{c.get('source', '')} {c.get('metric', '')}".strip(),
                outcome=str(c.get("outcome", "")),
                baseline=b,
                candidate=cand,
                limit=lim,
                baseline_w=round(width * (b or 0.0) / scale, 2),
                candidate_w=round(width * (cand or 0.0) / scale, 2),
                limit_x=round(width * lim / scale, 2) if lim is not None else None,
                width=width,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class CurveChart:
    """Routed quality against the share answered on the edge: a line, reference lines and the chosen point."""

    width: int
    height: int
    line: str  # SVG polyline points "x,y x,y ..."
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    cloud_y: float | None  # cloud-only quality, the reference the policy must stay near
    marker: tuple[float, float] | None  # the chosen threshold's point
    marker_title: str
    plot_left: int
    plot_right: int
    plot_bottom: int


def quality_curve_chart(
    points: Sequence[Mapping[str, Any]],
    *,
    edge_share: float | None,
    quality: float | None,
    cloud_only_quality: float | None,
    threshold: float | None,
    width: int = 520,
    height: int = 240,
) -> CurveChart | None:
    """The curve a calibration recorded (``calibration["curve"]``: edge_share, quality per threshold), with the
    point the policy chose; None when there are no usable points."""
    xy = [(_number(p.get("edge_share")), _number(p.get("quality"))) for p in points]
    clean = sorted((x, y) for x, y in xy if x is not None and y is not None)
    if not clean:
        return None
    ys = [y for _, y in clean] + [v for v in (quality, cloud_only_quality) if v is not None]
    low = math.floor(min(ys) * 20) / 20  # the quality axis in steps of 0.05 around the data
    high = max(low + 0.05, math.ceil(max(ys) * 20) / 20)
    left, bottom, top, right = 44, height - 24, 8, width - 20

    def sx(x: float) -> float:
        return round(left + (right - left) * min(max(x, 0.0), 1.0), 2)

    def sy(y: float) -> float:
        return round(bottom - (bottom - top) * (y - low) / (high - low), 2)

    num_y = max(1, round((high - low) / 0.05))
    step = 0.05 * math.ceil(num_y / 5)
    y_ticks = []
    value = low
    while value <= high + 1e-9:
        y_ticks.append((sy(value), f"{value:.2f}"))
        value += step
    marker = None
    title = ""
    if edge_share is not None and quality is not None:
        marker = (sx(edge_share), sy(quality))
        chosen = f"threshold {threshold:.4g}: " if threshold is not None else ""
        title = f"{chosen}{100 * edge_share:.1f} % on the edge, quality {quality:.3f}"
    return CurveChart(
        width=width,
        height=height,
        line=" ".join(f"{sx(x)},{sy(y)}" for x, y in clean),
        x_ticks=[(sx(f), f"{round(100 * f)} %") for f in (0.0, 0.25, 0.5, 0.75, 1.0)],
        y_ticks=y_ticks,
        cloud_y=sy(cloud_only_quality) if cloud_only_quality is not None else None,
        marker=marker,
        marker_title=title,
        plot_left=left,
        plot_right=right,
        plot_bottom=bottom,
    )
