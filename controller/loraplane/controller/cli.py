"""The ``loraplane-controller`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from prometheus_client import start_http_server

from loraplane.controller.config import FileConfig, load_config
from loraplane.controller.incremental import DEFAULT_FULL_PLAN_SECONDS, DEFAULT_HYSTERESIS
from loraplane.controller.kube import KubeApi
from loraplane.controller.leader import LeaseConfig, LeaseElector
from loraplane.controller.manager import Controller, ControllerConfig
from loraplane.controller.metrics import ControllerMetrics
from loraplane.controller.probe import HealthProber
from loraplane.controller.store import RedisStore
from loraplane.credentials import async_redis, secret
from loraplane.helptext import HelpFormatter

log = logging.getLogger("loraplane.controller")


#: Bearer token of the runtimes' inference API, for health probes of runtimes that require one (vLLM's --api-key).
RUNTIME_TOKEN_ENV = "LORAPLANE_CONTROLLER_RUNTIME_TOKEN"
RUNTIME_TOKEN_FILE_ENV = "LORAPLANE_CONTROLLER_RUNTIME_TOKEN_FILE"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplane-controller", description="the loraplane AdapterRevision controller",
                                formatter_class=HelpFormatter)
    p.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"),
                   help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)")
    p.add_argument("--namespace", help="watch only this namespace (default: all)")
    p.add_argument("--redis-url", default=os.environ.get("LORAPLANE_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   help="Redis holding target states, routes, reports (default: $LORAPLANE_REDIS_URL or local)")
    p.add_argument("--config", type=Path, help="YAML with placement settings and tenant budgets (docs/controller.md)")
    p.add_argument("--identity", default=f"{socket.gethostname()}-{os.getpid()}",
                   help="this replica's name in the Lease (default: hostname-pid)")
    p.add_argument("--lease-name", default="loraplane-controller", help="Lease object of the leader election")
    p.add_argument("--lease-namespace", default="default", help="namespace of that Lease")
    p.add_argument("--lease-duration", type=float, default=15.0, help="seconds (default 15)")
    p.add_argument("--renew-deadline", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--retry-period", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--no-leader-election", action="store_true",
                   help="act without a Lease (only safe with exactly one replica)")
    p.add_argument("--resync-seconds", type=float, default=2.0,
                   help="reconcile at least this often, even without a change notice (default 2)")
    p.add_argument("--full-plan-seconds", type=float, default=DEFAULT_FULL_PLAN_SECONDS,
                   help="plan a pool at rest whole at least this often; between, only what changed is planned "
                        "(default 60)")
    p.add_argument("--rate-hysteresis", type=float, default=DEFAULT_HYSTERESIS,
                   help="relative change of a revision's request rate (per window) that places it again "
                        "(default 0.25)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for the metrics port (default loopback)")
    p.add_argument("--log-level", default="INFO", help="Python logging level")
    return p


def _api_client(kubeconfig: Path | None) -> k8s.ApiClient:
    if kubeconfig is not None:
        return k8s_config.new_client_from_config(config_file=str(kubeconfig))
    k8s_config.load_incluster_config()
    return k8s.ApiClient()


async def _serve(args: argparse.Namespace, file_config: FileConfig) -> int:
    api_client = _api_client(args.kubeconfig)
    redis = async_redis(args.redis_url)
    metrics = ControllerMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    elector = None
    if not args.no_leader_election:
        lease = LeaseConfig(args.lease_name, args.lease_namespace, args.lease_duration, args.renew_deadline,
                            args.retry_period)
        elector = LeaseElector(api_client, args.identity, lease, time.monotonic, time.time)
    config = ControllerConfig(namespace=args.namespace, resync_seconds=args.resync_seconds,
                              placement=file_config.placement_config(), budgets=file_config.budgets(),
                              full_plan_seconds=args.full_plan_seconds, rate_hysteresis=args.rate_hysteresis)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    token = secret(os.environ.get(RUNTIME_TOKEN_ENV), os.environ.get(RUNTIME_TOKEN_FILE_ENV))
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {token}"} if token else None) as http:
        store = RedisStore(redis, time.time, writer=f"{args.identity}@{int(time.time() * 1000)}")
        controller = Controller(KubeApi(api_client, args.identity), store, HealthProber(http),
                                elector, config, time.time, metrics)
        log.info("loraplane-controller %s starting (namespace %s)", args.identity, args.namespace or "all")
        try:
            await controller.run(stop)
        finally:
            await controller.aclose()
            await redis.aclose()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-controller``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        file_config = load_config(args.config)
        LeaseConfig(args.lease_name, args.lease_namespace, args.lease_duration, args.renew_deadline, args.retry_period)
    except ValueError as exc:
        print(f"loraplane-controller: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args, file_config))
    except k8s_config.ConfigException as exc:
        print(f"loraplane-controller: no Kubernetes credentials: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
