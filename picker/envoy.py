"""Envoy bootstrap configs that put the picker in front of a pool (used by `loraplane up`, the e2e tests and the bench).

The upstream is an ``ORIGINAL_DST`` cluster reading ``x-gateway-destination-endpoint``, exactly as a GIE gateway
wires an endpoint picker. ``direct_config`` is the same listener without ext_proc, routing to one fixed backend: the
baseline the benchmark subtracts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplane.picker.extproc import DESTINATION_HEADER

LOOPBACK = "127.0.0.1"


@dataclass
class ExtProcModes:
    """The ext_proc processing mode Envoy is configured with (GIE's reference: headers SEND, bodies streamed)."""

    request_header_mode: str = "SEND"
    request_body_mode: str = "BUFFERED"
    response_header_mode: str = "SEND"
    response_body_mode: str = "BUFFERED"
    #: request attributes sent to the picker (needed when the header phase is skipped)
    request_attributes: Sequence[str] = field(default_factory=tuple)

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


def _static_cluster(name: str, port: int, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(port)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


#: response header naming the upstream that served (for tests and debugging; ``upstream_header=True``)
UPSTREAM_HEADER = "x-gateway-upstream"


def _bootstrap(listen_port: int, admin_port: int, http_filters: list[dict[str, Any]], cluster: str,
               clusters: list[dict[str, Any]], upstream_header: bool = False) -> dict[str, Any]:
    route = {"cluster": cluster, "timeout": "60s"}
    virtual_host: dict[str, Any] = {"name": "all", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}
    if upstream_header:
        virtual_host["response_headers_to_add"] = [
            {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
        ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {"virtual_hosts": [virtual_host]},
        "http_filters": [
            *http_filters,
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
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


def picker_config(listen_port: int, picker_port: int, admin_port: int, modes: ExtProcModes | None = None,
                  message_timeout: str = "5s", upstream_header: bool = False) -> dict[str, Any]:
    """Envoy with the ext_proc filter calling the picker and an ``ORIGINAL_DST`` pool cluster."""
    modes = modes or ExtProcModes()
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
        "processing_mode": modes.as_config(),
        "message_timeout": message_timeout,
        "failure_mode_allow": False,
        "allow_mode_override": True,
    }
    if modes.request_attributes:
        ext_proc["request_attributes"] = list(modes.request_attributes)
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    filters = [{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}]
    clusters = [pool, _static_cluster("picker", picker_port, http2=True)]
    return _bootstrap(listen_port, admin_port, filters, "pool", clusters, upstream_header)


def direct_config(listen_port: int, backend_port: int, admin_port: int) -> dict[str, Any]:
    """Envoy alone: the same listener straight to one backend (the benchmark's baseline)."""
    return _bootstrap(listen_port, admin_port, [], "backend", [_static_cluster("backend", backend_port)])
