"""Starting loraplane's processes on one machine: the embedded API server, Redis, engines with their sidecars, the
picker behind Envoy, and the controller. Each runs as a real child process in its own process group, stopped by PID.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import yaml

from loraplane.credentials import async_redis
from loraplane.engine.cli import ADMIN_TOKEN_FILE_ENV
from loraplane.processes import (
    LOOPBACK,
    ManagedProcess,
    RedisServer,
    envoy_binary,
    free_port,
    start_redis,
    wait_for_port,
)
from loraplane.stack.secrets import StackSecrets, sidecar_user, write_private
from loraplane.stack.sentinel import SentinelRedis, start_sentinel_redis
from loraplane.stack.tools import kubectl

#: The InferencePool (and Redis key namespace) of the local stack.
POOL = "local"
#: Label the engine Pod objects carry; the InferencePool selects on it.
ENGINE_LABELS = {"app": "loraplane-engine"}
#: ``--max-lora-rank`` of the stack's vLLM pods (the demo's adapters are rank 8)
VLLM_MAX_LORA_RANK = 16
#: ``--block-size`` of the stack's vLLM pods (vLLM-CPU takes multiples of 32): the precise prefix scorer's block
VLLM_BLOCK_SIZE = 32
#: every model server orders its waiting requests by the priority the picker writes into each body
#: (``--runtime-priority``), as the chart's pods do (``modelServer.scheduling``)
SCHEDULING_ARGS = ("--scheduling-policy", "priority")
#: ``--max-model-len`` of emulated pods: room for the longest prompts of recorded traces (vLLM-CPU pods: 256)
EMULATED_MAX_MODEL_LEN = 32768
#: runtimes that speak vLLM's API (the sidecar drives them with its ``vllm`` driver)
VLLM_API_RUNTIMES = ("vllm", "emulated")


#: Backoff of a child's restarts: the first after RESTART_BASE_S, doubling up to RESTART_CAP_S; a child that ran
#: RESTART_RESET_S since its last start begins again from the first delay.
RESTART_BASE_S, RESTART_CAP_S, RESTART_RESET_S = 0.5, 10.0, 30.0


class StartCancelled(RuntimeError):
    """Ctrl-C (the stack's ``cancel`` event) arrived while the stack was starting."""


class KubectlError(AssertionError):
    """kubectl exited non-zero (an ``AssertionError``, so test helpers that poll through kubectl retry it)."""


@dataclass
class DevCluster:
    """A running ``loraplane devcluster``: its URL, the kubeconfig it wrote, and the real kubectl configured for it
    (the one setup installs: ``loraplane.stack.tools``)."""

    url: str
    kubeconfig: Path
    process: ManagedProcess
    workdir: Path

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 30.0,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster (its own discovery cache); raises ``KubectlError`` with ``check``."""
        result = subprocess.run(
            [kubectl(), "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.workdir / "kube-cache"), *args],
            input=stdin, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
        )
        if check and result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def stop(self) -> int | None:
        """Stop the server (SIGTERM: it saves its snapshot first, when it has one)."""
        return self.process.stop()


def start_devcluster(workdir: Path, extra_args: Sequence[str] = (), timeout: float = 30.0) -> DevCluster:
    """Start ``loraplane devcluster`` on a free loopback port; returns once its kubeconfig is written."""
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.unlink(missing_ok=True)
    args = [sys.executable, "-m", "loraplane.cli", "devcluster", "--host", LOOPBACK, "--port", "0",
            "--kubeconfig", str(kubeconfig), *extra_args]
    process = ManagedProcess(args, workdir / "devcluster.log").start()
    deadline = time.monotonic() + timeout
    while not kubeconfig.exists():
        if not process.alive():
            raise RuntimeError(f"loraplane devcluster exited early:\n{process.log_tail()}")
        if time.monotonic() > deadline:
            process.stop()
            raise TimeoutError(f"loraplane devcluster did not start in {timeout} s:\n{process.log_tail()}")
        time.sleep(0.05)
    url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    return DevCluster(url, kubeconfig, process, workdir)


@dataclass
class StackOptions:
    """What ``loraplane up`` runs."""

    workdir: Path
    engines: int = 3
    #: the model servers: ``engine`` (loraplane's reference engine), ``vllm`` (vLLM-CPU from ``.venv-vllm``) or
    #: ``emulated`` (loraplane's vLLM emulator: vLLM's API, metrics and adapter semantics, time from a profile)
    runtime: str = "engine"
    #: the emulated runtime's timing profile (``loraplane.sim.profile``: a built-in name or a file); None: the
    #: emulator's default
    profile: str | None = None
    #: a preset; with ``vllm`` it is written as a checkpoint first (vLLM-CPU needs head size >= 32: tiny-hd32)
    model: str = "tiny"
    max_loras: int = 4
    max_cpu_loras: int = 16
    #: seconds between sidecar heartbeats (and the controller's resync unless ``controller_resync`` says)
    heartbeat: float = 0.5
    #: the controller's ``--resync-seconds`` (how often it plans a pool); None: ``heartbeat``
    controller_resync: float | None = None
    #: seconds between the picker's request-rate publications (the controller's placement input)
    publish_seconds: float = 2.0
    #: the InferencePool's ``endpointPickerRef.failureMode``: FailOpen lets Envoy route without the picker
    failure_mode: str = "FailClose"
    #: a peer's packaged picker config (``loraplane.picker.peers``): the pool runs as the peer's users run it -- the
    #: picker scrapes every pod's vLLM metrics (``--data-source scrape``, every ``scrape_interval`` s) and routes model
    #: names as given; every adapter of ``lora_modules`` is registered on every pod at start-up (vLLM's
    #: ``--lora-modules``); the pods keep vLLM's default scheduling; no sidecars, no controller. None: loraplane.
    peer: str | None = None
    lora_modules: Mapping[str, Path] = field(default_factory=dict)
    scrape_interval: float = 0.05
    #: how Envoy hands request and response bodies to the picker: ``BUFFERED`` (whole bodies: a streamed answer
    #: reaches the client only when it ends) or ``FULL_DUPLEX_STREAMED`` (GIE's reference and the chart's default:
    #: each chunk as it comes, so the client sees the first token when the pod sends it)
    body_mode: str = "BUFFERED"
    #: picker replicas (``picker-0`` ...), each listed in Envoy's picker cluster with its gRPC health port
    pickers: int = 1
    #: Envoy writes one JSON line per request into ``logs/envoy-access.log`` (``picker.envoy.ACCESS_LOG_FORMAT``)
    envoy_access_log: bool = False
    #: Redis as a primary, a replica and three sentinels (``loraplane.stack.sentinel``); every component is given
    #: the ``redis+sentinel://`` URL and follows a failover
    redis_sentinel: bool = False


@dataclass
class Engine:
    """One engine (the model server of a pod) and its sidecar."""

    pod: str
    port: int
    engine: ManagedProcess
    sidecar: ManagedProcess | None = None
    #: where the runtime publishes its KV-cache events (vLLM's ``--kv-events-config``); None: it does not
    kv_events: str | None = None

    @property
    def address(self) -> str:
        """``ip:port`` as the picker routes to it."""
        return f"{LOOPBACK}:{self.port}"


@dataclass
class LocalStack:
    """The whole system on one machine. ``start()`` brings it up in dependency order, ``stop()`` stops every child."""

    options: StackOptions
    cluster: DevCluster | None = None
    redis: RedisServer | None = None
    #: with ``redis_sentinel``: the data nodes and the sentinels (``redis`` stays None)
    sentinel_redis: SentinelRedis | None = None
    engines: list[Engine] = field(default_factory=list)
    #: the first picker replica (``pickers`` holds every one)
    picker: ManagedProcess | None = None
    pickers: list[ManagedProcess] = field(default_factory=list)
    envoy: ManagedProcess | None = None
    controller: ManagedProcess | None = None
    gateway_port: int = 0
    picker_metrics_port: int = 0
    #: every picker replica's metrics port (the first is ``picker_metrics_port``)
    picker_metrics_ports: list[int] = field(default_factory=list)
    controller_metrics_port: int = 0
    #: with the ``vllm`` runtime: the checkpoint directory every vLLM pod serves, and its digest
    model_dir: Path | None = None
    model_digest: str | None = None
    #: set (e.g. by Ctrl-C) to abandon a start in progress
    cancel: threading.Event = field(default_factory=threading.Event)
    #: child name -> restarts so far (``restart_dead``)
    restarts: dict[str, int] = field(default_factory=dict)
    #: child name -> (restarts in a row, when the next may start, when the last started)
    _restart_state: dict[str, tuple[int, float, float]] = field(default_factory=dict, repr=False)

    @property
    def logs(self) -> Path:
        """Directory of the children's log files."""
        return self.options.workdir / "logs"

    @property
    def artifacts(self) -> Path:
        """The only directory ``file://`` artifacts may come from (the sidecars' ``--file-root``)."""
        return self.options.workdir / "artifacts"

    @property
    def gateway_url(self) -> str:
        """Envoy's listener: the OpenAI-compatible endpoint clients use."""
        return f"http://{LOOPBACK}:{self.gateway_port}"

    @property
    def secrets(self) -> StackSecrets:
        """Redis passwords, the ACL file and the runtimes' admin tokens (files below ``<workdir>/secrets``)."""
        return StackSecrets(self.options.workdir / "secrets")

    def admin_headers(self, pod: str) -> dict[str, str]:
        """The ``Authorization`` header ``pod``'s engine requires on its admin endpoints (what its sidecar sends)."""
        return {"authorization": f"Bearer {self.secrets.token_file(pod).read_text().strip()}"}

    def redis_client(self, user: str = "observer") -> aioredis.Redis:
        """An asyncio client of the stack's Redis as ``user`` (``observer`` reads; ``admin`` may do anything)."""
        return async_redis(self.redis_url, environ=self.secrets.redis_env(user))

    @property
    def redis_url(self) -> str:
        """The bus every component shares (``redis+sentinel://...`` with ``redis_sentinel``)."""
        if self.sentinel_redis is not None:
            return self.sentinel_redis.url
        assert self.redis is not None, "not started"
        return self.redis.url

    def processes(self) -> list[ManagedProcess]:
        """Every child started so far, in start order."""
        started: list[ManagedProcess | None] = [
            self.cluster.process if self.cluster else None, self.redis.process if self.redis else None,
            *(self.sentinel_redis.processes() if self.sentinel_redis else ()),
            *(e.engine for e in self.engines), *(e.sidecar for e in self.engines), *(self.pickers or (self.picker,)),
            self.envoy,
            self.controller,
        ]
        return [p for p in started if p is not None]

    def pids(self) -> dict[str, int]:
        """Child name -> PID (for ``--json`` and for checking that shutdown left nothing running)."""
        return {Path(p.log_path).stem: p.pid for p in self.processes()}

    def dead(self) -> list[str]:
        """Names of children that exited on their own."""
        return [Path(p.log_path).stem for p in self.processes() if not p.alive()]

    def restart_dead(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> list[str]:
        """Start again every child that exited on its own, each once its backoff has passed; returns those started.

        The same command line, port and log (appended), so Envoy, the picker and the Pod objects need no change;
        a restarted Redis comes back empty and is refilled by the controller's repair and the sidecars' next
        heartbeats. The API server is not restarted (its objects are in memory): its death raises RuntimeError.
        """
        restarted = []
        now = clock()
        for process in self.processes():
            name = Path(process.log_path).stem
            if process.alive():
                continue
            if self.cluster is not None and process is self.cluster.process:
                raise RuntimeError(f"the API server exited ({process.proc.returncode if process.proc else None}); "
                                   "its objects are gone, so the stack stops")
            failures, not_before, started = self._restart_state.get(name, (0, 0.0, 0.0))
            if started and now - started >= RESTART_RESET_S:
                failures = 0
            if not_before == 0.0:
                delay = min(RESTART_CAP_S, RESTART_BASE_S * 2 ** failures)
                self._restart_state[name] = (failures + 1, now + delay, 0.0)
                say(f"loraplane up: {name} exited with {process.proc.returncode if process.proc else None}; "
                    f"restarting in {delay:.1f} s (see {process.log_path})")
                continue
            if now < not_before:
                continue
            process.start()
            self._restart_state[name] = (failures, 0.0, now)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            restarted.append(name)
            say(f"loraplane up: {name} restarted (pid {process.pid}, restart {self.restarts[name]})")
        return restarted

    def start(self) -> LocalStack:
        """Start everything and wait until each piece answers; on any failure stop what was started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        work = self.options.workdir
        self.logs.mkdir(parents=True, exist_ok=True)
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.cluster = start_devcluster(work / "cluster")
        self.secrets.create(POOL, [f"engine-{i}" for i in range(self.options.engines)],
                            [f"picker-{i}" for i in range(self.options.pickers)], sentinel=self.options.redis_sentinel)
        if self.options.redis_sentinel:
            self.sentinel_redis = start_sentinel_redis(self.logs, self.secrets)
        else:
            self.redis = start_redis(self.logs, acl_file=self.secrets.acl_file())
        if self.options.runtime in VLLM_API_RUNTIMES:
            self._write_model()
        for i in range(self.options.engines):
            self.engines.append(self._start_engine(f"engine-{i}"))
        for engine in self.engines:  # a pod registering many adapters at start-up listens only after loading them
            slow = self.options.runtime == "vllm" or bool(self.options.lora_modules)
            self._wait(engine.port, engine.engine, timeout=600 if slow else 180)
            if self.options.peer is None:
                engine.sidecar = self._start_sidecar(engine)
        self._apply_pool()
        self._start_gateway()
        if self.options.peer is not None:
            return
        self.controller_metrics_port = free_port()
        self.controller = ManagedProcess(
            [sys.executable, "-m", "loraplane.controller.cli", "--kubeconfig", str(self.cluster.kubeconfig),
             "--redis-url", self.redis_url, "--identity", "local", "--no-leader-election",
             "--resync-seconds", str(self.options.controller_resync or self.options.heartbeat),
             "--metrics-port", str(self.controller_metrics_port)],
            self.logs / "controller.log", env=self.secrets.redis_env("controller")).start()
        self._wait(self.controller_metrics_port, self.controller)

    def _wait(self, port: int, process: ManagedProcess, timeout: float = 60.0) -> None:
        """Wait until ``process`` listens on ``port``, giving up at once when ``cancel`` is set."""
        deadline = time.monotonic() + timeout
        while True:
            if self.cancel.is_set():
                raise StartCancelled("start-up interrupted")
            try:
                wait_for_port(port, proc=process.proc, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{Path(process.log_path).stem} is not listening on {port} after "
                                       f"{timeout} s:\n{process.log_tail()}") from None

    def _write_model(self) -> None:
        from loraplane.engine.make_adapters import write_model

        self.model_dir = self.options.workdir / "model" / self.options.model
        self.model_digest = write_model(self.model_dir, self.options.model)

    def _start_vllm(self, pod: str, port: int) -> Engine:
        """A vLLM pod: the checkpoint served under the preset's name, its worker on a core of its own, its KV-cache
        events published for its sidecar (the picker's precise prefix scorer reads the blocks they name). An emulated
        pod takes the same flags; it charges time from its profile, keeps vLLM's default block size and publishes no
        KV-cache events."""
        from loraplane.vllm_server import VllmOptions, start_vllm

        assert self.model_dir is not None
        emulated = self.options.runtime == "emulated"
        index = len(self.engines)
        events = None if emulated else f"tcp://{LOOPBACK}:{free_port()}"
        options = VllmOptions(model=self.model_dir, served_model_name=self.options.model,
                              max_loras=self.options.max_loras, max_cpu_loras=self.options.max_cpu_loras,
                              max_lora_rank=VLLM_MAX_LORA_RANK,
                              max_model_len=EMULATED_MAX_MODEL_LEN if emulated else VllmOptions.max_model_len,
                              cpu_bind=None if emulated else str(index % (os.cpu_count() or 1)),
                              block_size=None if emulated else VLLM_BLOCK_SIZE, kv_events_endpoint=events,
                              extra_args=("--enable-prompt-tokens-details", *self._pod_args(emulated)),
                              emulated=emulated, profile=self.options.profile)
        server = start_vllm(options, self.logs / f"{pod}.log", port=port)
        return Engine(pod, port, server.process, kv_events=events)

    def _start_engine(self, pod: str) -> Engine:
        port = free_port()
        cache = self.options.workdir / "pods" / pod
        cache.mkdir(parents=True, exist_ok=True)
        if self.options.runtime in VLLM_API_RUNTIMES:
            return self._start_vllm(pod, port)
        args = [sys.executable, "-m", "loraplane.engine", "--model", self.options.model, "--port", str(port),
                "--max-loras", str(self.options.max_loras), "--max-cpu-loras", str(self.options.max_cpu_loras),
                "--torch-threads", "1", "--adapter-root", str(cache), "--enable-lora-runtime-updating",
                "--max-model-len", "256", "--max-num-seqs", "8", *SCHEDULING_ARGS]
        env = {ADMIN_TOKEN_FILE_ENV: str(self.secrets.token_file(pod))}
        return Engine(pod, port, ManagedProcess(args, self.logs / f"{pod}.log", env=env).start())

    def _start_sidecar(self, engine: Engine) -> ManagedProcess:
        runtime = "vllm" if self.options.runtime in VLLM_API_RUNTIMES else self.options.runtime
        args = [sys.executable, "-m", "loraplane.sidecar", "--pool", POOL, "--pod", engine.pod,
                "--runtime", runtime,
                "--runtime-url", f"http://{engine.address}", "--redis-url", self.redis_url,
                "--cache-dir", str(self.options.workdir / "pods" / engine.pod), "--heartbeat",
                str(self.options.heartbeat), "--report-ttl", str(max(3.0, 6 * self.options.heartbeat)),
                "--metrics-port", "0", "--file-root", str(self.artifacts)]
        if runtime == "vllm":  # vLLM does not say its limits or its model's digest: the sidecar is told
            args += ["--max-loras", str(self.options.max_loras), "--max-cpu-loras", str(self.options.max_cpu_loras),
                     "--max-lora-rank", str(VLLM_MAX_LORA_RANK), "--base-model-digest", str(self.model_digest)]
        if engine.kv_events:
            args += ["--kv-events-endpoint", engine.kv_events]
        env = {**self.secrets.redis_env(sidecar_user(engine.pod)),
               "LORAPLANE_SIDECAR_RUNTIME_TOKEN_FILE": str(self.secrets.token_file(engine.pod))}
        return ManagedProcess(args, self.logs / f"sidecar-{engine.pod}.log", env=env).start()

    def _apply_pool(self) -> None:
        """The InferencePool and one Pod object per engine (Running and Ready: the engines listen by now), so
        kubectl and the controller see the pool."""
        assert self.cluster is not None
        self.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(pool_manifests(self.engines, self.options.failure_mode)))
        for engine in self.engines:
            self.cluster.kubectl("patch", "pod", engine.pod, "--subresource=status", "--type=merge",
                                 "-p", json.dumps({"status": running_pod_status(engine)}))

    def _start_gateway(self) -> None:
        from loraplane.picker.envoy import HARDENED, ExtProcModes, PickerEndpoint, picker_config

        listed: list[PickerEndpoint] = []
        for i in range(max(1, self.options.pickers)):
            picker_port, health_port, metrics_port = free_port(), free_port(), free_port()
            self.picker_metrics_port = self.picker_metrics_port or metrics_port
            self.picker_metrics_ports.append(metrics_port)
            picker = ManagedProcess(
                [sys.executable, "-m", "loraplane.picker.cli", "--pool", POOL, "--redis-url", self.redis_url,
                 "--grpc-address", f"{LOOPBACK}:{picker_port}", "--health-address", f"{LOOPBACK}:{health_port}",
                 "--metrics-address", f"{LOOPBACK}:{metrics_port}", "--replica", f"picker-{i}",
                 "--resync-seconds", "1",
                 "--publish-seconds", str(self.options.publish_seconds), "--log-level", "WARNING",
                 *self._picker_config_args()],
                self.logs / ("picker.log" if i == 0 else f"picker-{i}.log"),
                env=self.secrets.redis_env("picker")).start()
            self._wait(picker_port, picker)
            self.pickers.append(picker)
            listed.append(PickerEndpoint(picker_port, health_port))
        self.picker = self.pickers[0]
        self.gateway_port, admin_port = free_port(), free_port()
        config = self.options.workdir / "envoy.json"
        access_log = str(self.logs / "envoy-access.log") if self.options.envoy_access_log else None
        policy = dataclasses.replace(HARDENED, endpoints=[e.address for e in self.engines],
                                     fail_open=self.options.failure_mode == "FailOpen", access_log=access_log)
        modes = ExtProcModes(request_body_mode=self.options.body_mode, response_body_mode=self.options.body_mode)
        write_private(config, json.dumps(picker_config(self.gateway_port, listed, admin_port, modes=modes,
                                                       upstream_header=True, policy=policy)))
        self.envoy = ManagedProcess([envoy_binary(), "-c", str(config), "--concurrency", "1", "-l", "warning",
                                     "--base-id", str(self.gateway_port)], self.logs / "envoy.log").start()
        self._wait(self.gateway_port, self.envoy)

    def _pod_args(self, emulated: bool) -> tuple[str, ...]:
        """A vLLM pod's scheduling and adapters: loraplane's as the chart starts them (``priority`` queues; emulated
        pods also its step budget, ``modelServer.scheduling.maxNumBatchedTokens``), a peer's with vLLM's defaults
        and its adapters registered at start-up."""
        if self.options.peer is not None:
            modules = [f"{name}={path}" for name, path in self.options.lora_modules.items()]
            return ("--lora-modules", *modules) if modules else ()
        from loraplane.sim.policies import LORAPLANE_MAX_BATCHED_TOKENS

        steps = ("--max-num-batched-tokens", str(LORAPLANE_MAX_BATCHED_TOKENS)) if emulated else ()
        return (*SCHEDULING_ARGS, *steps)

    def _picker_config_args(self) -> list[str]:
        """A peer's packaged config over the pods' scraped metrics. loraplane's picker writes each request's priority
        into its body (``--runtime-priority``) and runs: over vLLM pods, the default config with the prefix scorer in
        precise mode (their KV-cache events, the model's tokenizer); over emulated pods, the default config with its
        saturation thresholds sized for the profile's pod (as the simulator runs it, and as an operator sizes them
        for the pool's GPUs); over engines, the packaged default (approximate)."""
        if self.options.peer is not None:
            endpoints = [arg for e in self.engines for arg in ("--endpoint", f"{e.pod}={e.address}")]
            return ["--data-source", "scrape", "--config", f"peer:{self.options.peer}", "--scrape-interval",
                    str(self.options.scrape_interval), *endpoints]
        return ["--runtime-priority", *self._own_picker_config_args()]

    def _own_picker_config_args(self) -> list[str]:
        if self.options.runtime == "emulated":
            from loraplane.sim.policies import picker_config_for
            from loraplane.sim.profile import LARGE_GPU, load_profile

            config = picker_config_for(load_profile(self.options.profile or LARGE_GPU.name))
            path = self.options.workdir / "picker-config.yaml"
            path.write_text(config.to_yaml())
            return ["--config", str(path)]
        if self.options.runtime != "vllm" or self.model_dir is None:
            return []
        from loraplane.picker.prefix import precise_parameters
        from loraplane.picker.scheduler import EndpointPickerConfig

        config = EndpointPickerConfig.load().with_parameters(
            "prefix-cache-scorer", **precise_parameters(VLLM_BLOCK_SIZE, self.model_dir / "tokenizer.json"))
        path = self.options.workdir / "picker-config.yaml"
        path.write_text(config.to_yaml())
        return ["--config", str(path)]

    def stop(self) -> dict[str, int | None]:
        """Stop every child (the controller first, so it writes nothing while the rest goes; then all at once).

        Returns each one's exit code.
        """
        processes = self.processes()
        writer = [p for p in processes if p is self.controller]
        codes = {Path(p.log_path).stem: p.stop() for p in writer}
        rest = [p for p in processes if p is not self.controller]
        with ThreadPoolExecutor(max_workers=max(1, len(rest))) as pool:
            codes.update(zip((Path(p.log_path).stem for p in rest), pool.map(ManagedProcess.stop, rest), strict=True))
        return codes


def pool_manifests(engines: Sequence[Engine], failure_mode: str = "FailClose") -> list[dict[str, Any]]:
    """The InferencePool of the stack and a Pod object per engine (what a real cluster would hold)."""
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": "default"},
            "spec": {"selector": {"matchLabels": ENGINE_LABELS}, "targetPorts": [{"number": engines[0].port}],
                     "endpointPickerRef": {"name": "loraplane-picker", "port": {"number": 9002},
                                           "failureMode": failure_mode}}}
    pods = [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": e.pod, "namespace": "default", "labels": ENGINE_LABELS},
             "spec": {"containers": [{"name": "engine", "image": "loraplane:local",
                                      "ports": [{"containerPort": e.port}]}]}} for e in engines]
    return [pool, *pods]


def running_pod_status(engine: Engine) -> dict[str, Any]:
    """The status of a Pod whose engine is up: Running, Ready, on loopback."""
    ready = {"type": "Ready", "status": "True"}
    container = {"name": "engine", "ready": True, "started": True, "restartCount": 0, "image": "loraplane:local",
                 "imageID": "", "state": {"running": {}}}
    return {"phase": "Running", "podIP": LOOPBACK, "podIPs": [{"ip": LOOPBACK}], "hostIP": LOOPBACK,
            "conditions": [ready, {**ready, "type": "ContainersReady"}], "containerStatuses": [container]}
