"""The ``loraplane-engine`` command (the server) and ``loraplane engine <tool>`` (helpers)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplane.credentials import secret
from loraplane.engine.policies import POLICIES
from loraplane.helptext import HelpFormatter

#: vLLM's switch for the dynamic LoRA endpoints; ``--enable-lora-runtime-updating`` does the same.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: The admin token may come from the environment instead of the command line (which ``ps`` shows).
ADMIN_TOKEN_ENV = "LORAPLANE_ENGINE_ADMIN_TOKEN"
#: ... or from a file (a mounted Secret); the variable wins over the file.
ADMIN_TOKEN_FILE_ENV = "LORAPLANE_ENGINE_ADMIN_TOKEN_FILE"


def _lora_module(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {value!r}")
    return name, Path(path)


def parser() -> argparse.ArgumentParser:
    """The server's flags (vLLM's names where vLLM has the same knob)."""
    p = argparse.ArgumentParser(prog="loraplane-engine", formatter_class=HelpFormatter,
                                description="vLLM-compatible multi-LoRA reference engine with GPU/CPU adapter tiers")
    p.add_argument("--model", default="tiny", help="preset (tiny, small, medium) or a transformers Llama directory")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's weights")
    p.add_argument("--served-model-name", default=None, help="the base model's name in the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations dtype")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-loras", type=int, default=1, help="adapters usable in one batch (device slots)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host-memory adapter cache (default max-loras)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests running in one batch at most")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's: admit waiting requests in arrival order, or lower `priority` request values first")
    p.add_argument("--max-model-len", type=int, default=512, help="prompt plus output tokens per request at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one forward pass at most")
    p.add_argument("--eviction-policy", default="lru", choices=sorted(POLICIES),
                   help="which adapter leaves a full GPU or host tier")
    p.add_argument("--lora-modules", nargs="*", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="adapters to load at start (operator-given paths: not confined to --adapter-root)")
    p.add_argument("--adapter-root", type=Path, default=None,
                   help="the only directory /v1/load_lora_adapter may read from")
    p.add_argument("--enable-lora-runtime-updating", action="store_true",
                   help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (or set {RUNTIME_LORA_ENV}=true)")
    p.add_argument("--admin-token", default=None,
                   help=f"bearer token every admin call must carry (or {ADMIN_TOKEN_ENV}); without one only "
                   "loopback callers not behind a proxy may use admin endpoints")
    p.add_argument("--admin-token-file", default=os.environ.get(ADMIN_TOKEN_FILE_ENV),
                   help=f"file holding the admin token (or {ADMIN_TOKEN_FILE_ENV})")
    p.add_argument("--lora-backend", default=None, help="force a loraplane.kernels backend (cpu, torch, triton, ascend)")
    p.add_argument("--lora-merge", choices=("auto", "off", "force"), default="auto",
                   help="serve an adapter that carries almost every row from merged weights: auto (where the "
                   "engine measured that it pays), off, force (every step; for tests)")
    p.add_argument("--max-merged-loras", type=int, default=2,
                   help="adapters merged at once at most (each a copy of the projection weights), where memory allows")
    p.add_argument("--torch-threads", type=int, default=1, help="intra-op CPU threads (1 lets several engines share cores)")
    p.add_argument("--load-read-threads", type=int, default=None,
                   help="threads that read one large adapter file at once (default: this process's CPUs, at most 4)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-engine``: serve until SIGINT/SIGTERM."""
    args = parser().parse_args(argv)
    import torch
    import uvicorn

    from loraplane.engine.app import EngineOptions, build

    torch.set_num_threads(args.torch_threads)
    options = EngineOptions(
        model=args.model, seed=args.seed, served_model_name=args.served_model_name, dtype=args.dtype,
        device=args.device, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=args.scheduling_policy,
        eviction_policy=args.eviction_policy,
        lora_modules=dict(args.lora_modules), adapter_root=args.adapter_root,
        allow_runtime_lora_updating=args.enable_lora_runtime_updating
        or os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
        admin_token=secret(args.admin_token or os.environ.get(ADMIN_TOKEN_ENV), args.admin_token_file),
        lora_backend=args.lora_backend, lora_merge=args.lora_merge, max_merged_loras=args.max_merged_loras,
    )
    if args.load_read_threads is not None:
        options.load_read_threads = args.load_read_threads
    try:
        built = build(options)
    except (ValueError, OSError) as exc:
        print(f"loraplane-engine: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(built.app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


#: ``loraplane engine <tool>`` -> (target, one-line help)
TOOLS: dict[str, tuple[str, str]] = {
    "serve": ("loraplane.engine.cli:main", "serve the engine until SIGINT/SIGTERM (same as loraplane-engine)"),
    "make-adapters": ("loraplane.engine.make_adapters:main", "write random PEFT LoRA adapters for a model"),
    "make-model": ("loraplane.engine.make_adapters:model_main", "write a preset model as a transformers checkpoint"),
}


def tools_main(argv: Sequence[str]) -> int:
    """``loraplane engine <tool> ...`` (tools: serve, make-adapters, make-model)."""
    from loraplane.cli import dispatch, dispatcher

    parser = dispatcher("loraplane engine", "the multi-LoRA reference engine and its helpers", TOOLS, "TOOL")
    return dispatch(parser, TOOLS, argv, missing=2)
