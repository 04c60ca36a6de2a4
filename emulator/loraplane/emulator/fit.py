"""Least-squares fits that turn timings measured at a client into a simulator ``Profile``.

Three linear models, each fitted over every repeated measurement (non-negative coefficients: a coefficient the
unconstrained solution puts below zero is fixed at 0 and the rest refitted):

- **decode** -- one engine step of a batch of ``B`` sequences decoding together using ``A`` distinct adapters (the
  time per output token): ``step = c + per_seq x B + lora_base x [A > 0] + lora_per_adapter x A``. ``c`` is
  the step's constant part; a client cannot split it into ``step_overhead_ms`` (scheduling, sampling, Python) and
  ``decode_base_ms`` (the weights read once per step), so it goes into ``step_overhead_ms`` and ``decode_base_ms``
  is 0 (the model has no weights worth reading).
- **prefill** -- a request alone on the server, ``P`` prompt tokens, adapter count ``a`` (0 or 1), whose prompt takes
  ``k = ceil(P / max_num_batched_tokens)`` steps (chunked prefill): ``TTFT = overhead + k x step(1, a) +
  prefill_per_token x P``, with ``step`` from the decode fit; so ``TTFT - k x step(1, a)`` is fitted on ``[1, P]``.
  The intercept is ``request_overhead_ms``: what a request costs outside the engine's steps (the API server, its
  hand-off to the engine core and back).
- **loads** -- a request alone whose adapter is in a GPU slot (tier 0), only in host memory (1) or only on disk
  (2): ``TTFT = base + h2d x [tier >= 1] + disk x [tier = 2]``: the activation (``h2d_fixed_ms``) and the read from
  disk (``disk_fixed_ms``). One adapter size is measured, so every load cost is a fixed cost (the per-MB fields 0).

On a shared machine a measurement now and then catches a burst of someone else's work: after a first fit, the
observations whose residual is more than ``TRIM`` scaled median absolute deviations (1.4826 x MAD, at least 2 % of
the median observation) from the median residual are dropped and the model refitted once; the count dropped is reported.
Residuals (measured - fitted, of the observations kept) are reported per model: count, RMS, largest, and RMS
relative to the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from loraplane.sim.profile import LARGE_GPU, Profile


@dataclass(frozen=True)
class Fit:
    """A least-squares solution: coefficients by name, and the residuals of each observation."""

    coef: dict[str, float]
    observed: tuple[float, ...]
    residuals: tuple[float, ...]
    #: observations left out as outliers
    dropped: int = 0

    def summary(self, digits: int = 4) -> dict[str, Any]:
        """Coefficients and residual statistics (in the observations' unit), JSON-ready."""
        res = np.asarray(self.residuals)
        rms = float(np.sqrt(np.mean(res**2))) if len(res) else 0.0
        mean = float(np.mean(self.observed)) if self.observed else 0.0
        return {"coef": {k: round(v, digits) for k, v in self.coef.items()}, "n": len(res),
                "residual_rms": round(rms, digits), "residual_max_abs": round(float(np.max(np.abs(res))), digits)
                if len(res) else 0.0, "residual_rms_rel": round(rms / mean, 4) if mean > 0 else None,
                "dropped_outliers": self.dropped}


#: residuals beyond this many scaled MADs are outliers (0: keep every observation)
TRIM = 4.0


def least_squares(names: Sequence[str], rows: Sequence[Sequence[float]], observed: Sequence[float],
                  nonnegative: bool = True, trim: float = TRIM) -> Fit:
    """Solve ``rows @ coef ~= observed``; with ``nonnegative`` a negative coefficient is fixed at 0 and the others
    refitted until none is negative. A column that no row uses (all zeros) gets 0. With ``trim``, observations
    whose residual is beyond ``trim`` scaled MADs are dropped and the fit done again."""
    fit = _solve(names, rows, observed, nonnegative)
    if trim <= 0 or len(observed) < 2 * len(names) + 2:
        return fit
    res = np.asarray(fit.residuals)
    centre = float(np.median(res))  # an outlier pulls the whole fit: residuals are judged from their median
    scale = max(1.4826 * float(np.median(np.abs(res - centre))), 0.02 * abs(float(np.median(observed))), 1e-9)
    keep = [i for i, r in enumerate(res) if abs(r - centre) <= trim * scale]
    if len(keep) == len(res):
        return fit
    again = _solve(names, [rows[i] for i in keep], [observed[i] for i in keep], nonnegative)
    return replace(again, dropped=len(res) - len(keep))


def _solve(names: Sequence[str], rows: Sequence[Sequence[float]], observed: Sequence[float],
           nonnegative: bool) -> Fit:
    x = np.asarray(rows, dtype=float).reshape(len(rows), len(names))
    y = np.asarray(observed, dtype=float)
    if len(y) < 1:
        raise ValueError("no observations to fit")
    active = [j for j in range(len(names)) if np.any(x[:, j] != 0)]
    coef = np.zeros(len(names))
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[:] = 0.0
        coef[active] = solution
        negative = [j for j in active if coef[j] < 0]
        if not nonnegative or not negative:
            break
        worst = min(negative, key=lambda j: coef[j])
        active.remove(worst)
        coef[worst] = 0.0
    residuals = y - x @ coef
    return Fit({name: float(c) for name, c in zip(names, coef, strict=True)}, tuple(map(float, y)),
               tuple(map(float, residuals)))


@dataclass(frozen=True)
class DecodeSample:
    """One batch decoding together: its size, its distinct adapters, the median time per output token (ms)."""

    batch: int
    adapters: int
    tpot_ms: float


@dataclass(frozen=True)
class PrefillSample:
    """One request alone: prompt tokens, adapters (0 or 1), TTFT (ms)."""

    prompt_tokens: int
    adapters: int
    ttft_ms: float


@dataclass(frozen=True)
class LoadSample:
    """One request alone whose adapter came from ``tier`` (0 GPU slot, 1 host memory, 2 disk): TTFT (ms)."""

    tier: int
    ttft_ms: float


@dataclass
class Measurements:
    """Everything a profile is fitted from."""

    decode: list[DecodeSample] = field(default_factory=list)
    prefill: list[PrefillSample] = field(default_factory=list)
    loads: list[LoadSample] = field(default_factory=list)
    #: the server's limits (its flags or defaults, its KV cache)
    max_num_seqs: int = 0
    max_batched_tokens: int = 0
    kv_capacity_tokens: int = 0
    long_prefill_token_threshold: int = 0
    #: bytes of one rank-16 adapter (its tensors)
    adapter_bytes: int = 0


DECODE_TERMS = ("step_ms", "per_seq_ms", "lora_base_ms", "lora_per_adapter_ms")


def decode_row(batch: int, adapters: int) -> list[float]:
    """The decode model's features."""
    return [1.0, float(batch), 1.0 if adapters else 0.0, float(adapters)]


def fit_decode(samples: Sequence[DecodeSample]) -> Fit:
    """Step time against batch size and distinct adapters."""
    return least_squares(DECODE_TERMS, [decode_row(s.batch, s.adapters) for s in samples],
                         [s.tpot_ms for s in samples])


def step_ms(decode: Fit, batch: int, adapters: int) -> float:
    """The fitted step time."""
    return sum(c * v for c, v in zip(decode.coef.values(), decode_row(batch, adapters), strict=True))


def prefill_steps(prompt_tokens: int, budget: int) -> int:
    """Steps a prompt alone takes to prefill under a ``max_num_batched_tokens`` budget (0: no limit)."""
    return max(1, math.ceil(prompt_tokens / budget)) if budget > 0 else 1


def fit_prefill(samples: Sequence[PrefillSample], decode: Fit, budget: int) -> Fit:
    """Per-request overhead and prefill cost per token, the steps' decode part taken out."""
    rows = [[1.0, float(s.prompt_tokens)] for s in samples]
    observed = [s.ttft_ms - prefill_steps(s.prompt_tokens, budget) * step_ms(decode, 1, s.adapters)
                for s in samples]
    return least_squares(("request_overhead_ms", "prefill_per_token_ms"), rows, observed)


def decode_of(profile: Profile) -> Fit:
    """The decode model of ``profile`` as a fit (no observations): what ``fit_prefill`` takes out of each TTFT."""
    return Fit({"step_ms": profile.step_overhead_ms + profile.decode_base_ms, "per_seq_ms": profile.decode_per_seq_ms,
                "lora_base_ms": profile.lora_base_ms, "lora_per_adapter_ms": profile.lora_per_adapter_ms}, (), ())


def front_end_ms(samples: Sequence[PrefillSample], profile: Profile) -> Fit:
    """The per-request overhead the emulator running ``profile`` with ``request_overhead_ms`` 0 shows at a client
    (its own HTTP front end and the client's), fitted from its TTFTs as ``fit_prefill`` fits a runtime's: the part
    of a runtime's fitted overhead the emulator adds by itself."""
    return fit_prefill(samples, decode_of(profile), profile.max_batched_tokens)


def fit_loads(samples: Sequence[LoadSample]) -> Fit:
    """Activation (from host memory) and disk read costs, as TTFT differences between tiers."""
    rows = [[1.0, 1.0 if s.tier >= 1 else 0.0, 1.0 if s.tier >= 2 else 0.0] for s in samples]
    return least_squares(("gpu_ttft_ms", "h2d_fixed_ms", "disk_fixed_ms"), rows, [s.ttft_ms for s in samples])


def fit_profile(m: Measurements, name: str, base: Profile = LARGE_GPU) -> tuple[Profile, dict[str, Any]]:
    """The profile fitted from ``m`` and the fits' summaries. Fields no measurement gives (the registry download)
    come from ``base``."""
    decode = fit_decode(m.decode)
    prefill = fit_prefill(m.prefill, decode, m.max_batched_tokens)
    loads = fit_loads(m.loads)
    profile = replace(
        base,
        name=name,
        step_overhead_ms=decode.coef["step_ms"],
        decode_base_ms=0.0,
        decode_per_seq_ms=decode.coef["per_seq_ms"],
        lora_base_ms=decode.coef["lora_base_ms"],
        lora_per_adapter_ms=decode.coef["lora_per_adapter_ms"],
        prefill_per_token_ms=prefill.coef["prefill_per_token_ms"],
        request_overhead_ms=prefill.coef["request_overhead_ms"],
        h2d_fixed_ms=loads.coef["h2d_fixed_ms"],
        h2d_ms_per_mb=0.0,
        disk_fixed_ms=loads.coef["disk_fixed_ms"],
        disk_read_ms_per_mb=0.0,
        parse_ms_per_mb=0.0,
        max_num_seqs=m.max_num_seqs,
        max_batched_tokens=m.max_batched_tokens,
        kv_capacity_tokens=m.kv_capacity_tokens,
        long_prefill_token_threshold=m.long_prefill_token_threshold,
        default_adapter_bytes=m.adapter_bytes,
    )
    rounded: dict[str, Any] = {f: round(v, 5) for f, v in profile.to_dict().items() if isinstance(v, float)}
    profile = replace(profile, **rounded)
    return profile, {"decode_tpot_ms": decode.summary(), "prefill_ttft_ms": prefill.summary(),
                     "loads_ttft_ms": loads.summary()}
