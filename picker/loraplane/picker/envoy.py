"""Envoy bootstrap configs that put the picker in front of a pool (used by `loraplane up`, the e2e tests and the bench).

The upstream is an ``ORIGINAL_DST`` cluster reading ``x-gateway-destination-endpoint``, exactly as a GIE gateway
wires an endpoint picker. ``direct_config`` is the same listener without ext_proc, routing to one fixed backend: the
baseline the benchmark subtracts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplane.api import validation
from loraplane.picker.extproc import SUBSET_KEY, SUBSET_NAMESPACE
from loraplane.picker.transport.grpc import TransportLimits
from loraplane.picker.wire import DESTINATION_HEADER, LB_NAMESPACE

LOOPBACK = "127.0.0.1"
#: the ext_proc service a picker's gRPC health answers for (SERVING once it has read Redis)
EXT_PROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: Envoy's circuit breakers on the picker and model-server clusters in the hardened gateways. Envoy's defaults
#: (1,024 connections, pending requests and requests per cluster) refuse the 1,025th concurrent request with an empty
#: 500 before the picker sees it, while the picker admits more: what the pods take below their saturation thresholds
#: plus flow control's queues (gold 512 + standard 512 + sheddable 256 by default), past which it answers 429 / 503
#: itself, with the reason. So the gateway's limits sit far above anything the picker admits; they bound only a
#: runaway (each open stream costs Envoy ~40 KiB).
GATEWAY_MAX_REQUESTS = 65536


@dataclass
class ExtProcModes:
    """The ext_proc processing mode Envoy is configured with (GIE's reference: headers SEND, bodies streamed)."""

    request_header_mode: str = "SEND"
    request_body_mode: str = "BUFFERED"
    response_header_mode: str = "SEND"
    response_body_mode: str = "BUFFERED"
    #: request attributes sent to the picker (needed when the header phase is skipped)
    request_attributes: Sequence[str] = field(default_factory=tuple)
    #: a request header whose value (``ip:port,...``) Envoy turns into the protocol's subset hint
    #: (``envoy.lb.subset_hint`` filter metadata, forwarded to the picker); the stand-in for a gateway's own subsetting
    subset_hint_header: str | None = None

    def as_config(self) -> dict[str, Any]:
        """The ``processing_mode`` block."""
        mode: dict[str, Any] = {
            "request_header_mode": self.request_header_mode,
            "request_body_mode": self.request_body_mode,
            "response_header_mode": self.response_header_mode,
            "response_body_mode": self.response_body_mode,
        }
        if "STREAMED" in (self.request_body_mode + self.response_body_mode):
            mode["request_trailer_mode"] = "SEND" if self.request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
            mode["response_trailer_mode"] = "SEND" if self.response_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
        return mode


def _socket(port: int, host: str = LOOPBACK) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


@dataclass(frozen=True)
class PickerEndpoint:
    """One picker replica as the gateway lists it: its ext_proc port and, for active health checks, its gRPC
    health port (``--health-address``; None: not checked)."""

    port: int
    health_port: int | None = None
    host: str = LOOPBACK


#: below this share of healthy picker replicas Envoy routes to every replica (its default, made explicit)
PANIC_THRESHOLD_PERCENT = 50


@dataclass(frozen=True)
class PickerHealth:
    """How Envoy finds a dead or unready picker replica: active gRPC health checks (``grpc.health.v1`` on each
    replica's health port, for the ext_proc service: NOT_SERVING until it has read Redis) and outlier detection
    (a replica that refuses or resets connections is ejected at once). A live replica is marked unhealthy only after
    ``unhealthy_threshold`` checks in a row fail (one slow answer from a busy picker is not a death). Ejected or
    unhealthy replicas get no new streams while at least half the replicas are healthy; below that Envoy routes to
    all of them (panic routing): a dead replica refuses at once either way, while health checks a starved machine
    failed on every replica would otherwise cut off every request (seen on the twin: the one picker's checks timed
    out under load and 64 requests got Envoy's empty 500)."""

    interval: str = "1s"
    timeout: str = "1s"
    unhealthy_threshold: int = 3
    healthy_threshold: int = 1
    consecutive_local_origin_failures: int = 1
    base_ejection_time: str = "5s"

    def health_checks(self) -> list[dict[str, Any]]:
        """The cluster's ``health_checks``."""
        return [{"timeout": self.timeout, "interval": self.interval, "no_traffic_interval": self.interval,
                 "unhealthy_threshold": self.unhealthy_threshold, "healthy_threshold": self.healthy_threshold,
                 "grpc_health_check": {"service_name": EXT_PROC_HEALTH_SERVICE}}]

    def outlier_detection(self) -> dict[str, Any]:
        """The cluster's ``outlier_detection``: connection failures (local origin) eject a replica."""
        return {"split_external_local_origin_errors": True,
                "consecutive_local_origin_failure": self.consecutive_local_origin_failures,
                "enforcing_consecutive_local_origin_failure": 100, "interval": self.interval,
                "base_ejection_time": self.base_ejection_time, "max_ejection_percent": 100}


def circuit_breakers(limit: int) -> dict[str, Any]:
    """Envoy ``circuit_breakers`` with connections, pending requests and requests at ``limit``, and retries in flight
    by a budget (a fifth of the requests in flight, at least 32) instead of Envoy's fixed 3."""
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": limit, "max_pending_requests": limit,
                            "max_requests": limit,
                            "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 32}}]}


def _static_cluster(name: str, port: int | Sequence[PickerEndpoint], http2_streams: int | None = None,
                    health: PickerHealth | None = None, max_requests: int | None = None) -> dict[str, Any]:
    """A static cluster of one address (``port``) or of each ``PickerEndpoint``; ``http2_streams`` makes it HTTP/2
    with at most that many streams per connection; ``health`` adds active health checks (endpoints with a health
    port) and outlier detection; ``max_requests`` sets its circuit breakers."""
    endpoints = [PickerEndpoint(port)] if isinstance(port, int) else list(port)
    hosts = []
    for e in endpoints:
        host: dict[str, Any] = {"address": _socket(e.port, e.host)}
        if health is not None and e.health_port is not None:
            host["health_check_config"] = {"port_value": e.health_port}
        hosts.append({"endpoint": host})
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": hosts}]},
    }
    if health is not None:
        if any(e.health_port is not None for e in endpoints):
            cluster["health_checks"] = health.health_checks()
        cluster["outlier_detection"] = health.outlier_detection()
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": PANIC_THRESHOLD_PERCENT}}
    if max_requests is not None:
        cluster["circuit_breakers"] = circuit_breakers(max_requests)
    if http2_streams is not None:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": http2_streams}},
            }
        }
    return cluster


#: response header naming the upstream that served (for tests and debugging; ``upstream_header=True``)
UPSTREAM_HEADER = "x-gateway-upstream"


#: The OpenAI-compatible paths a gateway forwards (``GatewayPolicy.inference_paths``); everything else is 404.
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/models")


@dataclass
class GatewayPolicy:
    """What the gateway lets through and how long it waits: the hardened settings of ``loraplane up``.

    ``None`` leaves a setting off (the benchmark's bare listener). ``endpoints`` (``ip:port`` of every pod) turn
    the pool cluster into a static one balanced by Envoy's override-host policy, which takes the picker's whole
    ordered list (``envoy.lb`` metadata) and moves to the next endpoint on a retry; without them the cluster is
    ``ORIGINAL_DST`` (one address, no fallback).
    """

    #: exact paths routed to the pool; every other path gets Envoy's own 404 (never reaches the picker or a pod)
    inference_paths: Sequence[str] | None = None
    #: set the client's address in ``x-forwarded-for`` (so a runtime never takes a gateway client for loopback)
    forward_client_address: bool = False
    #: drop a client's own ``x-gateway-destination-endpoint`` before anything reads it
    strip_destination_header: bool = False
    request_headers_timeout: str | None = None
    stream_idle_timeout: str | None = None
    connection_idle_timeout: str | None = None
    #: retries of a request whose upstream refused, reset or closed before answering headers, or answered one of
    #: ``retry_statuses``, on the next fallback
    retries: int = 0
    #: upstream statuses retried on the next fallback: vLLM's 404 for an adapter name the pod no longer has
    #: registered (the picker routed on a report a moment older than the pod's unload; another pod holding the
    #: revision can serve it). The picker answers every 404 of its own (an unknown model) itself, never upstream.
    retry_statuses: Sequence[int] = ()
    endpoints: Sequence[str] | None = None
    #: ext_proc ``failure_mode_allow``: route without the picker when it is down (the pool's ``FailOpen``)
    fail_open: bool = False
    #: bearer token put on every routed request in place of a client's ``Authorization`` (vLLM's ``--api-key``;
    #: the bootstrap then holds a secret: write it to a private file)
    upstream_authorization: str | None = None
    #: circuit breakers of the picker and pool clusters (``GATEWAY_MAX_REQUESTS``); None: Envoy's defaults (1,024)
    max_requests: int | None = None
    #: health checking and outlier detection of the picker cluster; None: none
    picker_health: PickerHealth | None = None
    #: a file Envoy writes one JSON line per request into (``ACCESS_LOG_FORMAT``: when the request reached Envoy,
    #: was sent upstream, the upstream's first body byte, in µs); None: no access log
    access_log: str | None = None


#: the header a client names its request by in the access log (Envoy regenerates ``x-request-id`` for outside clients)
CLIENT_REQUEST_ID_HEADER = "x-client-request-id"
#: the access log's fields: the client's request id (``CLIENT_REQUEST_ID_HEADER``), the status, the upstream, and µs from the request's
#: first byte at Envoy to its sending upstream (the picker's headers and body round trips, its decision and any
#: wait in its queue) and to the upstream's first response body byte (for a stream: the first token's chunk)
ACCESS_LOG_FORMAT = {"id": f"%REQ({CLIENT_REQUEST_ID_HEADER.upper()})%", "status": "%RESPONSE_CODE%", "upstream": "%UPSTREAM_HOST%",
                     "to_upstream_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
                     "upstream_sent_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_END:us)%",
                     "first_body_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
                     "total_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"}


#: ``loraplane up``'s gateway: inference paths only, client address forwarded, timeouts, two retries, circuit
#: breakers above what the picker admits, dead or unready picker replicas taken out.
HARDENED = GatewayPolicy(inference_paths=INFERENCE_PATHS, forward_client_address=True, strip_destination_header=True,
                         request_headers_timeout="10s", stream_idle_timeout="60s", connection_idle_timeout="300s",
                         retries=2, retry_statuses=(404,), max_requests=GATEWAY_MAX_REQUESTS,
                         picker_health=PickerHealth())

_NO_EXT_PROC = {"envoy.filters.http.ext_proc": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}}


def _routes(cluster: str, policy: GatewayPolicy) -> list[dict[str, Any]]:
    route: dict[str, Any] = {"cluster": cluster, "timeout": "60s"}
    headers: dict[str, Any] = {}
    if policy.upstream_authorization is not None:
        headers["request_headers_to_add"] = [{
            "header": {"key": "authorization", "value": f"Bearer {policy.upstream_authorization}"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    if policy.retries:
        route["retry_policy"] = {"retry_on": "connect-failure,reset,refused-stream", "num_retries": policy.retries}
        if policy.retry_statuses:
            route["retry_policy"]["retry_on"] += ",retriable-status-codes"
            route["retry_policy"]["retriable_status_codes"] = list(policy.retry_statuses)
    if policy.inference_paths is None:
        return [{"match": {"prefix": "/"}, "route": route, **headers}]
    return [*({"match": {"path": path}, "route": route, **headers} for path in policy.inference_paths),
            {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": "not an inference path\n"}},
             "typed_per_filter_config": _NO_EXT_PROC}]


def _strip_destination() -> dict[str, Any]:
    return {"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": DESTINATION_HEADER}]}}}


def _bootstrap(listen_port: int, admin_port: int, http_filters: list[dict[str, Any]], cluster: str,
               clusters: list[dict[str, Any]], upstream_header: bool = False,
               policy: GatewayPolicy | None = None) -> dict[str, Any]:
    policy = policy or GatewayPolicy()
    virtual_host: dict[str, Any] = {"name": "all", "domains": ["*"], "routes": _routes(cluster, policy)}
    if upstream_header:
        virtual_host["response_headers_to_add"] = [
            {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
        ]
    filters = [_strip_destination()] if policy.strip_destination_header else []
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {"virtual_hosts": [virtual_host]},
        "http_filters": [
            *filters,
            *http_filters,
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    if policy.forward_client_address:
        manager.update(use_remote_address=True, normalize_path=True, merge_slashes=True,
                       path_with_escaped_slashes_action="REJECT_REQUEST")
    timeouts = {"request_headers_timeout": policy.request_headers_timeout,
                "stream_idle_timeout": policy.stream_idle_timeout}
    manager.update({k: v for k, v in timeouts.items() if v is not None})
    if policy.connection_idle_timeout is not None:
        manager["common_http_protocol_options"] = {"idle_timeout": policy.connection_idle_timeout}
    if policy.access_log is not None:
        manager["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                             "path": policy.access_log, "log_format": {"json_format": ACCESS_LOG_FORMAT}}}]
    return {
        "admin": {"address": _socket(admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": _socket(listen_port),
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": manager}]}],
            }],
            "clusters": clusters,
        },
    }


def _pool_cluster(endpoints: Sequence[str] | None, max_requests: int | None = None) -> dict[str, Any]:
    """``ORIGINAL_DST`` on the destination header, or (with ``endpoints``) a static cluster whose override-host
    policy follows the picker's ordered list and takes the next entry on each retry; ``max_requests`` sets its
    circuit breakers."""
    breakers = {} if max_requests is None else {"circuit_breakers": circuit_breakers(max_requests)}
    if endpoints is None:
        return {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
                **breakers}
    hosts = [{"endpoint": {"address": _socket(port, host)}} for host, port in map(validation.parse_host_port, endpoints)]
    override = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
                                  {"header": DESTINATION_HEADER}],
        "fallback_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
        }}]},
    }
    return {"name": "pool", "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": hosts}]},
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host", "typed_config": override}}]}, **breakers}


def _subset_hint_from_header(header: str) -> dict[str, Any]:
    """``header_to_metadata``: the header's value as the subset hint (one comma-separated string), header removed."""
    rule = {"header": header, "remove": True, "on_header_present": {
        "metadata_namespace": SUBSET_NAMESPACE, "key": SUBSET_KEY, "type": "STRING"}}
    return {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [rule]}}


def picker_config(listen_port: int, picker_port: int | Sequence[PickerEndpoint], admin_port: int,
                  modes: ExtProcModes | None = None,
                  message_timeout: str = "5s", upstream_header: bool = False,
                  policy: GatewayPolicy | None = None,
                  picker_streams: int = TransportLimits.max_concurrent_streams) -> dict[str, Any]:
    """Envoy with the ext_proc filter calling the picker and the pool cluster ``policy`` describes.

    ``picker_port`` is one picker's port, or every replica (``PickerEndpoint``: with its health port, checked
    when ``policy.picker_health`` is set). ``picker_streams`` is the picker's ``--max-concurrent-streams``: Envoy
    puts no more streams than that on one connection from the start, so a stream sent on a new connection before
    the picker's SETTINGS arrive is never refused (Envoy's gRPC client would fail that request rather than retry
    it).
    """
    modes = modes or ExtProcModes()
    policy = policy or GatewayPolicy()
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
        "processing_mode": modes.as_config(),
        "message_timeout": message_timeout,
        "failure_mode_allow": policy.fail_open,
        "allow_mode_override": True,
    }
    if modes.request_attributes:
        ext_proc["request_attributes"] = list(modes.request_attributes)
    filters = [{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}]
    if modes.subset_hint_header:
        ext_proc["metadata_options"] = {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}}
        filters.insert(0, _subset_hint_from_header(modes.subset_hint_header))
    clusters = [_pool_cluster(policy.endpoints, policy.max_requests),
                _static_cluster("picker", picker_port, http2_streams=picker_streams, health=policy.picker_health,
                                max_requests=policy.max_requests)]
    return _bootstrap(listen_port, admin_port, filters, "pool", clusters, upstream_header, policy)


def direct_config(listen_port: int, backend_port: int, admin_port: int) -> dict[str, Any]:
    """Envoy alone: the same listener straight to one backend (the benchmark's baseline)."""
    return _bootstrap(listen_port, admin_port, [], "backend", [_static_cluster("backend", backend_port)])
