"""``loraplane devcluster``: serve the embedded Kubernetes API server and write a kubeconfig for kubectl."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplane.devcluster.cluster import Cluster
from loraplane.devcluster.crds import default_crds, load_crds
from loraplane.devcluster.errors import ApiError
from loraplane.devcluster.runner import SnapshotFile, bind, serve, url_of, write_kubeconfig
from loraplane.devcluster.server import ApiServer, ServerConfig
from loraplane.devcluster.store import Store
from loraplane.helptext import HelpFormatter


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplane devcluster", formatter_class=HelpFormatter, description=(
        "Serve an in-memory Kubernetes API server (plain HTTP) that kubectl, the official clients and loraplane "
        "talk to, with the AdapterRevision and InferencePool CRDs installed."))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind; 0 picks a free one (default: 8080)")
    parser.add_argument("--kubeconfig", type=Path, default=Path("devcluster.kubeconfig"),
                        help="where to write the kubeconfig for kubectl (default: ./devcluster.kubeconfig)")
    parser.add_argument("--snapshot", type=Path, help="JSON file the state is saved to (atomically) and reloaded from")
    parser.add_argument("--crds", type=Path, action="append", default=[], metavar="DIR",
                        help="install the CRDs in the YAML files of DIR too (repeatable)")
    parser.add_argument("--no-default-crds", action="store_true",
                        help="do not install the AdapterRevision and InferencePool CRDs")
    parser.add_argument("--token", help="require this bearer token (generated when binding a non-loopback address)")
    parser.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds between watch bookmarks")
    parser.add_argument("--history", type=int, default=10_000,
                        help="changes remembered for watches; older resourceVersions get 410 Gone")
    return parser


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane devcluster``."""
    args = _parser().parse_args(argv)
    token = args.token or (None if _is_loopback(args.host) else secrets.token_urlsafe(32))
    snapshot = SnapshotFile(args.snapshot) if args.snapshot else None
    try:
        store = snapshot.load_store(args.history) if snapshot else Store(args.history)
        cluster = Cluster(store=store)
        crds = [*([] if args.no_default_crds else default_crds()), *(c for d in args.crds for c in load_crds(d))]
        for crd in crds:
            cluster.install_crd(crd)
        sock = bind(args.host, args.port)
    except (OSError, ValueError) as exc:
        print(f"loraplane devcluster: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"loraplane devcluster: a CRD was refused: {exc.message}", file=sys.stderr)
        return 1
    url = url_of(sock)
    api = ApiServer(cluster, ServerConfig(bookmark_interval=args.bookmark_interval, token=token))

    def ready() -> None:
        write_kubeconfig(args.kubeconfig, url, token)
        print(f"devcluster serving {url}; kubeconfig: {args.kubeconfig}", flush=True)

    asyncio.run(serve(api, sock, asyncio.Event(), snapshot, ready, handle_signals=True))
    return 0
