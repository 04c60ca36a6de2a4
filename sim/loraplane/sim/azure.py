"""Real-arrival scenarios from Azure's LLM inference trace 2023: ``azure-conv``, ``azure-code``, ``azure-merged``.

The packaged data (``data/``; CC-BY 4.0, Patel et al., "Splitwise", ISCA 2024) is one hour of two production LLM
services, conversation and code, one row per request: its arrival time, prompt tokens and generated tokens. A
scenario keeps the real arrivals (seconds after the first row of its timeline, divided by the time compression
factor) and the real token counts (clipped to ``INPUT_CLIP`` / ``OUTPUT_CLIP``; no row of the shipped files needs
it). The trace has no adapters or tenants; ``AzureOptions`` parameterises the seeded model that assigns them:

- **families**: adapter ``i`` (of ``adapters``) is in family ``i mod families``. In ``azure-merged`` family ``f``
  belongs to the conversation service when ``f`` is even and to the code service when odd, so the two services'
  adapters are disjoint; in ``azure-conv`` / ``azure-code`` every family belongs to the one service.
- **popularity**: each family ranks its adapters in its own random order and gives rank ``r`` the weight
  ``1 / r ** zipf`` (0: uniform).
- **temporal locality**: a request of a service reuses, with probability ``locality`` (once the service has had a
  request), the adapter of one of that service's last ``locality_window`` requests, uniformly; otherwise it draws a
  family of its service (in proportion to the family's adapters), then an adapter of that family by its Zipf
  ranking. A reuse copies an earlier draw, so each request's adapter still follows the Zipf mixture; locality
  only clusters it in time.
- **tenants**: adapter ``i`` is owned by tenant ``i mod tenants``; a random ``gold_share`` of the tenants (rounded
  to the nearest count) is gold (class ``gold``, priority 1), a random ``sheddable_share`` sheddable (``sheddable``,
  -1), the rest ``standard`` (0).

Rankings, tenant classes and the per-request draws use three independent streams of the seed, so the same options
and seed give the same trace, and changing, say, ``locality`` leaves the rankings and the gold tenants as they were.
``python -m loraplane.sim.azure`` prints the scenarios' shape at x1, x2 and x3 (the table in docs/sim.md).
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import math
from collections import deque
from dataclasses import asdict, dataclass
from importlib import resources

import numpy as np

from loraplane.api import served_name
from loraplane.sim.trace import AZURE_SCENARIOS, Adapter, Tenant, Trace, TraceError, zipf_weights

#: the services of the trace, in the order ``azure-merged`` assigns their families
SERVICES = ("conv", "code")
#: which services each scenario's timeline holds
SCENARIO_SERVICES: dict[str, tuple[str, ...]] = {
    "azure-conv": ("conv",),
    "azure-code": ("code",),
    "azure-merged": ("conv", "code"),
}
assert tuple(SCENARIO_SERVICES) == AZURE_SCENARIOS
DATA_FILES = {service: f"azure-llm-2023-{service}.csv.gz" for service in SERVICES}
HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
#: prompt and generated tokens are clipped to these ranges (inclusive)
INPUT_CLIP = (1, 16_384)
OUTPUT_CLIP = (1, 2_048)
SOURCE = 'Azure LLM inference trace 2023 (CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024)'
#: tenant classes by priority
CLASSES = {1: "gold", 0: "standard", -1: "sheddable"}


@dataclass(frozen=True)
class AzureOptions:
    """The adapter assignment and time compression of an Azure scenario (module docstring); ``None``: the
    default that depends on other values (``families``: one per service of the scenario; ``tenants``: one per 10
    adapters, at least 1)."""

    compress: float = 1.0
    adapters: int = 500
    zipf: float = 1.0
    locality: float = 0.5
    locality_window: int = 8
    families: int | None = None
    tenants: int | None = None
    gold_share: float = 0.1
    sheddable_share: float = 0.2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compress) and self.compress > 0):
            raise TraceError(f"compress must be a finite number > 0 (got {self.compress})")
        if self.adapters < 1:
            raise TraceError(f"adapters must be >= 1 (got {self.adapters})")
        if not (math.isfinite(self.zipf) and self.zipf >= 0):
            raise TraceError(f"zipf must be a finite number >= 0 (got {self.zipf})")
        if not 0 <= self.locality <= 1:
            raise TraceError(f"locality must be in [0, 1] (got {self.locality})")
        if self.locality_window < 1:
            raise TraceError(f"locality_window must be >= 1 (got {self.locality_window})")
        if self.families is not None and not 1 <= self.families <= self.adapters:
            raise TraceError(f"families must be in [1, adapters = {self.adapters}] (got {self.families})")
        if self.tenants is not None and not 1 <= self.tenants <= self.adapters:
            raise TraceError(f"tenants must be in [1, adapters = {self.adapters}] (got {self.tenants})")
        for name in ("gold_share", "sheddable_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise TraceError(f"{name} must be in [0, 1] (got {getattr(self, name)})")
        if self.gold_share + self.sheddable_share > 1:
            raise TraceError(f"gold_share + sheddable_share must be <= 1 (got {self.gold_share} + {self.sheddable_share})")

    def family_count(self, services: int) -> int:
        """The families of a scenario with ``services`` services."""
        return services if self.families is None else self.families

    def tenant_count(self) -> int:
        """The tenants owning the adapters."""
        return max(1, self.adapters // 10) if self.tenants is None else self.tenants


@dataclass(frozen=True)
class ServiceTrace:
    """One service's rows as in its file (read-only arrays, in arrival order)."""

    service: str
    #: arrival times, nanoseconds since the epoch
    arrival_ns: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_ns)


@functools.cache
def load_service(service: str) -> ServiceTrace:
    """The packaged rows of ``service`` (``conv`` or ``code``), unclipped, sorted by arrival (stable)."""
    if service not in DATA_FILES:
        raise TraceError(f"unknown service {service!r}; choose from {', '.join(SERVICES)}")
    name = DATA_FILES[service]
    try:
        raw = resources.files("loraplane.sim").joinpath("data", name).read_bytes()
        text = gzip.decompress(raw).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the packaged trace {name}: {exc}") from exc
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or rows[0] != HEADER:
        raise TraceError(f"{name}: expected the header {','.join(HEADER)}")
    body = rows[1:]
    try:
        stamps = np.array([r[0] for r in body], dtype="datetime64[ns]").astype(np.int64)
        tokens = np.array([(int(r[1]), int(r[2])) for r in body], dtype=np.int64).reshape(-1, 2)
    except (IndexError, ValueError) as exc:
        raise TraceError(f"{name}: {exc}") from exc
    order = np.argsort(stamps, kind="stable")
    arrays = (stamps[order], tokens[order, 0], tokens[order, 1])
    for array in arrays:
        array.setflags(write=False)
    return ServiceTrace(service, *arrays)


def _services(name: str) -> tuple[str, ...]:
    if name not in SCENARIO_SERVICES:
        raise TraceError(f"unknown Azure scenario {name!r}; choose from {', '.join(SCENARIO_SERVICES)}")
    return SCENARIO_SERVICES[name]


def azure_trace(
    name: str, requests: int | None, seed: int, adapter_bytes: int, options: AzureOptions | None = None
) -> Trace:
    """Azure scenario ``name`` (``azure-conv``, ``azure-code`` or ``azure-merged``): the first ``requests`` rows of
    its timeline (None: all of them), arrivals divided by ``options.compress``, adapters and tenants assigned by
    the seeded model of the module docstring. Raises ``TraceError`` on options the scenario cannot use."""
    services = _services(name)
    options = options or AzureOptions()
    families = options.family_count(len(services))
    if families < len(services):
        raise TraceError(f"{name} needs at least {len(services)} families (one per service), got {families}")
    if families > options.adapters:
        raise TraceError(f"families ({families}) must not exceed adapters ({options.adapters})")
    n_tenants = options.tenant_count()
    data = [load_service(s) for s in services]
    total = sum(len(d) for d in data)
    if requests is None:
        requests = total
    if not 1 <= requests <= total:
        raise TraceError(
            f"{name} has {total:,} requests; asked for {requests:,} (leave --requests out for the whole trace, "
            "or ask for fewer: the first N of its timeline)"
        )
    stamps = np.concatenate([d.arrival_ns for d in data])
    service_of = np.concatenate([np.full(len(d), k) for k, d in enumerate(data)])
    order = np.argsort(stamps, kind="stable")[:requests]  # ties: conversation first
    stamps, service_of = stamps[order], service_of[order]
    arrival = (stamps - stamps[0]) / 1e9 / options.compress
    n_in = np.concatenate([d.input_tokens for d in data])[order]
    n_out = np.concatenate([d.output_tokens for d in data])[order]
    clipped_in = int(np.count_nonzero((n_in < INPUT_CLIP[0]) | (n_in > INPUT_CLIP[1])))
    clipped_out = int(np.count_nonzero((n_out < OUTPUT_CLIP[0]) | (n_out > OUTPUT_CLIP[1])))
    n_in, n_out = np.clip(n_in, *INPUT_CLIP), np.clip(n_out, *OUTPUT_CLIP)

    rank_rng, tenant_rng, request_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    members = [np.arange(f, options.adapters, families) for f in range(families)]
    ranked = [rank_rng.permutation(m) for m in members]
    # fresh draws for every request: a family of its service, then an adapter of the family by Zipf rank
    fresh = np.empty(requests, dtype=np.int64)
    for k in range(len(services)):
        mine = np.flatnonzero(service_of == k)
        own = [f for f in range(families) if f % len(services) == k]
        sizes = np.array([len(members[f]) for f in own], dtype=float)
        family = request_rng.choice(len(own), size=len(mine), p=sizes / sizes.sum())
        for j, f in enumerate(own):
            picked = mine[family == j]
            rank = request_rng.choice(len(members[f]), size=len(picked), p=zipf_weights(len(members[f]), options.zipf))
            fresh[picked] = ranked[f][rank]
    reuse = (request_rng.random(requests) < options.locality).tolist()
    which = request_rng.random(requests).tolist()
    recent: list[deque[int]] = [deque(maxlen=options.locality_window) for _ in services]
    chosen: list[int] = []
    reused = 0
    for i, (k, drawn) in enumerate(zip(service_of.tolist(), fresh.tolist(), strict=True)):
        history = recent[k]
        if history and reuse[i]:
            drawn = history[int(which[i] * len(history))]
            reused += 1
        history.append(drawn)
        chosen.append(drawn)

    shuffled = tenant_rng.permutation(n_tenants).tolist()
    n_gold = math.floor(options.gold_share * n_tenants + 0.5)
    n_shed = min(n_tenants - n_gold, math.floor(options.sheddable_share * n_tenants + 0.5))
    priority = {t: 1 for t in shuffled[:n_gold]} | {t: -1 for t in shuffled[n_gold : n_gold + n_shed]}
    tenants = [Tenant(f"tenant-{t}", CLASSES[priority.get(t, 0)], priority.get(t, 0)) for t in range(n_tenants)]
    adapters = [
        Adapter(served_name(f"{services[(i % families) % len(services)]}-{i}", "v1"), i % n_tenants, adapter_bytes)
        for i in range(options.adapters)
    ]
    meta = {key: str(value) for key, value in asdict(options).items()}
    meta.update(
        families=str(families), tenants=str(n_tenants), seed=str(seed), source=SOURCE,
        clipped_input_rows=str(clipped_in), clipped_output_rows=str(clipped_out), reused=str(reused),
    )  # fmt: skip
    return Trace(
        name=name,
        tenants=tenants,
        adapters=adapters,
        arrival=arrival.tolist(),
        adapter=chosen,
        tenant=[i % n_tenants for i in chosen],
        input_tokens=n_in.tolist(),
        output_tokens=n_out.tolist(),
        meta=meta,
    )


def shape(trace: Trace) -> dict[str, float]:
    """Requests, duration, mean rate and token statistics of a trace (the docs' table)."""
    n_in, n_out = np.asarray(trace.input_tokens), np.asarray(trace.output_tokens)
    out: dict[str, float] = {
        "requests": len(trace),
        "duration_s": trace.duration,
        "req_per_s": len(trace) / trace.duration if trace.duration else 0.0,
    }
    for label, column in (("input", n_in), ("output", n_out)):
        out[f"{label}_mean"] = float(column.mean())
        out[f"{label}_median"] = float(np.median(column))
        out[f"{label}_p99"] = float(np.percentile(column, 99))
    return out


def main() -> None:
    """Print the Azure scenarios' shape at x1, x2 and x3 as a Markdown table (tokens: mean / median / p99)."""
    print("| scenario | compress | requests | duration s | mean req/s | input tokens | output tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in SCENARIO_SERVICES:
        for compress in (1, 2, 3):
            s = shape(azure_trace(name, None, 0, 1, AzureOptions(compress=compress)))
            print(
                f"| `{name}` | x{compress} | {s['requests']:,} | {s['duration_s']:,.1f} | {s['req_per_s']:.2f} "
                f"| {s['input_mean']:,.0f} / {s['input_median']:,.0f} / {s['input_p99']:,.0f} "
                f"| {s['output_mean']:,.0f} / {s['output_median']:,.0f} / {s['output_p99']:,.0f} |"
            )


if __name__ == "__main__":
    main()
