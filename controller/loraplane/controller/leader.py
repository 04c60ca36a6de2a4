"""Leader election on a ``coordination.k8s.io/v1`` Lease, so two controller replicas never both act.

The algorithm is client-go's: a candidate takes the lease only when the record it last saw has not changed for
``lease_duration`` seconds of its own monotonic clock (no trust in other machines' wall clocks); the holder renews
every ``retry_period`` and counts itself leader only while its last successful renewal is younger than
``renew_deadline`` (< ``lease_duration``). So a holder that cannot reach the API server stops acting before any
other replica may take over. Writes carry the lease's resourceVersion: of two racing candidates one gets 409.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    """Where the lease lives and its timings (seconds), client-go's defaults."""

    name: str = "loraplane-controller"
    namespace: str = "default"
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("lease timings must satisfy 0 < retry_period < renew_deadline < lease_duration")


class LeaseElector:
    """Acquires and renews the Lease; ``is_leader()`` says whether this replica may act right now."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        identity: str,
        config: LeaseConfig,
        monotonic: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.api = k8s.CoordinationV1Api(api_client)
        self.identity = identity
        self.config = config
        self.monotonic = monotonic
        self.wall_clock = wall_clock
        self._renewed_at: float | None = None
        self._observed: tuple[str | None, str | None] | None = None
        self._observed_at = 0.0
        self.on_change: Callable[[bool], None] = lambda leading: None

    def is_leader(self) -> bool:
        """True while the last successful renewal is younger than ``renew_deadline``."""
        return self._renewed_at is not None and self.monotonic() - self._renewed_at < self.config.renew_deadline

    async def run(self, stop: asyncio.Event) -> None:
        """Try to acquire or renew every ``retry_period`` until ``stop``; then release the lease if held."""
        leading = False
        while not stop.is_set():
            attempt_at = self.monotonic()
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    self._renewed_at = attempt_at
            except Exception as exc:
                log.warning("lease %s: %s", self.config.name, exc)
            if self.is_leader() != leading:
                leading = not leading
                log.info("%s %s leadership", self.identity, "acquired" if leading else "lost")
                self.on_change(leading)
            await sleep_or_stop(stop, self.config.retry_period)
        if self.is_leader():
            await asyncio.to_thread(self.release)
        self._renewed_at = None
        if leading:
            self.on_change(False)

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.wall_clock(), UTC)

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking); True when this replica holds the lease afterwards."""
        cfg = self.config
        try:
            lease = self.api.read_namespaced_lease(cfg.name, cfg.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(name=cfg.name, namespace=cfg.namespace),
                spec=self._spec(acquire=True, transitions=0),
            )
            try:
                self.api.create_namespaced_lease(cfg.namespace, body)
            except ApiException as create_exc:
                if create_exc.status == 409:
                    return False
                raise
            return True
        spec = lease.spec or k8s.V1LeaseSpec()
        record = (spec.holder_identity, str(spec.renew_time))
        if record != self._observed:
            self._observed, self._observed_at = record, self.monotonic()
        holder = spec.holder_identity
        if holder and holder != self.identity and self.monotonic() - self._observed_at < cfg.lease_duration:
            return False
        mine = holder == self.identity
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        lease.spec = self._spec(acquire=not mine, transitions=transitions, previous=spec)
        try:
            self.api.replace_namespaced_lease(cfg.name, cfg.namespace, lease)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def _spec(self, acquire: bool, transitions: int, previous: k8s.V1LeaseSpec | None = None) -> k8s.V1LeaseSpec:
        now = self._now()
        return k8s.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, int(self.config.lease_duration)),
            acquire_time=now if acquire or previous is None else previous.acquire_time,
            renew_time=now,
            lease_transitions=transitions,
        )

    def release(self) -> None:
        """Give the lease up (holder cleared) so another replica can take over at once."""
        cfg = self.config
        try:
            lease = self.api.read_namespaced_lease(cfg.name, cfg.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = self._now()
            self.api.replace_namespaced_lease(cfg.name, cfg.namespace, lease)
        except ApiException as exc:
            log.warning("could not release lease %s: %s", cfg.name, exc.status)
