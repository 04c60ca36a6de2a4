"""The demo's HTML report from recorded data: its three charts, what each shows, and nothing loaded from outside."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from loraplane.stack.demo import (
    BURST_PHASE,
    HOT_PHASE,
    ROLLOUT_PHASE,
    DemoResult,
    RequestRecord,
    RolloutStep,
    latency_summary,
)
from loraplane.stack.report import CLASSES, demo_report, request_class

STEPS = [RolloutStep("Pending", 0.0, 0), RolloutStep("Verifying", 0.1, 0), RolloutStep("Prewarming", 0.5, 0),
         RolloutStep("Activating", 0.9, 0), RolloutStep("Probing", 1.4, 0), RolloutStep("Canary(1)", 1.5, 20),
         RolloutStep("Canary(2)", 5.5, 50), RolloutStep("Stable", 9.5, 100)]


def _records() -> list[RequestRecord]:
    records = []
    for i in range(30):
        phase = HOT_PHASE if i < 10 else BURST_PHASE if i < 20 else ROLLOUT_PHASE
        tier = ("gpu", "cpu", "disk", "absent")[i % 4]
        status = 503 if i == 7 else 200
        records.append(RequestRecord(phase, "tail-1" if tier != "gpu" else "support", status, tier_before=tier,
                                     ttft_ms=20.0 + 7 * i, sent_at_s=0.25 * i))
    return records


def _result(records: list[RequestRecord]) -> DemoResult:
    ok = [r for r in records if r.status == 200]
    return DemoResult(
        requests=len(records), errors=["tail-1: 503 no endpoint"], requests_by_phase={HOT_PHASE: 10},
        ttft_by_tier={c: latency_summary([r.ttft_ms or 0 for r in ok if request_class(r) == c])
                      for c in ("gpu", "cpu", "cold")},
        decisions={"warm-gpu": 8, "warm-cpu": 7, "cold": 14}, warm_available=8, warm_landed=8, wrong_revision=[],
        rollout=STEPS, rollout_final_phase="Stable", previous_revision_phase="Retiring",
        served_after_rollout={"claims@v2": 3}, pids={}, gateway_url="http://127.0.0.1:1", wall_seconds=12.0,
        rollout_applied_at_s=5.0)


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_report_has_the_three_charts_drawn_from_the_records() -> None:
    records = _records()
    page = demo_report(_result(records), records, "claims@v2")
    elements = _Elements()
    elements.feed(page)
    sections = [attrs.get("id") for tag, attrs in elements.tags if tag == "h2"]
    assert sections[:3] == ["ttft", "rollout", "decisions"]
    svgs = page.split("<svg")[1:]
    assert len(svgs) == 3
    ttft, rollout, decisions = svgs

    # one point per timed request (plus the legend's four), coloured by tier; cold = disk or absent on the pod
    points = re.findall(r'<circle cx="[0-9.]+" cy="[0-9.]+" r="2.2" fill="(#[0-9a-f]+)"', ttft)
    assert len(points) == len(records)
    by_colour = {colour: points.count(colour) for _, colour in CLASSES.values()}
    assert by_colour == {CLASSES["gpu"][1]: 8, CLASSES["cpu"][1]: 8, CLASSES["cold"][1]: 13, CLASSES["failed"][1]: 1}
    assert "disk / nowhere (cold): 13" in ttft and "failed: 1" in ttft
    assert all(phase in ttft for phase in (HOT_PHASE, BURST_PHASE, "claims@v2 canary + hot")) and "v2 applied" in ttft
    # later requests are further right
    xs = [float(x) for x in re.findall(r'<circle cx="([0-9.]+)" cy="[0-9.]+" r="2.2"', ttft)]
    assert min(xs) < max(xs)

    # one bar per phase, in order, each starting where the phase began, with its weight
    bars = re.findall(r'<rect x="([0-9.]+)" [^>]*><title>([^<]+) at', rollout)
    assert [name for _, name in bars] == [s.phase for s in STEPS]
    starts = [float(x) for x, _ in bars]
    assert starts == sorted(starts) and starts[0] < starts[-1]
    assert "100 %" in rollout and "20 %" in rollout

    # one bar per outcome, longest first, with its count
    outcomes = re.findall(r'text-anchor="end" [^>]*>([a-z-]+)</text>', decisions)
    assert outcomes == ["cold", "warm-gpu", "warm-cpu"]
    assert ">14<" in decisions

    # self-contained: nothing fetched from elsewhere
    assert not any(tag in ("script", "link", "img", "iframe") for tag, _ in elements.tags)
    assert "Stable" in page and "problems found" in page  # the 503 is not the documented unload race


def test_report_of_a_run_without_records_says_so() -> None:
    result = _result([])
    result.rollout, result.decisions = [], {}
    page = demo_report(result, [], "claims@v2")
    assert "no request was timed" in page and "recorded no phase" in page and "recorded no decision" in page
