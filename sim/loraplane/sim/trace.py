"""Request traces: the generator, the named scenarios and the CSV format.

A trace is columns (arrival seconds, served adapter index, tenant index, input tokens, output tokens) sorted by
arrival, plus the adapter and tenant tables. Adapters are served revisions (``name@revision``): a rollout shows up as
traffic moving from one served name to another.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loraplane.api import served_name

if TYPE_CHECKING:
    from loraplane.sim.azure import AzureOptions

#: the tenant class whose traffic is the sweep of cold adapters; every other class counts as "hot" (online)
BURST = "burst"
HOT = "hot"


@dataclass(frozen=True)
class Tenant:
    """A tenant: its class (``hot``, ``burst`` or anything a CSV names) and priority (higher is more important)."""

    name: str
    cls: str = HOT
    priority: int = 0


@dataclass(frozen=True)
class Adapter:
    """A served adapter revision and where a pod has it when the simulation starts."""

    name: str
    tenant: int
    nbytes: int
    on_disk: bool = True


@dataclass
class Trace:
    """A request trace sorted by arrival time."""

    name: str
    tenants: list[Tenant]
    adapters: list[Adapter]
    arrival: list[float]
    adapter: list[int]
    tenant: list[int]
    input_tokens: list[int]
    output_tokens: list[int]
    #: (start, end) seconds of the burst, when the trace has one
    burst_window: tuple[float, float] | None = None
    meta: dict[str, str] = field(default_factory=dict)
    #: prefix structure (all three or none): per request its prefix group (-1: none), whose first ``prefix_tokens``
    #: prompt tokens every request of the group shares (a system prompt), and its session (-1: none), whose turns
    #: each start with the previous turn's prompt and answer (``loraplane.sim.prefix``)
    prefix_group: list[int] | None = None
    prefix_tokens: list[int] | None = None
    session: list[int] | None = None

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def has_prefixes(self) -> bool:
        """True when the trace carries prefix groups and sessions (the simulator then models prefix caches)."""
        return self.prefix_group is not None

    def prefix_columns(self) -> list[list[int]]:
        """The per-request prefix columns the trace has (none or all three)."""
        columns = (self.prefix_group, self.prefix_tokens, self.session)
        return [c for c in columns if c is not None]

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival."""
        return self.arrival[-1] - self.arrival[0] if self.arrival else 0.0

    def has_class(self, cls: str) -> bool:
        """True when some request comes from a tenant of class ``cls``."""
        wanted = {i for i, t in enumerate(self.tenants) if t.cls == cls}
        return any(t in wanted for t in self.tenant)

    def without_class(self, cls: str) -> Trace:
        """The same trace with every request of tenants of class ``cls`` removed (tables unchanged)."""
        dropped = {i for i, t in enumerate(self.tenants) if t.cls == cls}
        keep = [i for i, t in enumerate(self.tenant) if t not in dropped]
        return Trace(
            name=f"{self.name}-without-{cls}",
            tenants=self.tenants,
            adapters=self.adapters,
            arrival=[self.arrival[i] for i in keep],
            adapter=[self.adapter[i] for i in keep],
            tenant=[self.tenant[i] for i in keep],
            input_tokens=[self.input_tokens[i] for i in keep],
            output_tokens=[self.output_tokens[i] for i in keep],
            burst_window=self.burst_window,
            meta=dict(self.meta),
            **{k: [c[i] for i in keep] for k, c in self._prefix_fields().items()},
        )

    def _prefix_fields(self) -> dict[str, list[int]]:
        if self.prefix_group is None or self.prefix_tokens is None or self.session is None:
            return {}
        return {"prefix_group": self.prefix_group, "prefix_tokens": self.prefix_tokens, "session": self.session}

    def to_csv(self) -> str:
        """The trace in the CSV format ``load_csv`` reads."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        prefix = self._prefix_fields()
        with_priority = any(t.priority != 0 for t in self.tenants)
        writer.writerow(
            [*CSV_COLUMNS, "tenant_class", *((PRIORITY_COLUMN,) if with_priority else ()), *(PREFIX_COLUMNS if prefix else ())]
        )
        for i in range(len(self)):
            tenant = self.tenants[self.tenant[i]]
            row = [
                f"{self.arrival[i]:.6f}",
                self.adapters[self.adapter[i]].name,
                tenant.name,
                self.input_tokens[i],
                self.output_tokens[i],
                tenant.cls,
            ]
            if with_priority:
                row.append(tenant.priority)
            if prefix:
                group, session = prefix["prefix_group"][i], prefix["session"][i]
                row += [f"g{group}" if group >= 0 else "", prefix["prefix_tokens"][i], f"s{session}" if session >= 0 else ""]
            writer.writerow(row)
        return out.getvalue()


CSV_COLUMNS = ["timestamp", "adapter", "tenant", "input_tokens", "output_tokens"]
#: optional: the request's tenant's priority (an integer, higher is more important; every row of a tenant the same;
#: without the column every tenant has priority 0)
PRIORITY_COLUMN = "priority"
#: optional: a request's prefix group (any name; empty: none), the prompt tokens the group shares, its session
PREFIX_COLUMNS = ["prefix_group", "prefix_tokens", "session"]


class TraceError(ValueError):
    """A trace file or scenario request that cannot be used."""


def load_csv(path: Path, adapter_bytes: int, max_rows: int = 10_000_000) -> Trace:
    """Read a recorded trace: a header with ``timestamp, adapter, tenant, input_tokens, output_tokens``
    (optionally ``tenant_class``), one request per row. Timestamps are seconds (any origin; rows may be unsorted).
    An optional ``priority`` column gives the row's tenant's priority (an integer; empty: 0), the same on every row
    of a tenant; without it every tenant has priority 0.

    Optional prefix columns (any of them makes the trace one with prefix structure): ``prefix_group`` (a name;
    empty: none) with ``prefix_tokens`` (the prompt tokens every request of the group starts with, at most
    ``input_tokens``), and ``session`` (a name; empty: none): a session's turns, in timestamp order, each start
    with the previous turn's prompt and answer."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{path}: missing column(s) {', '.join(missing)} (have {', '.join(header)})")
    tenants: dict[str, int] = {}
    tenant_list: list[Tenant] = []
    adapters: dict[str, int] = {}
    adapter_list: list[Adapter] = []
    with_prefixes = any(c in header for c in PREFIX_COLUMNS)
    with_priority = PRIORITY_COLUMN in header
    #: per tenant, the line that set its priority
    priority_line: dict[str, int] = {}
    groups: dict[str, int] = {}
    sessions: dict[str, int] = {}
    rows: list[tuple[float, int, int, int, int, int, int, int]] = []
    for line, row in enumerate(reader, start=2):
        if len(rows) >= max_rows:
            raise TraceError(f"{path}: more than {max_rows} rows")
        try:
            ts = float(row["timestamp"])
            n_in = int(row["input_tokens"])
            n_out = int(row["output_tokens"])
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{line}: {exc}") from exc
        if not np.isfinite(ts) or n_in < 0 or n_out < 1:
            raise TraceError(f"{path}:{line}: need a finite timestamp, input_tokens >= 0, output_tokens >= 1")
        adapter_name, tenant_name = (row["adapter"] or "").strip(), (row["tenant"] or "").strip()
        if not adapter_name or not tenant_name:
            raise TraceError(f"{path}:{line}: empty adapter or tenant")
        priority = _priority_cell(row, path, line) if with_priority else 0
        if tenant_name not in tenants:
            tenants[tenant_name] = len(tenant_list)
            tenant_list.append(Tenant(tenant_name, (row.get("tenant_class") or HOT).strip(), priority))
            priority_line[tenant_name] = line
        elif priority != tenant_list[tenants[tenant_name]].priority:
            raise TraceError(
                f"{path}:{line}: tenant {tenant_name!r} has priority {priority} here but "
                f"{tenant_list[tenants[tenant_name]].priority} on line {priority_line[tenant_name]} (a tenant has one priority)"
            )
        if adapter_name not in adapters:
            adapters[adapter_name] = len(adapter_list)
            adapter_list.append(Adapter(adapter_name, tenants[tenant_name], adapter_bytes))
        group, shared, session = _prefix_cells(row, n_in, groups, sessions) if with_prefixes else (-1, 0, -1)
        if shared < 0:
            raise TraceError(f"{path}:{line}: a prefix_group needs prefix_tokens, an integer in [0, input_tokens]")
        rows.append((ts, adapters[adapter_name], tenants[tenant_name], n_in, n_out, group, shared, session))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Trace(
        name=path.stem,
        tenants=tenant_list,
        adapters=adapter_list,
        arrival=[r[0] - t0 for r in rows],
        adapter=[r[1] for r in rows],
        tenant=[r[2] for r in rows],
        input_tokens=[r[3] for r in rows],
        output_tokens=[r[4] for r in rows],
        prefix_group=[r[5] for r in rows] if with_prefixes else None,
        prefix_tokens=[r[6] for r in rows] if with_prefixes else None,
        session=[r[7] for r in rows] if with_prefixes else None,
    )


def _priority_cell(row: dict[str, str], path: Path, line: int) -> int:
    """A CSV row's ``priority`` (empty: 0)."""
    text = (row.get(PRIORITY_COLUMN) or "").strip()
    try:
        return int(text) if text else 0
    except ValueError:
        raise TraceError(f"{path}:{line}: priority must be an integer (got {text!r})") from None


def _prefix_cells(row: dict[str, str], n_in: int, groups: dict[str, int], sessions: dict[str, int]) -> tuple[int, int, int]:
    """A CSV row's (prefix group, shared prefix tokens, session), names numbered in order of appearance; shared
    tokens -1 when a named group has no valid ``prefix_tokens``."""
    group_name, session_name = (row.get("prefix_group") or "").strip(), (row.get("session") or "").strip()
    group, shared, session = -1, 0, -1
    if group_name:
        group = groups.setdefault(group_name, len(groups))
        try:
            shared = int(row.get("prefix_tokens") or "")
        except ValueError:
            shared = -1
        if shared > n_in:
            shared = -1
    if session_name:
        session = sessions.setdefault(session_name, len(sessions))
    return group, shared, session


@dataclass(frozen=True)
class Lengths:
    """Log-normal prompt and output lengths, clipped to [low, cap]."""

    input_median: float = 512
    input_sigma: float = 0.8
    input_cap: int = 2048
    output_median: float = 64
    output_sigma: float = 0.6
    output_cap: int = 128

    def draw(self, rng: np.random.Generator, n: int) -> tuple[list[int], list[int]]:
        """``n`` (input, output) token counts."""
        n_in = np.clip(rng.lognormal(np.log(self.input_median), self.input_sigma, n), 16, self.input_cap)
        n_out = np.clip(rng.lognormal(np.log(self.output_median), self.output_sigma, n), 1, self.output_cap)
        return n_in.astype(int).tolist(), n_out.astype(int).tolist()


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Popularity of ranks 1..n under Zipf(s), summing to 1."""
    w = 1.0 / np.arange(1, n + 1) ** s
    return np.asarray(w / w.sum())


def poisson_arrivals(
    rng: np.random.Generator, n: int, rate: float, start: float = 0.0, diurnal: float = 0.0, period: float = 0.0
) -> np.ndarray:
    """``n`` Poisson arrival times at ``rate`` per second from ``start``; with ``diurnal`` in [0, 1) the rate is
    modulated by ``1 + diurnal * sin(2 pi t / period)`` (by time rescaling, so the count stays ``n``)."""
    times = start + np.cumsum(rng.exponential(1.0 / rate, n))
    if diurnal and period:
        # invert the integrated rate Lambda(t) = t - diurnal * period / (2 pi) * (cos(2 pi t / period) - 1)
        grid = np.linspace(0, times[-1] * 2 + period, 200_000)
        lam = grid - diurnal * period / (2 * np.pi) * (np.cos(2 * np.pi * grid / period) - 1)
        times = np.interp(times - start, lam, grid) + start
    return np.asarray(times)


def _assemble(
    name: str,
    tenants: list[Tenant],
    adapters: list[Adapter],
    parts: list[tuple[np.ndarray, np.ndarray]],
    rng: np.random.Generator,
    lengths: Lengths,
    burst_window: tuple[float, float] | None = None,
) -> Trace:
    """Merge (arrival times, adapter indices) parts into one sorted trace with drawn lengths."""
    arrival = np.concatenate([p[0] for p in parts])
    adapter = np.concatenate([p[1] for p in parts]).astype(int)
    order = np.argsort(arrival, kind="stable")
    arrival, adapter = arrival[order], adapter[order]
    n_in, n_out = lengths.draw(rng, len(arrival))
    tenant_of = np.array([a.tenant for a in adapters])
    return Trace(
        name=name,
        tenants=tenants,
        adapters=adapters,
        arrival=arrival.tolist(),
        adapter=adapter.tolist(),
        tenant=tenant_of[adapter].tolist(),
        input_tokens=n_in,
        output_tokens=n_out,
        burst_window=burst_window,
    )


def gie_multilora(requests: int, seed: int, adapter_bytes: int) -> Trace:
    """The anchors' benchmark shape: 15 adapters at 5 x 12%, 5 x 6%, 5 x 2%; Poisson stages 10 -> 60 QPS;
    inputs <= 2048 tokens, outputs <= 128."""
    rng = np.random.default_rng(seed)
    tenants = [Tenant(f"tenant-{i}") for i in range(15)]
    adapters = [Adapter(served_name(f"adapter-{i}", "v1"), i, adapter_bytes) for i in range(15)]
    shares = np.array([0.12] * 5 + [0.06] * 5 + [0.02] * 5)
    rates = [10, 20, 30, 40, 50, 60]
    stage_s = requests / sum(rates)
    parts, start = [], 0.0
    counts = [round(r * stage_s) for r in rates]
    counts[-1] += requests - sum(counts)
    for rate, count in zip(rates, counts, strict=True):
        times = poisson_arrivals(rng, count, rate, start)
        parts.append((times, rng.choice(15, size=count, p=shares)))
        start += stage_s
    return _assemble("gie-multilora", tenants, adapters, parts, rng, Lengths())


def hot_plus_burst(
    requests: int,
    seed: int,
    adapter_bytes: int,
    hot_rate: float = 40.0,
    burst_rate: float = 20.0,
    block: int = 25,
) -> Trace:
    """Three gold online tenants with 12 hot adapters (Zipf 1.0) at ``hot_rate``, plus a batch tenant that, during
    the middle third, sweeps adapters no pod has, ``block`` consecutive requests each, at ``burst_rate``."""
    rng = np.random.default_rng(seed)
    tenants = [Tenant(f"online-{i}", HOT, priority=1) for i in range(3)] + [Tenant("batch-eval", BURST, priority=0)]
    hot = [Adapter(served_name(f"hot-{i}", "v1"), i % 3, adapter_bytes) for i in range(12)]
    duration = requests / (hot_rate + burst_rate / 3)
    n_hot = round(hot_rate * duration)
    n_burst = requests - n_hot
    window = (duration / 3, duration / 3 + n_burst / burst_rate)
    hot_times = poisson_arrivals(rng, n_hot, hot_rate)
    burst_times = poisson_arrivals(rng, n_burst, burst_rate, start=window[0])
    sweep = 12 + np.arange(n_burst) // block
    cold = [
        Adapter(served_name(f"sweep-{i}", "v1"), 3, adapter_bytes, on_disk=False) for i in range(-(-n_burst // block))
    ]
    parts = [(hot_times, rng.choice(12, size=n_hot, p=zipf_weights(12, 1.0))), (burst_times, sweep)]
    return _assemble("hot-plus-burst", tenants, hot + cold, parts, rng, Lengths(), burst_window=window)


def long_tail_1k(requests: int, seed: int, adapter_bytes: int, rate: float = 50.0) -> Trace:
    """1,000 adapters of 50 tenants with Zipf 1.1 popularity, Poisson arrivals with a diurnal swing of +-50% over
    the trace."""
    rng = np.random.default_rng(seed)
    tenants = [Tenant(f"tenant-{i}") for i in range(50)]
    ranks = rng.permutation(1000)
    adapters = [Adapter(served_name(f"adapter-{i}", "v1"), i % 50, adapter_bytes) for i in range(1000)]
    times = poisson_arrivals(rng, requests, rate, diurnal=0.5, period=requests / rate)
    chosen = ranks[rng.choice(1000, size=requests, p=zipf_weights(1000, 1.1))]
    return _assemble("long-tail-1k", tenants, adapters, [(times, chosen)], rng, Lengths())


def rollout(requests: int, seed: int, adapter_bytes: int, rate: float = 40.0) -> Trace:
    """50 adapters (Zipf 1.0); halfway through, the 5 most popular release revision v2: a 10% canary for a tenth of
    the trace, then all of their traffic. v2 starts absent from every pod (fetched on first use)."""
    rng = np.random.default_rng(seed)
    tenants = [Tenant(f"tenant-{i}") for i in range(10)]
    v1 = [Adapter(served_name(f"adapter-{i}", "v1"), i % 10, adapter_bytes) for i in range(50)]
    v2 = [Adapter(served_name(f"adapter-{i}", "v2"), i % 10, adapter_bytes, on_disk=False) for i in range(5)]
    times = poisson_arrivals(rng, requests, rate)
    chosen = rng.choice(50, size=requests, p=zipf_weights(50, 1.0))
    end = times[-1]
    canary = (times >= end / 2) & (times < end * 0.6) & (rng.random(requests) < 0.1)
    moved = (chosen < 5) & ((times >= end * 0.6) | canary)
    chosen = np.where(moved, 50 + chosen, chosen)
    return _assemble("rollout", tenants, v1 + v2, [(times, chosen)], rng, Lengths())


def zipf_many(
    requests: int,
    seed: int,
    adapter_bytes: int,
    rate: float = 40.0,
    sweep_adapters: int = 60,
    sweep_rate: float = 8.0,
    sweep_s: float = 90.0,
) -> Trace:
    """300 adapters of 8 online tenants (Zipf 0.9, the first two tenants gold) at ``rate`` with a slow +-30 % swing
    over the trace, plus two sheddable batch tenants that, from a third of the way in, each sweep ``sweep_adapters``
    adapters no pod has at ``sweep_rate`` for ``sweep_s`` (shortened for short traces)."""
    rng = np.random.default_rng(seed)
    online = [Tenant(f"tenant-{i}", HOT, priority=1 if i < 2 else 0) for i in range(8)]
    tenants = online + [Tenant(f"batch-{i}", BURST, priority=-1) for i in range(2)]
    adapters = [Adapter(served_name(f"adapter-{i}", "v1"), i % 8, adapter_bytes) for i in range(300)]
    per_sweep = min(round(sweep_rate * sweep_s), requests // 10)
    n_online = requests - 2 * per_sweep
    duration = n_online / rate
    times = poisson_arrivals(rng, n_online, rate, diurnal=0.3, period=duration)
    chosen = rng.permutation(300)[rng.choice(300, size=n_online, p=zipf_weights(300, 0.9))]
    parts = [(times, chosen)]
    start = duration / 3
    block = max(1, -(-per_sweep // sweep_adapters))
    for b in range(2):
        first = len(adapters)
        adapters += [
            Adapter(served_name(f"sweep-{b}-{i}", "v1"), 8 + b, adapter_bytes, on_disk=False)
            for i in range(sweep_adapters)
        ]
        sweep = first + np.minimum(np.arange(per_sweep) // block, sweep_adapters - 1)
        parts.append((poisson_arrivals(rng, per_sweep, sweep_rate, start=start), sweep))
    end = max(float(p[0][-1]) for p in parts[1:]) if per_sweep else start
    return _assemble("zipf-many", tenants, adapters, parts, rng, Lengths(), burst_window=(start, end))


def fleet(
    requests: int,
    seed: int,
    adapter_bytes: int,
    rate: float = 1000.0,
    adapters: int = 10_000,
    tenants: int = 500,
    zipf: float = 1.0,
    swing: float = 0.2,
    sweep_tenants: int = 4,
    sweep_adapters: int = 100,
    sweep_rate: float = 10.0,
    sweep_s: float = 300.0,
) -> Trace:
    """A multi-tenant fleet (sized for 256 pods): ``adapters`` revisions (10,000) of ``tenants`` online tenants
    (500) and ``sweep_tenants`` batch ones. The online adapters' popularity is Zipf(``zipf``) in a random order; each
    belongs to a tenant drawn Zipf(1.0) over the tenants (a few tenants own hundreds of adapters, most a handful);
    one tenant in ten is gold (priority 1), one in five sheddable (priority -1), the rest standard. Arrivals are
    Poisson at ``rate`` with a +-``swing`` diurnal swing over the trace; from a third of the way in each batch
    tenant sweeps its own ``sweep_adapters`` adapters, absent from every pod, ``sweep_rate`` requests/s for
    ``sweep_s`` (shortened for short traces)."""
    rng = np.random.default_rng(seed)
    online = [Tenant(f"tenant-{i}", HOT, priority=1 if i % 10 == 0 else -1 if i % 5 == 4 else 0) for i in range(tenants)]
    batch = [Tenant(f"batch-{i}", BURST, priority=-1) for i in range(sweep_tenants)]
    n_online = adapters - sweep_tenants * sweep_adapters
    if n_online < 1:
        raise TraceError("the fleet needs more adapters than its sweeps take")
    owner = rng.choice(tenants, size=n_online, p=zipf_weights(tenants, 1.0)).tolist()
    table = [Adapter(served_name(f"adapter-{i}", "v1"), owner[i], adapter_bytes) for i in range(n_online)]
    per_sweep = min(round(sweep_rate * sweep_s), requests // (10 * max(1, sweep_tenants))) if sweep_tenants else 0
    n_requests = requests - sweep_tenants * per_sweep
    duration = n_requests / rate
    times = poisson_arrivals(rng, n_requests, rate, diurnal=swing, period=duration)
    chosen = rng.permutation(n_online)[rng.choice(n_online, size=n_requests, p=zipf_weights(n_online, zipf))]
    parts = [(times, chosen)]
    start = duration / 3
    block = max(1, -(-per_sweep // sweep_adapters)) if sweep_adapters else 1
    for b in range(sweep_tenants):
        first = len(table)
        table += [
            Adapter(served_name(f"sweep-{b}-{i}", "v1"), tenants + b, adapter_bytes, on_disk=False)
            for i in range(sweep_adapters)
        ]
        if per_sweep:
            sweep = first + np.minimum(np.arange(per_sweep) // block, sweep_adapters - 1)
            parts.append((poisson_arrivals(rng, per_sweep, sweep_rate, start=start), sweep))
    window = None
    if per_sweep:
        window = (start, max(float(p[0][-1]) for p in parts[1:]))
    return _assemble("fleet", online + batch, table, parts, rng, Lengths(), burst_window=window)


def diurnal_peak(requests: int, seed: int, adapter_bytes: int, rate: float = 50.0, swing: float = 0.5) -> Trace:
    """50 adapters of 10 tenants (Zipf 1.0, three gold tenants, two sheddable) with one diurnal cycle whose peak
    (``rate x (1 + swing)``, 75 req/s) overloads the default pool of 8 pods for a while."""
    rng = np.random.default_rng(seed)
    tenants = [Tenant(f"tenant-{i}", HOT, priority=1 if i < 3 else -1 if i >= 8 else 0) for i in range(10)]
    adapters = [Adapter(served_name(f"adapter-{i}", "v1"), i % 10, adapter_bytes) for i in range(50)]
    times = poisson_arrivals(rng, requests, rate, diurnal=swing, period=requests / rate)
    chosen = rng.choice(50, size=requests, p=zipf_weights(50, 1.0))
    return _assemble("diurnal-peak", tenants, adapters, [(times, chosen)], rng, Lengths())


def prefix_chat(
    requests: int,
    seed: int,
    adapter_bytes: int,
    rate: float = 40.0,
    adapters_per_tenant: int = 4,
    think_s: float = 15.0,
    context_tokens: int = 8192,
) -> Trace:
    """Multi-turn chat on 32 adapters of 8 tenants (Zipf 1.0 over the adapters): each tenant has a system prompt
    (800-2,500 tokens) every one of its sessions starts with; a session's turns (about 6, at most 20) come
    ``think_s`` apart on average (exponential, at least 2 s), each turn's prompt the previous prompt plus its answer
    plus new user text, until the context would pass ``context_tokens``. ``rate`` requests/s over all sessions."""
    rng = np.random.default_rng(seed)
    n_tenants = 8
    tenants = [Tenant(f"tenant-{i}") for i in range(n_tenants)]
    n_adapters = n_tenants * adapters_per_tenant
    adapters = [Adapter(served_name(f"chat-{i}", "v1"), i % n_tenants, adapter_bytes) for i in range(n_adapters)]
    system = rng.integers(800, 2500, n_tenants)
    weights = zipf_weights(n_adapters, 1.0)[rng.permutation(n_adapters)]
    mean_turns = 6.0
    rows: list[tuple[float, int, int, int, int]] = []  # arrival, adapter, input, output, session
    start, session, max_turns = 0.0, 0, 20
    while len(rows) < requests * 1.1 + 100:
        batch = requests // 4 + 100  # sessions drawn at once
        starts = start + np.cumsum(rng.exponential(mean_turns / rate, batch))
        start = float(starts[-1])
        chosen = rng.choice(n_adapters, size=batch, p=weights).tolist()
        turns = np.minimum(max_turns, rng.geometric(1.0 / mean_turns, batch)).tolist()
        user = np.clip(rng.lognormal(np.log(120), 0.8, (batch, max_turns)), 8, 1024).astype(int).tolist()
        answer = np.clip(rng.lognormal(np.log(150), 0.6, (batch, max_turns)), 8, 512).astype(int).tolist()
        think = np.maximum(2.0, rng.exponential(think_s, (batch, max_turns))).tolist()
        for k in range(batch):
            adapter, at = chosen[k], float(starts[k])
            context = int(system[adapter % n_tenants])
            for turn in range(turns[k]):
                asked, answered = user[k][turn], answer[k][turn]
                if context + asked + answered > context_tokens:
                    break
                rows.append((at, adapter, context + asked, answered, session))
                context += asked + answered
                at += think[k][turn]
            session += 1
    rows.sort(key=lambda r: r[0])
    del rows[requests:]
    chosen = [r[1] for r in rows]
    return Trace(
        name="prefix-chat",
        tenants=tenants,
        adapters=adapters,
        arrival=[r[0] for r in rows],
        adapter=chosen,
        tenant=[adapters[a].tenant for a in chosen],
        input_tokens=[r[2] for r in rows],
        output_tokens=[r[3] for r in rows],
        prefix_group=[adapters[a].tenant for a in chosen],
        prefix_tokens=[int(system[adapters[a].tenant]) for a in chosen],
        session=[r[4] for r in rows],
    )


def rates_trace(rates: dict[str, float], nbytes: dict[str, int], requests: int, seed: int) -> Trace:
    """Poisson traffic at the given per-adapter rates (requests/s), one tenant per adapter, every adapter on disk."""
    names = [n for n, r in rates.items() if r > 0]
    if not names:
        raise TraceError("traffic has no adapter with a positive rate")
    rng = np.random.default_rng(seed)
    weights = np.array([rates[n] for n in names])
    tenants = [Tenant(n.partition("@")[0]) for n in names]
    adapters = [Adapter(n, i, nbytes[n]) for i, n in enumerate(names)]
    times = poisson_arrivals(rng, requests, float(weights.sum()))
    chosen = rng.choice(len(names), size=requests, p=weights / weights.sum())
    return _assemble("planned-traffic", tenants, adapters, [(times, chosen)], rng, Lengths())


#: the real-arrival scenarios (``loraplane.sim.azure``): their requests default to the whole trace, and they take
#: ``AzureOptions``
AZURE_SCENARIOS = ("azure-conv", "azure-code", "azure-merged")
#: requests a generated (synthetic) scenario has unless asked otherwise
DEFAULT_REQUESTS = 200_000


def _azure(name: str) -> Callable[[int, int, int], Trace]:
    def build(requests: int, seed: int, adapter_bytes: int) -> Trace:
        from loraplane.sim.azure import azure_trace  # azure imports this module

        return azure_trace(name, requests, seed, adapter_bytes)

    build.__doc__ = f"{name} with the default AzureOptions (loraplane.sim.azure)"
    return build


SCENARIOS: dict[str, Callable[[int, int, int], Trace]] = {
    "gie-multilora": gie_multilora,
    "hot-plus-burst": hot_plus_burst,
    "long-tail-1k": long_tail_1k,
    "rollout": rollout,
    "zipf-many": zipf_many,
    "diurnal-peak": diurnal_peak,
    "prefix-chat": prefix_chat,
    "fleet": fleet,
    **{name: _azure(name) for name in AZURE_SCENARIOS},
}


def scenario(
    name: str, requests: int | None, seed: int, adapter_bytes: int, options: AzureOptions | None = None
) -> Trace:
    """Generate the named scenario: ``requests`` requests (None: ``DEFAULT_REQUESTS``, or an Azure scenario's whole
    trace; for those a number takes the first ``requests`` of the trace). ``options`` apply to the Azure scenarios
    only."""
    if name not in SCENARIOS:
        raise TraceError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    if requests is not None and requests < 1:
        raise TraceError("requests must be >= 1")
    if name in AZURE_SCENARIOS:
        from loraplane.sim.azure import azure_trace

        return azure_trace(name, requests, seed, adapter_bytes, options)
    if options is not None:
        raise TraceError(f"the Azure options apply to {', '.join(AZURE_SCENARIOS)} only, not to {name}")
    return SCENARIOS[name](DEFAULT_REQUESTS if requests is None else requests, seed, adapter_bytes)
