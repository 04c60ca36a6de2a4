"""The ``loraplane`` command: a thin dispatcher to the components' own command-line entry points.

Each subcommand names a ``module:function`` taking the remaining arguments; the module is imported only when the
subcommand runs, so ``loraplane --help`` stays fast and a component's heavy imports (torch, grpc) load only for it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

#: subcommand -> (target, one-line help). Targets take ``argv`` and return an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("loraplane.stack:main", "run the whole system locally (API server, Redis, engines, sidecars, picker, Envoy)"),
    "gen-crds": ("loraplane.gen_crds:main", "write (or --check) the CRD YAML generated from loraplane.api"),
    "sim": ("loraplane.sim.cli:main", "simulate a pool under a trace and compare routing/residency policies"),
    "plan": ("loraplane.sim.plan:main", "recommend max_loras / max_cpu_loras / pods for adapters and traffic"),
    "engine": ("loraplane.engine.cli:tools_main", "engine helpers (make-adapters ...)"),
    "devcluster": ("loraplane.devcluster.cli:main", "run the embedded Kubernetes API server"),
}

#: ``loraplane bench <name>`` -> target.
BENCHMARKS: dict[str, str] = {
    "kernels": "loraplane.kernels.bench:main",
    "vllm-lora": "loraplane.kernels.vllm_serving_bench:main",
    "engine": "loraplane.engine.bench:main",
    "sidecar": "loraplane.sidecar.bench:main",
    "picker": "loraplane.picker.bench:main",
    "controller": "loraplane.controller.bench:main",
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
        print(f"loraplane {what}: not yet implemented in this version", file=sys.stderr)
        return 2
    return int(fn(list(argv)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loraplane`` console script."""
    from loraplane import __version__

    parser = argparse.ArgumentParser(prog="loraplane", description="multi-LoRA serving control plane")
    parser.add_argument("--version", action="version", version=f"loraplane {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="run a benchmark and print one JSON object")
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "bench":
        return _run(BENCHMARKS[args.benchmark], f"bench {args.benchmark}", rest)
    return _run(COMMANDS[args.command][0], args.command, rest)


if __name__ == "__main__":
    sys.exit(main())
