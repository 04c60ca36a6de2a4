"""Dynamic merge: when one or two adapters carry almost every row for a while, serve them from merged weights.

The mechanism is :mod:`loraplane.kernels.layers` (``merge_slot``): a merged adapter's rows run through a separate
``W + scale * B A`` copy with no LoRA ops, every other row (base rows, other adapters) through the base weight,
which is never written, plus its own LoRA. Restoring the base is dropping the copy: exact however often it is done.
And because the base stays, a held copy can be used or not step by step at no cost.

This module decides when. :class:`MergePolicy` looks at the rows of each step over a window of steps. A set of at
most ``max_merged`` adapters whose mean per-step share of rows reaches ``enter_share`` over a full window gets
merged copies (where memory takes them); they are dropped when its share falls below ``exit_share``, and no
switch follows another within a window (hysteresis). Whether a step *uses* the held copies is decided per case
(set size, rank, rows per step in powers of two, whether every row is the set's), from the engine's own step
times: a case never measured is probed by alternating steps with and without the copies (paired, so a load that
changes on shared cores moves both sides), and after ``probe_steps`` of each it is served merged only if the
median of the pairs' merged / unmerged ratios is at most ``1 - min_gain``. A set whose every measured case does not pay is unmerged and not merged
again for ``retry_steps`` steps; a set that pays is merged again when its saving per step, over as many steps as
it has dominated, repays the measured cost of building its copies.
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
    #: merged steps of a case must be at least this much faster than unmerged ones for the case to use the copies
    min_gain: float = 0.05
    #: timed steps each way (alternating) before a case's verdict: the median of the paired ratios
    probe_steps: int = 16
    #: a set none of whose cases paid is not merged again for this many steps
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
    #: median over the probe's pairs of adjacent steps of merged / unmerged seconds
    ratio: float
    #: seconds saved per step (unmerged median - merged median)
    saving: float
    #: medians each way
    unmerged: float
    merged: float
    #: a verdict that does not pay is measured again from this step on
    until: int = 0


@dataclass
class MergeDecision:
    """What to change before the coming step, and whether the step uses the merged copies held then."""

    merge: list[Hashable] = field(default_factory=list)
    unmerge: list[Hashable] = field(default_factory=list)
    use: bool = False


def _bucket(rows: int) -> int:
    """Rows per step in powers of two (1, 2, 4, 8, ...): one verdict per bucket."""
    return 1 << max(0, rows.bit_length() - 1)


class MergePolicy:
    """Decides, step by step, which adapters to hold merged copies of and whether the step uses them.

    Keys are opaque adapter identities (the engine's ``AdapterState`` objects); ``None`` stands for base rows.
    ``rank_of`` gives a key's rank (verdicts are kept per rank). The policy holds no weights: the engine tells it
    what is held at every call.
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
        self.samples: dict[tuple[Case, bool], list[float]] = {}
        self.switch_seconds: deque[float] = deque(maxlen=8)
        #: set of adapters -> step until which it is not merged again (none of its cases paid)
        self.refused: dict[frozenset[Hashable], int] = {}
        self._turn: dict[Case, bool] = {}

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

    def _set_verdicts(self, keys: frozenset[Hashable]) -> list[_Verdict]:
        rank = max((self.rank_of(key) for key in keys), default=0)
        return [v for c, v in self.verdicts.items() if c[0] == len(keys) and c[1] == rank and self._valid(v)]

    def _verdict(self, case: Case) -> _Verdict | None:
        """The case's verdict, None when never measured or when a negative one expired (measured again)."""
        verdict = self.verdicts.get(case)
        return verdict if verdict is not None and self._valid(verdict) else None

    def _valid(self, verdict: _Verdict) -> bool:
        return verdict.pays or self.step < verdict.until

    # --- decisions ----------------------------------------------------------------------------------------------
    def decide(self, rows: Mapping[Hashable | None, int], held: frozenset[Hashable], room: int | Callable[[], int],
               decode: bool = True) -> MergeDecision:
        """Called before each step with its rows per key: what to merge and unmerge first, and whether the step
        uses the copies. ``held``: adapters with merged copies now; ``room``: how many more may be merged
        (``max_merged`` less those held, less those memory would not take), or a function asked only when a
        merge is in view; ``decode``: every row is one sequence's next token (the steps that are timed)."""
        self.step += 1
        self.window.append(dict(rows))
        config = self.config
        if self.refused and self.step % config.window == 0:  # forget expired refusals (they hold adapter objects)
            self.refused = {keys: until for keys, until in self.refused.items() if until > self.step}
        if config.mode == "off" or config.max_merged == 0:
            return MergeDecision(unmerge=list(held))
        if config.mode == "force":
            wanted = {key for key, n in rows.items() if key is not None and n} - held
            return self._force(rows, held, (room() if callable(room) else room) if wanted else 0)
        settled = self.step - self.last_switch >= config.window
        if held:
            if settled and self.share(held) < config.exit_share:
                self._switched()
                return MergeDecision(unmerge=list(held))
            return MergeDecision(use=self._use(rows, held, decode))
        candidate = self._candidate(config.max_merged)
        if candidate and len(candidate) > (room() if callable(room) else room):
            candidate = self._candidate(min(config.max_merged, room() if callable(room) else room))
        if candidate != self.candidate:
            self.candidate = candidate
            self.dominant_since = self.step if candidate else None
        if (not candidate or not decode or not settled or len(self.window) < config.window
                or self.refused.get(candidate, 0) > self.step):
            return MergeDecision()
        verdict = self._verdict(self.case(rows, candidate))
        if verdict is not None:
            dominated = self.step - (self.dominant_since if self.dominant_since is not None else self.step)
            switch = statistics.median(self.switch_seconds) if self.switch_seconds else 0.0
            if not verdict.pays or verdict.saving * max(dominated, config.window) <= switch:
                return MergeDecision()
        self._switched()
        return MergeDecision(merge=list(candidate), use=self._use(rows, candidate, decode))

    def _use(self, rows: Mapping[Hashable | None, int], held: frozenset[Hashable], decode: bool) -> bool:
        """Whether this step uses the held copies: by its case's verdict, alternating while the case is probed."""
        if not any(n for key, n in rows.items() if key in held):
            return False
        case = self.case(rows, held)
        verdict = self._verdict(case)
        if verdict is not None:
            return verdict.pays
        if not decode:  # untimed: merged where a timed case of the set pays and every row is the set's
            return case[3] and any(v.pays for v in self._set_verdicts(held))
        turn = not self._turn.get(case, False)
        self._turn[case] = turn
        return turn

    def _force(self, rows: Mapping[Hashable | None, int], held: frozenset[Hashable], room: int) -> MergeDecision:
        present = [key for key, n in rows.items() if key is not None and n]
        present.sort(key=lambda key: (-rows[key], key not in held))
        target = set(present[: self.config.max_merged])
        unmerge = [key for key in held if key not in target]
        space = room + len(unmerge)
        merge = [key for key in present if key in target and key not in held][:space]
        return MergeDecision(merge=merge, unmerge=unmerge, use=True)

    def _switched(self) -> None:
        self.last_switch = self.step

    # --- measurements -------------------------------------------------------------------------------------------
    def record(self, rows: Mapping[Hashable | None, int], held: frozenset[Hashable], used: bool, seconds: float,
               decode: bool) -> MergeDecision:
        """After a step: its forward time, whether it used the copies. Only all-decode steps are timed (a
        prefill's cost depends on prompts). Returns the adapters to unmerge when the set's cases do not pay."""
        if not decode or not held or self.config.mode != "auto" or not math.isfinite(seconds):
            return MergeDecision()
        if not any(n for key, n in rows.items() if key in held):
            return MergeDecision()
        case = self.case(rows, held)
        if self._verdict(case) is not None:
            return MergeDecision()
        self.samples.setdefault((case, used), []).append(seconds)
        merged = self.samples.get((case, True), [])
        unmerged = self.samples.get((case, False), [])
        if len(merged) < self.config.probe_steps or len(unmerged) < self.config.probe_steps:
            return MergeDecision()
        # the probe alternates, so the i-th merged and i-th unmerged steps are neighbours: compare them in pairs
        ratio = statistics.median(m / u for m, u in zip(merged, unmerged, strict=False) if u > 0)
        before, after = statistics.median(unmerged), statistics.median(merged)
        pays = ratio <= 1 - self.config.min_gain
        self.verdicts[case] = _Verdict(pays, ratio, before - after, before, after,
                                       0 if pays else self.step + self.config.retry_steps)
        del self.samples[(case, True)], self.samples[(case, False)]
        if any(v.pays for v in self._set_verdicts(held)):
            return MergeDecision()
        # nothing this set does pays: drop the copies, and do not merge it again for a while
        self.refused[held] = self.step + self.config.retry_steps
        self._switched()
        return MergeDecision(unmerge=list(held))

    def switched(self, seconds: float) -> None:
        """The engine measured one merge (copy building) in ``seconds``."""
        self.switch_seconds.append(seconds)

    def verdicts_json(self) -> list[dict[str, object]]:
        """The verdicts so far (the bench reports them)."""
        return [{"adapters": c[0], "rank": c[1], "rows": c[2], "pure": c[3], "pays": v.pays,
                 "merged_over_unmerged": round(v.ratio, 3), "unmerged_ms": round(v.unmerged * 1000, 3),
                 "merged_ms": round(v.merged * 1000, 3)}
                for c, v in sorted(self.verdicts.items())]


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
