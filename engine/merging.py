"""Dynamic merge: when one or two adapters carry almost every row for a while, serve them from merged weights.

The mechanism is :mod:`loraplane.kernels.layers` (``merge_slot``): a merged adapter's rows run through a separate
``W + scale * B A`` copy with no LoRA ops, every other row (base rows, other adapters) through the base weight,
which is never written, plus its own LoRA. Restoring the base is dropping the copy: exact however often it is done.

This module decides when. :class:`MergePolicy` looks at the rows of each step over a window of steps and keeps
apart what it measured: the engine's step times with the adapter set served unmerged and merged, per case (how
many rows, whether every row is the set's, the set's size and rank). It merges a set that covers at least
``enter_share`` of the rows (mean per-step share over a full window) when the measurement says merging pays for
that case, or, for a case never measured merged, to measure it (a probe): after ``probe_steps`` merged steps the
verdict is in, and a case where merged steps were not at least ``min_gain`` faster is unmerged and not tried again
for ``retry_steps`` steps. Hysteresis: a merged set stays until its share falls below ``exit_share``, and no switch
follows another within a window. A known saving must also repay the measured cost of a switch within as many
steps as the set has dominated so far.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: ``--lora-merge`` modes: ``auto`` (the policy), ``off`` (never), ``force`` (every step, the adapters with the
#: most rows in that step: for tests and benchmarks).
MERGE_MODES = ("auto", "off", "force")


@dataclass(frozen=True)
class MergeConfig:
    """The merge switch and the policy's knobs."""

    mode: str = "auto"
    #: merged adapters at most (each is a copy of every projection weight it touches), where memory allows
    max_merged: int = 2
    #: steps over which shares are averaged; also the least number of steps between two switches
    window: int = 16
    #: a set of adapters is merged when its mean per-step share of rows over the window reaches this ...
    enter_share: float = 0.9
    #: ... and unmerged when it falls below this (hysteresis)
    exit_share: float = 0.6
    #: merged steps must be at least this much faster than unmerged ones of the same case, or merging stops
    min_gain: float = 0.05
    #: timed steps each way before a verdict (medians of these)
    probe_steps: int = 8
    #: after a case did not pay, it is not merged again for this many steps
    retry_steps: int = 2048
    #: a merged copy must fit in this fraction of the memory available on the device
    memory_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in MERGE_MODES:
            raise ValueError(f"--lora-merge must be one of {', '.join(MERGE_MODES)}, got {self.mode!r}")
        if self.max_merged < 0:
            raise ValueError("--max-merged-loras must be >= 0")
        if self.window < 1 or self.probe_steps < 1:
            raise ValueError("the merge window and probe steps must be >= 1")
        if not 0 < self.exit_share <= self.enter_share <= 1:
            raise ValueError("merge shares must satisfy 0 < exit_share <= enter_share <= 1")


#: One verdict per case: (merged set size, largest rank in it, rows bucket, every row in the set).
Case = tuple[int, int, int, bool]


@dataclass
class _Verdict:
    pays: bool
    #: seconds saved per step (unmerged median - merged median)
    saving: float
    #: step number until which a negative verdict holds
    until: int = 0


@dataclass
class MergeDecision:
    """What to change before the coming step."""

    merge: list[Hashable] = field(default_factory=list)
    unmerge: list[Hashable] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.merge or self.unmerge)


def _bucket(rows: int) -> int:
    """Rows per step in powers of two (1, 2, 4, 8, ...): one verdict per bucket."""
    return 1 << max(0, rows.bit_length() - 1)


class MergePolicy:
    """Decides, step by step, which adapters to serve merged (see the module docstring).

    Keys are opaque adapter identities (the engine's ``AdapterState`` objects); ``None`` stands for base rows.
    ``rank_of`` gives a key's rank (verdicts are kept per rank). The policy holds no weights: the engine tells it
    what is merged at every call.
    """

    def __init__(self, config: MergeConfig, rank_of: Callable[[Hashable], int] = lambda _key: 0) -> None:
        self.config = config
        self.rank_of = rank_of
        self.window: deque[Mapping[Hashable | None, int]] = deque(maxlen=config.window)
        self.step = 0
        self.last_switch = -(10**9)
        self.dominant_since: int | None = None
        self.candidate: frozenset[Hashable] = frozenset()
        self.verdicts: dict[Case, _Verdict] = {}
        self.samples: dict[tuple[Case, bool], deque[float]] = {}
        self.switch_seconds: deque[float] = deque(maxlen=8)
        self._withdraw = False

    # --- shares -------------------------------------------------------------------------------------------------
    def share(self, keys: Iterable[Hashable]) -> float:
        """Mean over the window of each step's share of rows that belong to ``keys``."""
        wanted = set(keys)
        if not self.window or not wanted:
            return 0.0
        total = 0.0
        for rows in self.window:
            step_rows = sum(rows.values())
            if step_rows:
                total += sum(n for key, n in rows.items() if key in wanted) / step_rows
        return total / len(self.window)

    def _candidate(self, limit: int) -> frozenset[Hashable]:
        """The smallest set of at most ``limit`` adapters whose share reaches ``enter_share``, or empty."""
        if limit <= 0:
            return frozenset()
        shares: dict[Hashable, float] = {}
        for rows in self.window:
            step_rows = sum(rows.values())
            for key, n in rows.items():
                if key is not None and step_rows:
                    shares[key] = shares.get(key, 0.0) + n / step_rows
        ranked = sorted(shares, key=lambda key: -shares[key])
        for size in range(1, min(limit, len(ranked)) + 1):
            chosen = frozenset(ranked[:size])
            if self.share(chosen) >= self.config.enter_share:
                return chosen
        return frozenset()

    def case(self, rows: Mapping[Hashable | None, int], keys: frozenset[Hashable]) -> Case:
        """The verdict case of a step's ``rows`` served with ``keys`` merged."""
        total = sum(rows.values())
        rank = max((self.rank_of(key) for key in keys), default=0)
        pure = all(key in keys for key, n in rows.items() if n)
        return (len(keys), rank, _bucket(total), pure)

    # --- decisions ----------------------------------------------------------------------------------------------
    def decide(self, rows: Mapping[Hashable | None, int], merged: frozenset[Hashable], room: int) -> MergeDecision:
        """Called before each step with its rows per key: what to merge and unmerge first.

        ``merged``: what is merged now; ``room``: how many more adapters may be merged (``max_merged`` less those
        merged, less those memory would not take).
        """
        self.step += 1
        self.window.append(dict(rows))
        config = self.config
        if config.mode == "off" or config.max_merged == 0:
            return MergeDecision(unmerge=list(merged))
        if config.mode == "force":
            return self._force(rows, merged, room)
        decision = MergeDecision()
        settled = self.step - self.last_switch >= config.window
        if merged:
            if self._withdraw or (settled and self.share(merged) < config.exit_share):
                decision.unmerge = list(merged)
                self._withdraw = False
                self._switched()
            return decision
        candidate = self._candidate(min(config.max_merged, room))
        if candidate != self.candidate:
            self.candidate = candidate
            self.dominant_since = self.step if candidate else None
        if not candidate or not settled or len(self.window) < config.window:
            return decision
        if self._pays(self.case(rows, candidate)):
            decision.merge = list(candidate)
            self._switched()
        return decision

    def _force(self, rows: Mapping[Hashable | None, int], merged: frozenset[Hashable], room: int) -> MergeDecision:
        present = [key for key, n in rows.items() if key is not None and n]
        present.sort(key=lambda key: (-rows[key], key not in merged))
        target = set(present[: self.config.max_merged])
        unmerge = [key for key in merged if key not in target]
        space = room + len(unmerge)
        merge = [key for key in present if key in target and key not in merged][:space]
        return MergeDecision(merge=merge, unmerge=unmerge)

    def _pays(self, case: Case) -> bool:
        verdict = self.verdicts.get(case)
        if verdict is None:  # never measured merged: probe once enough unmerged steps of this case are timed
            return len(self.samples.get((case, False), ())) >= self.config.probe_steps
        if not verdict.pays:
            if self.step < verdict.until:
                return False
            del self.verdicts[case]  # expired: measure again
            self.samples.pop((case, True), None)
            return len(self.samples.get((case, False), ())) >= self.config.probe_steps
        # a known saving must repay a switch within as many steps as the set has dominated so far
        dominated = self.step - (self.dominant_since if self.dominant_since is not None else self.step)
        switch = statistics.median(self.switch_seconds) if self.switch_seconds else 0.0
        return verdict.saving * max(dominated, self.config.window) > switch

    def _switched(self) -> None:
        self.last_switch = self.step

    # --- measurements -------------------------------------------------------------------------------------------
    def record(self, rows: Mapping[Hashable | None, int], merged: frozenset[Hashable], seconds: float, decode: bool) -> None:
        """After a step: its forward time. Only all-decode steps are timed (a prefill's cost depends on prompts)."""
        if not decode or self.config.mode != "auto" or not math.isfinite(seconds):
            return
        present = merged & {key for key, n in rows.items() if n}
        if merged and present:
            case = self.case(rows, merged)
            samples = self.samples.setdefault((case, True), deque(maxlen=4 * self.config.probe_steps))
            samples.append(seconds)
            self._judge(case)
        elif not merged and self.candidate and self.candidate & {key for key, n in rows.items() if n}:
            case = self.case(rows, self.candidate)
            self.samples.setdefault((case, False), deque(maxlen=4 * self.config.probe_steps)).append(seconds)

    def _judge(self, case: Case) -> None:
        merged = self.samples.get((case, True), ())
        unmerged = self.samples.get((case, False), ())
        if len(merged) < self.config.probe_steps or len(unmerged) < self.config.probe_steps:
            return
        before, after = statistics.median(unmerged), statistics.median(merged)
        pays = after <= before * (1 - self.config.min_gain)
        known = self.verdicts.get(case)
        if known is None or known.pays != pays or pays:
            self.verdicts[case] = _Verdict(pays, before - after, 0 if pays else self.step + self.config.retry_steps)
        if not pays:
            self._withdraw = True

    def switched(self, seconds: float) -> None:
        """The engine measured one merge (copy building) in ``seconds``."""
        self.switch_seconds.append(seconds)

    def verdicts_json(self) -> list[dict[str, object]]:
        """The verdicts so far (the bench reports them)."""
        return [{"adapters": c[0], "rank": c[1], "rows": c[2], "pure": c[3], "pays": v.pays,
                 "saving_ms": round(v.saving * 1000, 3)} for c, v in sorted(self.verdicts.items())]


def available_memory(device: torch.device) -> int:
    """Bytes that may still be allocated on ``device``: free GPU memory, or the host's available memory (the
    smaller of ``MemAvailable`` and what a cgroup limit leaves)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: no limit from here


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        return None
