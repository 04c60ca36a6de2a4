"""The embedded Kubernetes API server (``loraplane devcluster``): an in-memory stand-in for kube-apiserver that
kubectl, the official Python client and loraplane's controller and picker talk to over plain HTTP.

See ``docs/devcluster.md`` for what it implements and what it does not.
"""

from loraplane.devcluster.cluster import Clock, Cluster, SystemClock
from loraplane.devcluster.crds import default_crds, inference_pool_crd
from loraplane.devcluster.runner import ServerThread, SnapshotFile, kubeconfig, write_kubeconfig
from loraplane.devcluster.server import ApiServer, ServerConfig
from loraplane.devcluster.store import Store

__all__ = [
    "ApiServer",
    "Clock",
    "Cluster",
    "ServerConfig",
    "ServerThread",
    "SnapshotFile",
    "Store",
    "SystemClock",
    "default_crds",
    "inference_pool_crd",
    "kubeconfig",
    "write_kubeconfig",
]
