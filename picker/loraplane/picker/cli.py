"""The ``loraplane-picker`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplane.api import validation
from loraplane.api.runtime import MAX_REPORT_TTL_S
from loraplane.helptext import HelpFormatter
from loraplane.picker.director import PickerSettings
from loraplane.picker.extproc import BUFFERED, FULL_DUPLEX, STREAMED
from loraplane.picker.peers import PEER_PREFIX, peer_configs
from loraplane.picker.replicas import SHARE_PERIOD_S
from loraplane.picker.server import ServerOptions, serve
from loraplane.picker.state import FORGET_S
from loraplane.picker.transport import TransportLimits

BODY_MODES = {"buffered": BUFFERED, "streamed": STREAMED, "full-duplex-streamed": FULL_DUPLEX}


def _endpoint(value: str) -> tuple[str, str]:
    pod, sep, address = value.partition("=")
    try:
        validation.parse_host_port(address)
    except ValueError:
        sep = ""
    if not sep or not validation.is_pod_name(pod):
        raise argparse.ArgumentTypeError(f"expected POD=IP:PORT with a DNS-1123 pod name, got {value!r}")
    return pod, address


def _config_ref(value: str) -> Path | str:
    """A config file, or ``peer:NAME`` (a packaged peer config)."""
    if value.startswith(PEER_PREFIX):
        name = value.removeprefix(PEER_PREFIX)
        if name not in peer_configs():
            raise argparse.ArgumentTypeError(f"no packaged peer config {name!r}; known: {', '.join(peer_configs())}")
        return value
    return Path(value)


def _seconds(value: str) -> float:
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {value})")
    return seconds


def _default_replica() -> str:
    name = os.environ.get("POD_NAME") or socket.gethostname().split(".")[0].lower()
    return name if validation.is_pod_name(name) else "picker-0"


def parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="loraplane-picker", description="GIE-compatible Envoy ext_proc endpoint picker",
                                formatter_class=HelpFormatter)
    p.add_argument("--pool", required=True, help="InferencePool name (the Redis key namespace)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the bus: route table, reports, rates")
    p.add_argument("--config", type=_config_ref, metavar="FILE|peer:NAME",
                   help="EndpointPickerConfig YAML, or a packaged peer config: peer:NAME, NAME one of "
                        f"{', '.join(peer_configs())} (docs/picker.md, \"Peer configs\"; default: the packaged "
                        "default-config.yaml)")
    p.add_argument("--grpc-address", default="127.0.0.1:9002", help="ext_proc gRPC listen address")
    p.add_argument("--health-address", default="127.0.0.1:9003", help="extra gRPC listen address for health ('' = none)")
    p.add_argument("--metrics-address", default="127.0.0.1:9090", help="Prometheus /metrics address ('' = none)")
    p.add_argument("--endpoint", action="append", type=_endpoint, metavar="POD=IP:PORT",
                   help="static pool member (repeat); default: every pod whose sidecar reports")
    p.add_argument("--inference-pool", help="follow this InferencePool's ready pods through the Kubernetes API")
    p.add_argument("--namespace", default="default", help="namespace of --inference-pool")
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig for --inference-pool (default: in-cluster config)")
    p.add_argument("--replica", default=_default_replica(), help="this replica's name in published counters")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--session-header", default="x-session-id", help="header keeping a user on one canary side")
    p.add_argument("--no-response-rewrite", action="store_true", help="leave the served name in response bodies")
    p.add_argument("--runtime-priority", action="store_true",
                   help="write each request's priority into its body as vLLM's `priority` (minus the GIE priority: "
                        "lower is served first), replacing the client's; for pools run with --scheduling-policy priority")
    p.add_argument("--no-destination-fallbacks", action="store_true",
                   help="send one address in x-gateway-destination-endpoint (plain Envoy ORIGINAL_DST clusters)")
    p.add_argument("--body-mode", choices=sorted(BODY_MODES), default="full-duplex-streamed",
                   help="body processing mode assumed when Envoy sends no protocol_config (Envoy's own is used when it does)")
    p.add_argument("--unknown-models-to-base", action="store_true",
                   help="route model names the route table does not know (in the body, or in a model-name rewrite "
                        "header naming no revision) like the base model, unchanged (the reference EPP's behaviour) "
                        "instead of refusing them with 404")
    p.add_argument("--passthrough-parser", action="store_true",
                   help="do not parse request bodies (not OpenAI JSON): forward them untouched to any endpoint")
    p.add_argument("--fair-share-factor", type=float,
                   help="while the pool is saturated, refuse (429) non-gold requests of a fairness key holding more "
                        "than this multiple of the average in-flight per key (off by default; e.g. 1.5)")
    p.add_argument("--seed", type=int, help="seed of the tie-breaking RNG")
    p.add_argument("--transport", choices=("h2", "grpcio", "h2lib"), default="h2",
                   help="h2: the picker's own HTTP/2 gRPC transport (least CPU); grpcio: grpcio's asyncio server; "
                        "h2lib: the own transport framed by the h2 package (measured by bench picker)")
    limits = TransportLimits()
    p.add_argument("--max-message-bytes", type=int, default=limits.max_message_bytes,
                   help="largest gRPC message accepted, refused from its declared length (RESOURCE_EXHAUSTED)")
    p.add_argument("--max-header-list-bytes", type=int, default=limits.max_header_list_bytes,
                   help="largest decoded request header list (SETTINGS_MAX_HEADER_LIST_SIZE)")
    p.add_argument("--max-header-block-bytes", type=int, default=limits.max_header_block_bytes,
                   help="largest header block with its CONTINUATION frames (h2 transport; past it: GOAWAY)")
    p.add_argument("--max-concurrent-streams", type=int, default=limits.max_concurrent_streams,
                   help="open streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS; more: REFUSED_STREAM)")
    p.add_argument("--stream-idle-timeout", type=float, default=limits.stream_idle_timeout_s,
                   help="seconds a stream may stay silent before it is reset (h2 transport)")
    p.add_argument("--resync-seconds", type=float, default=5.0, help="full re-read of Redis besides the change notices")
    p.add_argument("--publish-seconds", type=float, default=10.0, help="seconds between request-rate publications")
    p.add_argument("--share-in-flight-seconds", type=float, default=SHARE_PERIOD_S,
                   help="seconds between publications of this replica's requests in flight and reads of the other "
                        "replicas' (each replica routes on the pool's total; 0: on its own counts alone)")
    p.add_argument("--stale-grace-seconds", type=float, default=30.0,
                   help="how long past its TTL a pod's last report still counts (routing stays on the pods last known "
                        "to hold a revision while Redis or a sidecar is silent); after it the pod is stale, and what "
                        "it held is used only where no fresh pod holds the revision")
    p.add_argument("--max-report-ttl-seconds", type=_seconds, default=MAX_REPORT_TTL_S,
                   help="the longest TTL a report counts with (reports are aged by the time the picker received them, "
                        "never by the sidecar's clock)")
    p.add_argument("--forget-seconds", type=_seconds, default=FORGET_S,
                   help="without --inference-pool: seconds after its last report a pod leaves the pool, once another "
                        "pod reports (while none does, every member stays)")
    scrape = p.add_argument_group(
        "data source", "where the pool's state comes from: the sidecars' reports and the controller's route table in "
        "Redis, or each endpoint's vLLM /metrics as the peers' pickers read them (llm-d-router's metrics-data-source)")
    scrape.add_argument("--data-source", choices=("redis", "scrape"), default="redis",
                        help="redis: reports, routes and rates in Redis (--redis-url); scrape: no Redis, every "
                             "--endpoint's (or --inference-pool member's) /metrics scraped every --scrape-interval, "
                             "model names routed as given (a name the pods do not serve gets their 404)")
    scrape.add_argument("--scrape-interval", type=_seconds, default=0.05,
                        help="scrape mode: seconds between two scrapes of one endpoint (llm-d's "
                             "--refresh-metrics-interval default; docs/picker.md gives the CPU it costs)")
    scrape.add_argument("--scrape-timeout", type=_seconds, default=1.0, help="scrape mode: seconds one scrape may take")
    scrape.add_argument("--metrics-staleness-threshold", type=_seconds, default=2.0,
                        help="scrape mode: an endpoint whose last good scrape is older is stale (llm-d's default)")
    scrape.add_argument("--metrics-path", default="/metrics", help="scrape mode: the path scraped on each endpoint")
    scrape.add_argument("--base-model", action="append", default=[], metavar="NAME",
                        help="scrape mode: a model name routed as a base-model request (repeat); the pods' own "
                             "model_name label counts without it")
    p.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True, help="use uvloop if installed")
    p.add_argument("--log-level", default="INFO", help="Python logging level")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-picker``."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not validation.matches(validation.DNS1123_SUBDOMAIN, args.pool):
        print(f"loraplane-picker: pool {args.pool!r} is not a DNS-1123 name", file=sys.stderr)
        return 2
    if args.data_source == "scrape" and not (args.endpoint or args.inference_pool):
        print("loraplane-picker: --data-source scrape needs the endpoints to scrape: --endpoint POD=IP:PORT (repeat) "
              "or --inference-pool", file=sys.stderr)
        return 2
    if args.max_message_bytes <= args.max_body_bytes:
        print("loraplane-picker: --max-message-bytes must be above --max-body-bytes (a buffered body is one message)",
              file=sys.stderr)
        return 2
    options = ServerOptions(
        pool=args.pool,
        redis_url=args.redis_url,
        replica=args.replica,
        grpc_address=args.grpc_address,
        health_address=args.health_address or None,
        metrics_address=args.metrics_address or None,
        config_path=args.config,
        endpoints=args.endpoint,
        settings=PickerSettings(
            args.max_body_bytes, args.session_header, not args.no_response_rewrite, not args.no_destination_fallbacks,
            body_mode=BODY_MODES[args.body_mode], unknown_models_to_base=args.unknown_models_to_base,
            passthrough_parser=args.passthrough_parser, runtime_priority=args.runtime_priority,
        ),
        seed=args.seed,
        fair_share_factor=args.fair_share_factor,
        transport=args.transport,
        limits=TransportLimits(args.max_message_bytes, args.max_header_list_bytes, args.max_header_block_bytes,
                               args.max_concurrent_streams, args.stream_idle_timeout),
        inference_pool=args.inference_pool,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        resync_seconds=args.resync_seconds,
        publish_seconds=args.publish_seconds,
        share_in_flight_seconds=args.share_in_flight_seconds,
        stale_grace_seconds=args.stale_grace_seconds,
        max_report_ttl_seconds=args.max_report_ttl_seconds,
        forget_seconds=args.forget_seconds,
        data_source=args.data_source,
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        metrics_staleness_threshold=args.metrics_staleness_threshold,
        metrics_path=args.metrics_path,
        base_models=tuple(args.base_model),
    )
    loop_factory = None
    if args.uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(options))
    except ValueError as exc:  # bad config file
        print(f"loraplane-picker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
