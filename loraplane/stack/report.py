"""The demo's report: one self-contained HTML page with inline SVG charts, built from what the demo recorded.

``demo_report`` is a pure function of the recorded data (the summary and every request), so it is tested without a
running stack: TTFT by tier over time, the rollout timeline (AdapterRevision phases over time) and the picker's
decisions by outcome.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplane.stack.demo import DemoResult, RequestRecord

#: request class -> (label, colour); the classes of ``request_class``
CLASSES = {"gpu": ("GPU slot (warm)", "#2a9d8f"), "cpu": ("host cache", "#e9a23b"),
           "cold": ("disk / nowhere (cold)", "#d1495b"), "failed": ("failed", "#555555")}
PHASE_COLOURS = ("#8ecae6", "#219ebc", "#5e60ce", "#7400b8", "#f4a261", "#e76f51", "#2a9d8f", "#90be6d")
WIDTH, PLOT_HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 900, 260, 84, 16, 16, 40
FONT = 'font-family="sans-serif" font-size="11"'


def request_class(record: RequestRecord) -> str:
    """gpu / cpu / cold by the tier the serving pod reported just before the request; failed when it failed."""
    if record.status != 200:
        return "failed"
    return record.tier_before if record.tier_before in ("gpu", "cpu") else "cold"


def _text(x: float, y: float, label: str, anchor: str = "middle", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {FONT} {extra}>{html.escape(label)}</text>'


def _svg(body: list[str], height: int) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}">' + "".join(body) + "</svg>")


def _x_axis(scale_x: float, x_max: float, y: float, label: str) -> list[str]:
    step = _nice_step(x_max)
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}" stroke="#333"/>']
    tick = 0.0
    while tick <= x_max + 1e-9:
        x = LEFT + tick * scale_x
        out += [f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#333"/>', _text(x, y + 15, f"{tick:g}")]
        tick += step
    out.append(_text((LEFT + WIDTH - RIGHT) / 2, y + 32, label))
    return out


def _nice_step(span: float, ticks: int = 8) -> float:
    raw = max(span, 1e-9) / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def ttft_chart(records: Sequence[RequestRecord], rollout_applied_at_s: float | None) -> str:
    """TTFT of every request (log scale) against when it was sent, one colour per tier; phases shaded."""
    timed = [r for r in records if r.ttft_ms is not None and r.ttft_ms > 0]
    if not timed:
        return "<p>no request was timed</p>"
    x_max = max(r.sent_at_s for r in timed) or 1.0
    low = 10 ** math.floor(math.log10(min(r.ttft_ms or 1.0 for r in timed)))
    high = 10 ** math.ceil(math.log10(max(r.ttft_ms or 1.0 for r in timed) * 1.01))
    scale_x = (WIDTH - LEFT - RIGHT) / x_max
    bottom = TOP + PLOT_HEIGHT

    def y_of(ms: float) -> float:
        return bottom - (math.log10(ms) - math.log10(low)) / (math.log10(high) - math.log10(low)) * PLOT_HEIGHT

    body = []
    spans: dict[str, list[float]] = {}
    for r in timed:
        spans.setdefault(r.phase, []).append(r.sent_at_s)
    for i, (phase, times) in enumerate(spans.items()):
        x0, x1 = LEFT + min(times) * scale_x, LEFT + max(times) * scale_x
        body += [f'<rect x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 1):.1f}" height="{PLOT_HEIGHT}" '
                 f'fill="{"#f3f3f3" if i % 2 == 0 else "#e8eef5"}"/>', _text(x0 + 4, TOP + 12, phase, "start")]
    decade = low
    while decade <= high * 1.001:
        for m in (1, 2, 5):
            value = decade * m
            if low <= value <= high:
                y = y_of(value)
                body += [f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>',
                         _text(LEFT - 6, y + 4, f"{value:g}", "end")]
        decade *= 10
    body.append(_text(14, TOP + PLOT_HEIGHT / 2, "TTFT, ms (log)", extra=f'transform="rotate(-90 14 {TOP + PLOT_HEIGHT / 2})"'))
    if rollout_applied_at_s is not None:
        x = LEFT + rollout_applied_at_s * scale_x
        body += [f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}" stroke="#5e60ce" stroke-dasharray="4 3"/>',
                 _text(x + 4, bottom - 6, "v2 applied", "start")]
    for cls, (label, colour) in CLASSES.items():
        points = [r for r in timed if request_class(r) == cls]
        body += [f'<circle cx="{LEFT + r.sent_at_s * scale_x:.1f}" cy="{y_of(r.ttft_ms or low):.1f}" r="2.2" '
                 f'fill="{colour}" fill-opacity="0.75"><title>{html.escape(f"{r.model}: {r.ttft_ms:.1f} ms ({label})")}'
                 "</title></circle>" for r in points]
    body += _x_axis(scale_x, x_max, bottom, "seconds since the first request")
    legend_x = LEFT + 8
    for cls, (label, colour) in CLASSES.items():
        count = sum(request_class(r) == cls for r in timed)
        body += [f'<circle cx="{legend_x}" cy="{bottom + 52}" r="4" fill="{colour}"/>',
                 _text(legend_x + 8, bottom + 56, f"{label}: {count}", "start")]
        legend_x += 190
    return _svg(body, bottom + BOTTOM + 30)


def rollout_chart(result: DemoResult) -> str:
    """The new revision's phases as bars from when it entered each to when it entered the next, weight on each."""
    steps = result.rollout
    if not steps:
        return "<p>the rollout recorded no phase</p>"
    end = steps[-1].at_s + max(1.0, 0.08 * steps[-1].at_s)
    scale_x = (WIDTH - LEFT - RIGHT - 40) / end
    row = 22
    body = []
    for i, step in enumerate(steps):
        until = steps[i + 1].at_s if i + 1 < len(steps) else end
        x, y = LEFT + step.at_s * scale_x, TOP + i * row
        body += [f'<rect x="{x:.1f}" y="{y}" width="{max((until - step.at_s) * scale_x, 2):.1f}" height="{row - 4}" '
                 f'fill="{PHASE_COLOURS[i % len(PHASE_COLOURS)]}"><title>{html.escape(step.phase)} at '
                 f'{step.at_s:.2f} s</title></rect>',
                 _text(LEFT - 6, y + row / 2 + 2, step.phase, "end"),
                 _text(x + 4 + max((until - step.at_s) * scale_x, 2), y + row / 2 + 2, f"{step.weight} %", "start")]
    body += _x_axis(scale_x, end, TOP + len(steps) * row + 4, "seconds since kubectl apply (traffic weight %)")
    return _svg(body, TOP + len(steps) * row + BOTTOM + 10)


def decisions_chart(decisions: dict[str, int]) -> str:
    """The picker's decisions over the demo, one bar per outcome."""
    if not decisions:
        return "<p>the picker recorded no decision</p>"
    ordered = sorted(decisions.items(), key=lambda kv: -kv[1])
    top = max(count for _, count in ordered) or 1
    row, left = 24, 140
    body = []
    for i, (outcome, count) in enumerate(ordered):
        y, width = TOP + i * row, count / top * (WIDTH - left - 90)
        body += [_text(left - 6, y + row / 2 + 2, outcome, "end"),
                 f'<rect x="{left}" y="{y}" width="{max(width, 1):.1f}" height="{row - 6}" fill="#219ebc"/>',
                 _text(left + width + 6, y + row / 2 + 2, str(count), "start")]
    return _svg(body, TOP + len(ordered) * row + 10)


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{cells}</tr>{lines}</table>"


def demo_report(result: DemoResult, records: Sequence[RequestRecord], rollout_name: str) -> str:
    """The whole page: the charts, the TTFT table and the checks."""
    ttft_rows = [(CLASSES[tier][0], s.count, *("-" if v is None else f"{v:.1f}" for v in (s.p50_ms, s.p95_ms, s.mean_ms)))
                 for tier, s in result.ttft_by_tier.items()]
    checks = [("verdict", "ok" if result.ok else "problems found"), ("requests", result.requests),
              ("errors", len(result.errors)), ("wrong-revision responses", len(result.wrong_revision)),
              ("warm revisions served by a warm pod", f"{result.warm_landed}/{result.warm_available}"),
              ("rollout ended", result.rollout_final_phase), ("previous revision", result.previous_revision_phase),
              ("served after the rollout", result.served_after_rollout),
              ("engine requests by adapter tier on arrival (L2: read from disk first)", result.engine_requests_by_tier),
              ("wall time", f"{result.wall_seconds} s")]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>loraplane demo report</title>
<style>body{{font-family:sans-serif;max-width:940px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:0.5em 0 1.5em}}td,th{{border:1px solid #ccc;padding:3px 10px;text-align:right}}
th{{background:#f0f0f0}}h2{{margin-top:1.6em}}</style></head><body>
<h1>loraplane demo report</h1>
<p>Every request went through Envoy and the picker to a real engine; its tier is the one the serving pod reported
for the served revision just before the request.</p>
<h2 id="ttft">TTFT by tier over time</h2>
{ttft_chart(records, result.rollout_applied_at_s)}
{_table(("serving pod held it in", "requests", "p50 ms", "p95 ms", "mean ms"), ttft_rows)}
<h2 id="rollout">Rollout timeline: {html.escape(rollout_name)}</h2>
{rollout_chart(result)}
<h2 id="decisions">Picker decisions by outcome</h2>
{decisions_chart(result.decisions)}
<h2 id="checks">Checks</h2>
{_table(("check", "value"), checks)}
</body></html>
"""
