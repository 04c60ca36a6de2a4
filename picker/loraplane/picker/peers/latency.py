"""llm-d-router's predicted-latency routing as one picker filter (``predicted-latency-filter``).

llm-d-router's ``predicted-latency`` profile (``config/charts/routerlib/templates/_config.yaml`` with
``router.latencyPredictor.enabled``): the ``predicted-latency-producer`` predicts each endpoint's TTFT (and TPOT) for the
request with a learned model (XGBoost, trained online from the router's own observations, on the endpoint's KV-cache
use, waiting and running requests, the prompt's length, its prefix-cache score and the prefill tokens the router has
in flight there; ``requestcontrol/dataproducer/predictedlatency``), headroom = SLO - predicted; then:

- ``slo-headroom-tier-filter`` (``scheduling/filter/sloheadroomtier``): endpoints with headroom >= 0 are the
  positive tier, the others the negative one; with both, keep the positive tier, except with probability
  ``epsilonExploreNeg`` (0.01) the negative one; with one, keep it;
- ``latency-scorer`` (``scheduling/scorer/latency``): within the tier, |headroom| min-max normalised, the score
  ``int((1 - n) x 100) + 1`` under ``least`` (the default: the endpoint closest to its SLO, bin-packing) or
  ``int(n x 100) + 1`` under ``most``; an all-negative set prefers endpoints with no request in flight, then the
  least deficit (``least`` always); TPOT is neutralised here (no TPOT SLO), as the producer does without streaming;
- ``weighted-random-picker``: one endpoint drawn with probability proportional to its score;
- ``latency-slo-admitter`` (``requestcontrol/admitter/latencyslo``): a sheddable request (priority < 0) carrying an
  SLO is refused unless some endpoint is predicted to meet it, one runs no request (``RunningRequestsSize`` 0: its
  waiting queue does not count), or one is cold (KV use below 2 %).

loraplane's scheduler picks by maximum score only, so the tier filter, the scorer and the weighted random draw run
here as one filter that keeps the drawn endpoint (then any picker returns it), and the admitter raises the picker's
``PoolSaturatedError`` (429). The prefix-cache affinity filters of that profile do nothing without a prefix signal
and are left out.

**The predictor.** ``PredictedLatencyFilter.predictor`` maps (request, pool) to seconds per endpoint. By default it
is an analytic model on what the scrape shows (waiting and running requests, the adapter's tier from the residency
gauges, the parameters' per-token and load times), usable by the twin. The simulator replaces it with an analytic
TTFT model of each pod's exact state (``loraplane.sim.peers.TtftOracle``): the tokens queued ahead, the batch, the
adapter's tier and load time, a wait for a GPU slot. Its inputs are richer than llm-d's features (which name no
adapter), but it is a model, not the outcome: it does not foresee the requests that arrive after the decision, KV
preemption or vLLM skipping a queued adapter's requests, so its error grows with the load (docs/sim.md gives it as
measured). ``errorSigma`` multiplies each prediction by a further log-normal error (``exp(N(0, sigma))``, drawn per
endpoint and decision from the scheduler's generator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from pydantic import Field

from loraplane.picker.plugins import (
    Cycle,
    FilterParameters,
    PluginKind,
    PluginType,
    PoolSaturatedError,
    SchedulingRequest,
    register,
)
from loraplane.picker.snapshot import BoolArray, FloatArray, PoolSnapshot

Strategy = Literal["least", "most"]
Predictor = Callable[[SchedulingRequest, PoolSnapshot], FloatArray]


class PredictedLatencyParameters(FilterParameters):
    """``predicted-latency-filter``: llm-d-router's defaults, and the analytic predictor's costs."""

    #: the TTFT SLO requests carry (llm-d's ``x-slo-ttft-ms`` header); the simulator's ``--slo-ttft-ms``
    ttft_slo_seconds: float = Field(default=2.0, gt=0)
    epsilon_explore_neg: float = Field(default=0.01, ge=0, le=1)
    headroom_selection_strategy: Strategy = "least"
    #: the ``latency-slo-admitter``: refuse sheddable requests no endpoint can serve in time
    admission: bool = True
    #: below this KV use an endpoint is cold (predictions unreliable): the admitter lets the request in
    cold_kv_utilization: float = Field(default=0.02, ge=0, le=1)
    #: log-normal sigma of the prediction error (0: exact)
    error_sigma: float = Field(default=0.2, ge=0)
    # the analytic predictor (what the twin runs): seconds
    prefill_seconds_per_token: float = Field(default=0.0001, ge=0)
    prompt_tokens: float = Field(default=1000, ge=0)
    step_seconds: float = Field(default=0.012, ge=0)
    per_sequence_seconds: float = Field(default=0.00008, ge=0)
    cpu_load_seconds: float = Field(default=0.02, ge=0)
    disk_load_seconds: float = Field(default=0.25, ge=0)
    fetch_load_seconds: float = Field(default=3.0, ge=0)


def analytic_predictor(params: PredictedLatencyParameters) -> Predictor:
    """TTFT from the scraped metrics: the prompts waiting there and this one prefilled at ``prefillSecondsPerToken``,
    a step with the running batch, the adapter's load from its tier in the residency gauges (disk when the pod
    exports no gauges, a fetch where it is not listed)."""
    prompt = params.prompt_tokens * params.prefill_seconds_per_token

    def predict(request: SchedulingRequest, pool: PoolSnapshot) -> FloatArray:
        wait = (pool.queue_depth + 1) * prompt + params.step_seconds + params.per_sequence_seconds * pool.running
        name = request.served_name
        if name is None:
            return np.asarray(wait, dtype=np.float64)
        load = np.empty(pool.size)
        for i, e in enumerate(pool.endpoints):
            if e.loaded_adapters is None:
                load[i] = params.disk_load_seconds
                continue
            state = e.loaded_adapters.get(name)
            load[i] = params.fetch_load_seconds if state is None else 0.0 if state.gpu else params.cpu_load_seconds
        return np.asarray(wait + load, dtype=np.float64)

    return predict


class PredictedLatencyFilter:
    """The plugin: predictions, the admitter, the headroom tiers, the latency score and the weighted random pick."""

    def __init__(self, params: PredictedLatencyParameters) -> None:
        self.params = params
        self.predictor: Predictor = analytic_predictor(params)
        self._fallback = np.random.default_rng(0)

    def __call__(self, request: SchedulingRequest, pool: PoolSnapshot, cycle: Cycle) -> BoolArray | None:
        p = self.params
        rng = cycle.rng if cycle.rng is not None else self._fallback
        predicted = np.asarray(self.predictor(request, pool), dtype=np.float64)
        if p.error_sigma > 0:
            predicted = predicted * np.exp(rng.normal(0.0, p.error_sigma, pool.size))
        headroom = p.ttft_slo_seconds - predicted
        candidates = cycle.candidates
        positive = candidates & (headroom >= 0)
        negative = candidates & ~positive
        idle = (pool.queue_depth + pool.running) == 0  # the scorer's "no request dispatched there"
        if p.admission and request.priority < 0 and not np.count_nonzero(positive) and not np.count_nonzero(
                candidates & ((pool.running == 0) | (pool.kv_utilization < p.cold_kv_utilization))):
            raise PoolSaturatedError("no endpoint is predicted to meet the request's TTFT SLO and it is sheddable")
        has_positive, has_negative = bool(np.count_nonzero(positive)), bool(np.count_nonzero(negative))
        if has_positive and has_negative:
            tier, is_negative = (negative, True) if rng.random() < p.epsilon_explore_neg else (positive, False)
        elif has_positive:
            tier, is_negative = positive, False
        elif has_negative:
            tier, is_negative = negative, True
        else:
            return None
        if is_negative and np.count_nonzero(tier & idle):
            tier = tier & idle
        members = np.flatnonzero(tier)
        deficit = np.abs(headroom[members])
        span = float(deficit.max() - deficit.min())
        normalised = (deficit - deficit.min()) / span if span > 1e-9 else np.full(len(members), 0.5)
        most = p.headroom_selection_strategy == "most" and not is_negative
        weights = (np.floor(normalised * 100) + 1) if most else (np.floor((1.0 - normalised) * 100) + 1)
        pick = members[int(rng.choice(len(members), p=weights / weights.sum()))] if len(members) > 1 else members[0]
        keep = np.zeros(pool.size, dtype=np.bool_)
        keep[pick] = True
        return keep


def predicted_latency_filter(params: PredictedLatencyParameters) -> PredictedLatencyFilter:
    """llm-d-router's predicted-latency routing (module docstring)."""
    return PredictedLatencyFilter(params)


register("predicted-latency-filter", PluginType(PluginKind.FILTER, PredictedLatencyParameters, predicted_latency_filter))
