"""vLLM's Prometheus metrics as a contract: the series loraplane reads, by name, and pure functions that parse them.

Who reads them: the sidecar's ``vllm`` and ``engine`` drivers (load, served adapters), the picker's scrape data
source (``--data-source scrape``, what llm-d-router's ``metrics-data-source`` + ``core-metrics-extractor`` read),
and the simulator's view of what the peers see; the emulator exports them under these names.

Series and label semantics (vLLM 0.32/0.33, ``vllm/v1/metrics/loggers.py``):

- ``vllm:num_requests_waiting`` / ``vllm:num_requests_running``: one series per data-parallel engine (label
  ``engine``), all labelled ``model_name`` (the served base model): summed.
- ``vllm:kv_cache_usage_perc``: a fraction in [0, 1] per engine: the largest counts.
- ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``: a gauge set to the current
  time whenever its labels change, so the exposition keeps one series per label combination ever seen; the newest
  (largest value) says which adapters have requests now. vLLM fills both lists from one dict (every adapter with a
  request waiting *or* running), so they name the same adapters; ``max_lora`` is ``--max-loras``.
- vLLM PR #54830 (open, unmerged), the residency gauges llm-d-router's ``lora-load-state-scorer`` (PR #2792) reads:
  ``vllm:lora_adapter_loaded{adapter_name, level="gpu"|"cpu", pinned="true"|"false"}`` 1 while resident (the series
  goes on eviction; 0 counts as absent), ``vllm:num_gpu_loaded_lora_adapters`` / ``vllm:num_cpu_loaded_lora_adapters``
  (the CPU count includes adapters also on a GPU), and ``vllm:max_gpu_lora_adapters`` (``max_loras``; llm-d falls
  back to ``max_lora`` of ``lora_requests_info`` without it). A runtime exporting none of them has no known
  residency (``loaded_adapters`` is None), as in llm-d.
- loraplane's vLLM plugin (``loraplane.kernels.vllm_residency``) exports the same series from vLLM's worker caches
  (with ``engine`` and ``rank`` labels), plus ``loraplane_vllm_unregistered_lora_copies{level}`` (copies of unloaded
  names), which tells the plugin from upstream (``exported_by_plugin``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_ADAPTER_LOADED = "vllm:lora_adapter_loaded"
NUM_GPU_LOADED = "vllm:num_gpu_loaded_lora_adapters"
NUM_CPU_LOADED = "vllm:num_cpu_loaded_lora_adapters"
MAX_GPU_ADAPTERS = "vllm:max_gpu_lora_adapters"
#: only loraplane's vLLM plugin exports it (copies of unloaded names, per level): marks the plugin as the exporter
UNREGISTERED_COPIES = "loraplane_vllm_unregistered_lora_copies"

#: labels of ``lora_requests_info``
MAX_LORA_LABEL = "max_lora"
RUNNING_ADAPTERS_LABEL = "running_lora_adapters"
WAITING_ADAPTERS_LABEL = "waiting_lora_adapters"
#: labels of the residency gauges (and ``model_name`` on every vLLM series)
ADAPTER_LABEL = "adapter_name"
LEVEL_LABEL = "level"
PINNED_LABEL = "pinned"
MODEL_NAME_LABEL = "model_name"
LEVEL_GPU = "gpu"
LEVEL_CPU = "cpu"

#: the Prometheus process collector's start time (vLLM's API server exports it): a new value is a restarted server
PROCESS_START = "process_start_time_seconds"

#: every series ``read_metrics`` (the picker's scrape) reads
PICKER_SERIES = (WAITING, RUNNING, KV_USAGE, LORA_REQUESTS_INFO, LORA_ADAPTER_LOADED, NUM_GPU_LOADED, NUM_CPU_LOADED,
                 MAX_GPU_ADAPTERS)
#: every series the sidecar's runtime drivers read (``VllmApiDriver.scrape``)
SIDECAR_SERIES = (*PICKER_SERIES, UNREGISTERED_COPIES, PROCESS_START)

#: sample name -> [(labels, value)], in exposition order
Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    """Prometheus text -> sample name -> [(labels, value)] (every sample; prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")


@functools.cache
def _line_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    """A sample line of one of ``names``, after a newline: the names' common prefix is spelt out first, so the
    regular-expression engine scans for that literal (~20 us over a 35 kB exposition, where ``^`` with ``re.M``
    tries every position)."""
    unique = sorted(set(names), key=len, reverse=True)
    first, last = min(unique), max(unique)  # the common prefix of all is theirs
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    common = first[:size]
    alternatives = "|".join(re.escape(n[len(common):]) for n in unique)
    return re.compile(rf"\n({re.escape(common)}(?:{alternatives}))(?:\{{([^\n]*)\}})?[ \t]+([^ \t\r\n]+)")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_series(text: str, names: tuple[str, ...] = PICKER_SERIES) -> Samples:
    """Only the samples of ``names`` (exact sample names), found by one regular-expression pass over the text:
    what ``parse_metrics`` gives for them, at a fraction of the cost on a full vLLM exposition (the histograms'
    buckets are skipped unread). Comments and other series are ignored."""
    pattern = _line_pattern(names)
    samples: Samples = {}
    for match in pattern.finditer("\n" + text if not text.startswith("\n") else text):
        name, labels_text, value = match.groups()
        labels = {key: _unescape(raw) for key, raw in _LABEL.findall(labels_text)} if labels_text else {}
        try:
            number = float(value)
        except ValueError:
            continue
        samples.setdefault(name, []).append((labels, number))
    return samples


def total(samples: Samples, name: str) -> float:
    """The sum over every series of ``name`` (vLLM has one per data-parallel engine, label ``engine``)."""
    return sum(value for _, value in samples.get(name, ()))


def queue_depth(samples: Samples) -> int:
    """Requests waiting, over every engine (``vllm:num_requests_waiting``)."""
    return int(total(samples, WAITING))


def running(samples: Samples) -> int:
    """Requests running, over every engine (``vllm:num_requests_running``)."""
    return int(total(samples, RUNNING))


def kv_usage(samples: Samples) -> float:
    """KV-cache utilisation in [0, 1]: the fullest engine's ``vllm:kv_cache_usage_perc``."""
    values = [value for _, value in samples.get(KV_USAGE, ())]
    return min(1.0, max(0.0, max(values, default=0.0)))


def _adapter_names(labels: Mapping[str, str]) -> tuple[set[str], set[str]]:
    def names(key: str) -> set[str]:
        return {n for n in labels.get(key, "").split(",") if n}

    return names(RUNNING_ADAPTERS_LABEL), names(WAITING_ADAPTERS_LABEL)


def _newest_lora_info(samples: Samples) -> dict[str, str] | None:
    series = samples.get(LORA_REQUESTS_INFO)
    if not series:
        return None
    return max(series, key=lambda s: s[1])[0]


def lora_requests(samples: Samples) -> tuple[set[str], set[str]]:
    """Running and waiting adapters now: the newest ``vllm:lora_requests_info`` series (its value is a timestamp)."""
    labels = _newest_lora_info(samples)
    return _adapter_names(labels) if labels is not None else (set(), set())


def lora_last_served(samples: Samples) -> dict[str, float]:
    """When each adapter last had requests: the newest ``vllm:lora_requests_info`` series naming it."""
    last: dict[str, float] = {}
    for labels, stamp in samples.get(LORA_REQUESTS_INFO, ()):
        busy, waiting = _adapter_names(labels)
        for name in busy | waiting:
            last[name] = max(stamp, last.get(name, stamp))
    return last


def max_lora(samples: Samples) -> int | None:
    """``max_lora`` of the newest ``vllm:lora_requests_info`` series (vLLM's ``--max-loras``); None without one."""
    labels = _newest_lora_info(samples)
    if labels is None:
        return None
    try:
        return int(float(labels.get(MAX_LORA_LABEL, "")))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """One adapter a runtime reports resident (``vllm:lora_adapter_loaded``)."""

    #: in a GPU slot (a ``level="gpu"`` series); else only in the host (CPU) cache
    gpu: bool
    pinned: bool = False


def loaded_adapters(samples: Samples) -> dict[str, LoadedAdapter] | None:
    """Adapter -> where it is resident, from ``vllm:lora_adapter_loaded`` (value 1; 0 counts as absent; an adapter
    with a ``gpu`` series is on a GPU whatever its ``cpu`` series say). None when the runtime exports neither that
    gauge nor ``vllm:num_gpu_loaded_lora_adapters``: residency unknown."""
    series = samples.get(LORA_ADAPTER_LOADED)
    if not series and NUM_GPU_LOADED not in samples:
        return None
    loaded: dict[str, LoadedAdapter] = {}
    for labels, value in series or ():
        name = labels.get(ADAPTER_LABEL)
        if not name or value < 0.5:
            continue
        gpu = labels.get(LEVEL_LABEL) == LEVEL_GPU
        pinned = labels.get(PINNED_LABEL, "").lower() == "true"
        known = loaded.get(name)
        if known is not None:
            gpu, pinned = gpu or known.gpu, pinned or known.pinned
        loaded[name] = LoadedAdapter(gpu, pinned)
    return loaded


def exported_by_plugin(samples: Samples) -> bool:
    """The residency series come from loraplane's vLLM plugin (it alone exports ``UNREGISTERED_COPIES``)."""
    return UNREGISTERED_COPIES in samples


def gpu_loaded_count(samples: Samples, loaded: Mapping[str, LoadedAdapter] | None = None) -> int:
    """Adapters in GPU slots: ``vllm:num_gpu_loaded_lora_adapters`` (summed over engines), else the GPU entries of
    ``loaded`` (``loaded_adapters``), else 0."""
    if NUM_GPU_LOADED in samples:
        return int(total(samples, NUM_GPU_LOADED))
    return sum(1 for state in (loaded or {}).values() if state.gpu)


def max_gpu_adapters(samples: Samples) -> int | None:
    """GPU adapter slots: ``vllm:max_gpu_lora_adapters``, else ``max_lora`` of ``lora_requests_info``; None when
    neither is exported."""
    if MAX_GPU_ADAPTERS in samples:
        return int(max(value for _, value in samples[MAX_GPU_ADAPTERS]))
    return max_lora(samples)


def model_names(samples: Samples) -> frozenset[str]:
    """The ``model_name`` labels of the request-count series: the base model(s) the runtime serves."""
    return frozenset(labels[MODEL_NAME_LABEL] for name in (WAITING, RUNNING) for labels, _ in samples.get(name, ())
                     if labels.get(MODEL_NAME_LABEL))


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What the picker's scrape source keeps of one runtime's exposition (``read_metrics``)."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    #: the newest ``lora_requests_info``'s lists (vLLM: the same adapters in both)
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    #: GPU adapter slots (``max_gpu_adapters``); 0: not exported
    max_gpu_adapters: int = 0
    #: residency (``loaded_adapters``); None: not exported
    loaded: Mapping[str, LoadedAdapter] | None = None
    #: adapters in GPU slots (``gpu_loaded_count``)
    gpu_loaded: int = 0
    #: base model name(s) (``model_names``)
    model_names: frozenset[str] = field(default_factory=frozenset)
    #: the exposition had a ``lora_requests_info`` series (without one llm-d keeps the last adapter lists: #1467)
    has_lora_info: bool = False


def read_metrics(text: str) -> VllmMetrics:
    """One runtime's /metrics text -> ``VllmMetrics`` (the fast ``parse_series`` pass)."""
    samples = parse_series(text)
    busy, waiting = lora_requests(samples)
    running_adapters = frozenset(busy)
    waiting_adapters = running_adapters if waiting == busy else frozenset(waiting)  # vLLM: the same (one object)
    max_slots = max_gpu_adapters(samples)
    loaded = loaded_adapters(samples)
    return VllmMetrics(
        waiting=queue_depth(samples),
        running=running(samples),
        kv_usage=kv_usage(samples),
        running_adapters=running_adapters,
        waiting_adapters=waiting_adapters,
        max_gpu_adapters=max(0, max_slots or 0),
        loaded=loaded,
        gpu_loaded=gpu_loaded_count(samples, loaded),
        model_names=model_names(samples),
        has_lora_info=LORA_REQUESTS_INFO in samples,
    )
