"""Showing a run: the table, the JSON object, the PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f}s" if value >= 10_000 else f"{value:.0f}"


def table(report: dict[str, Any]) -> Table:
    """One row per policy with the headline figures."""
    bound = report["bound"]
    title = (
        f"{report['scenario']}: {report['requests']:,} requests over {report['trace_seconds']:.0f} s, "
        f"{report['pool']['pods']} pods x {report['pool']['max_loras']} GPU slots / "
        f"{report['pool']['max_cpu_loras']} CPU; Belady bound {bound['cold_starts']:,} cold starts "
        f"({bound['cold_start_rate']:.4%}); TTFT in ms (served requests); SLO {report['slo_ttft_ms']:.0f} ms"
    )
    t = Table(title=title, title_justify="left")
    columns = [
        "policy", "SLO met", "rejected", "p50", "p95", "p99", "warm p99", "cold p99", "hot p99", "hot p99 no burst", "burst p99",
        "cold starts", "x bound", "thrash", "L0/L1/L2/L3 hits", "slot use", "prefix hits",
    ]  # fmt: skip
    for c in columns:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for name, p in report["policies"].items():
        by_class = p["ttft_ms_by_class"]
        hits = p["hit_ratio"]
        t.add_row(
            name,
            f"{p['slo_attainment']:.2%}",
            f"{p['rejected']:,}",
            _ms(p["ttft_ms"]["p50"]),
            _ms(p["ttft_ms"]["p95"]),
            _ms(p["ttft_ms"]["p99"]),
            _ms(p["warm_ttft_ms"]["p99"]),
            _ms(p["cold_ttft_ms"]["p99"]),
            _ms(p["hot_ttft_p99_ms"]),
            _ms(p["hot_ttft_p99_no_burst_ms"]),
            _ms(by_class["burst"]["p99"]) if "burst" in by_class else "-",
            f"{p['cold_starts']:,}",
            f"{p['cold_starts_over_bound']:.2f}" if p["cold_starts_over_bound"] is not None else "-",
            f"{p['thrash_ratio']:.2f}",
            "/".join(f"{hits[k]:.2f}" for k in ("L0", "L1", "L2", "L3")),
            f"{p['gpu_slot_use']:.2f}",
            f"{p.get('prefix_hit_rate', 0.0):.2%}",
        )
    return t


def print_table(report: dict[str, Any], console: Console | None = None) -> None:
    """Print the table."""
    (console or Console(width=200)).print(table(report))


def without_curves(report: dict[str, Any]) -> dict[str, Any]:
    """The report minus the plot data (what ``--json`` prints)."""
    out = dict(report)
    out["policies"] = {n: {k: v for k, v in p.items() if k != "curves"} for n, p in report["policies"].items()}
    return out


def plot(report: dict[str, Any], directory: Path) -> list[Path]:
    """Write ``ttft_cdf.png`` (TTFT CDF per policy) and ``cold_starts.png`` (cold starts over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, p in report["policies"].items():
        cdf = p["curves"]["cdf_ms"]
        if cdf:
            ax.plot(cdf, [i / (len(cdf) - 1) for i in range(len(cdf))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{report['scenario']}: TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = directory / "ttft_cdf.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, p in report["policies"].items():
        bins = p["curves"]["cold_starts_per_bin"]
        ax.plot([i for i in range(len(bins))], bins, label=name)
    ax.set_xlabel("minute of the trace")
    ax.set_ylabel("cold starts (GPU loads on demand) per minute")
    ax.set_title(f"{report['scenario']}: cold starts over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = directory / "cold_starts.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written
