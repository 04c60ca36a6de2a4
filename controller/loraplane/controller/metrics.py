"""The controller's Prometheus metrics (served on ``--metrics-port``, loopback by default)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    """Reconcile duration, writes, leadership."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconcile_seconds = Histogram(
            "loraplane_controller_reconcile_seconds", "Time of one pool's reconcile",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5), registry=self.registry,
        )
        self.redis_writes = Counter(
            "loraplane_controller_redis_writes_total", "Target states and route tables written (changed ones only)",
            registry=self.registry,
        )
        self.redis_repairs = Counter(
            "loraplane_controller_redis_repairs_total",
            "Target states and route tables rewritten because Redis no longer held what the controller last wrote "
            "(lost in a restart, or overwritten by another writer)", registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "loraplane_controller_reconcile_errors_total",
            "Pool reconciles that failed (retried with backoff) or hit a terminal error (recorded, not retried)",
            registry=self.registry,
        )
        self.plans = Counter(
            "loraplane_controller_plans_total",
            "Pool plans by how they were come by (PlanOutcome.kind): reused (nothing planning reads moved), delta (a "
            "few revisions whose rates moved placed again alone), part (a few adapters planned again alone), whole",
            ["outcome"], registry=self.registry,
        )
        self.status_patches = Counter(
            "loraplane_controller_status_patches_total", "AdapterRevision status patches sent", registry=self.registry,
        )
        self.status_repairs = Counter(
            "loraplane_controller_status_repairs_total",
            "AdapterRevision statuses found changed by someone else (not what this controller last wrote) and "
            "written back from the controller's own record", registry=self.registry,
        )
        self.leader = Gauge(
            "loraplane_controller_leader", "1 while this replica holds the Lease and acts", registry=self.registry,
        )
