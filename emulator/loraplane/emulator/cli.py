"""``python -m loraplane.emulator`` / ``loraplane emulate``: a vLLM emulator taking the command line of
``python -m vllm.entrypoints.openai.api_server`` (and vLLM's ``VLLM_*`` settings), plus ``--profile``,
``--adapter-bytes`` and ``--stream-interval``.

Imports neither torch nor numpy: dozens of these fit a small machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplane.helptext import HelpFormatter

#: vLLM's environment settings the emulator reads
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
API_KEY_ENV = "VLLM_API_KEY"
LOGGING_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
DEFAULT_PROFILE = "a100-80gb-llama-3.1-8b"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: ``--max-model-len`` when the model directory does not say (its config.json's ``max_position_embeddings``)
DEFAULT_MAX_MODEL_LEN = 8192

log = logging.getLogger("loraplane.emulator")


def _lora_module(value: str) -> tuple[str, str]:
    """vLLM's ``--lora-modules`` item: ``name=path`` or ``{"name": ..., "path": ...}``."""
    if "=" in value and "," not in value:
        name, _, path = value.partition("=")
    else:
        try:
            item = json.loads(value)
            name, path = item["name"], item["path"]
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"Invalid --lora-modules item: {value}") from None
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {value!r}")
    return name, path


def parser() -> argparse.ArgumentParser:
    """vLLM's flags the emulator uses or accepts, and its own."""
    p = argparse.ArgumentParser(prog="loraplane emulate", formatter_class=HelpFormatter,
                                description="A vLLM emulator: vLLM 0.32's OpenAI API, metrics and LoRA semantics, "
                                "time charged from a simulator profile (docs/emulator.md).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a checkpoint directory (its config.json's shapes check adapters as vLLM does) or a name")
    p.add_argument("--served-model-name", nargs="+", default=None, help="the base model's names (default: --model)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--enable-lora", action="store_true", help="accepted (LoRA is always on)")
    p.add_argument("--max-loras", type=int, default=1, help="GPU LoRA slots: adapters in one batch")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host-memory adapter copies (default --max-loras)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank a load accepts")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests in one batch (default: the profile's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one step (default: the profile's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"prompt plus output tokens (default: the model's max_position_embeddings, else "
                   f"{DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="waiting requests in arrival order, or by (priority, arrival)")
    p.add_argument("--api-key", nargs="+", action="extend", default=None,
                   help=f"keys /v1 routes need as Authorization: Bearer (or {API_KEY_ENV})")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching (default on, as vLLM v1)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in completion answers")
    p.add_argument("--lora-modules", nargs="+", action="extend", type=_lora_module, default=[],
                   metavar="NAME=PATH", help="adapters loaded at start-up (as vLLM: each through a load)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request prefills per step (default: the profile's)")
    p.add_argument("--seed", type=int, default=0, help="accepted (answers are deterministic)")
    for flag in ("--dtype", "--disable-uvicorn-access-log", "--enforce-eager", "--kv-events-config"):
        takes_value = flag in ("--dtype", "--kv-events-config")
        p.add_argument(flag, default=None, action="store" if takes_value else "store_true",
                       help="accepted and ignored" + (" (with a warning: KV-cache events are not emulated)"
                                                     if flag == "--kv-events-config" else ""))
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="must be 1 (tensor parallelism is not emulated)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="timing profile: a built-in name or a JSON file (loraplane.sim.profile.load_profile)")
    p.add_argument("--adapter-bytes", type=int, default=None,
                   help="bytes a rank-16 adapter costs to load; rank r costs r/16 of it (default: the profile's)")
    p.add_argument("--stream-interval", type=float, default=0.25,
                   help="seconds between the coalesced chunks of a stream after its first token (0: one per token)")
    return p


def _truthy(value: str | None) -> bool:
    return (value or "0").strip().lower() in ("1", "true")


def _max_position_embeddings(model: Path) -> int | None:
    try:
        value = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse vLLM's flags, start the emulator and serve until stopped; exit 2 with the reason on bad flags."""
    p = parser()
    args = p.parse_args(argv)
    from loraplane.sim.profile import ProfileError, load_profile

    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        p.error(f"max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras ({args.max_loras}).")
    if args.tensor_parallel_size != 1:
        p.error("--tensor-parallel-size: only 1 is emulated")
    if min(args.max_loras, args.max_lora_rank, args.block_size) < 1 or args.stream_interval < 0:
        p.error("--max-loras, --max-lora-rank and --block-size must be at least 1, --stream-interval at least 0")
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        p.error(str(exc))
    model = Path(args.model)
    max_model_len = args.max_model_len or _max_position_embeddings(model) or DEFAULT_MAX_MODEL_LEN
    if max_model_len > profile.kv_capacity_tokens:
        p.error(f"max_model_len ({max_model_len}) is larger than the KV cache ({profile.kv_capacity_tokens} tokens, "
                f"profile {profile.name}): not even one request of that length would fit")
    threshold = (profile.long_prefill_token_threshold if args.long_prefill_token_threshold is None
                 else args.long_prefill_token_threshold)
    if threshold > max_model_len:
        p.error(f"long_prefill_token_threshold ({threshold}) cannot be greater than the max_model_len "
                f"({max_model_len}).")

    level = os.environ.get(LOGGING_LEVEL_ENV, "INFO").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "INFO", stream=sys.stdout,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.kv_events_config:
        log.warning("--kv-events-config is accepted but KV-cache events are not emulated: nothing is published")

    from loraplane.emulator.adapters import ModelShapes
    from loraplane.emulator.engine import Engine, EngineConfig
    from loraplane.emulator.loop import EngineLoop
    from loraplane.emulator.server import ApiConfig, ApiError, EmulatorApi, build_app

    engine = Engine(EngineConfig(
        max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras or args.max_loras,
        max_num_seqs=args.max_num_seqs or profile.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or profile.max_batched_tokens,
        max_model_len=max_model_len, block_size=args.block_size, prefix_caching=args.enable_prefix_caching,
        priority_policy=args.scheduling_policy == "priority", long_prefill_token_threshold=threshold,
        stream_interval=args.stream_interval), profile)
    keys = tuple(k for k in (args.api_key or [os.environ.get(API_KEY_ENV)]) if k)
    api = EmulatorApi(engine, EngineLoop(engine), ApiConfig(
        served_names=tuple(args.served_model_name or [args.model]), model=args.model, max_model_len=max_model_len,
        max_lora_rank=args.max_lora_rank,
        adapter_bytes=profile.default_adapter_bytes if args.adapter_bytes is None else args.adapter_bytes,
        runtime_lora_updating=_truthy(os.environ.get(RUNTIME_LORA_ENV)), api_keys=keys,
        prompt_tokens_details=args.enable_prompt_tokens_details, shapes=ModelShapes.from_dir(model)))

    async def load_lora_modules() -> None:
        for name, path in args.lora_modules:
            try:
                await api.load(name, path, inplace=False)
            except ApiError as exc:
                raise SystemExit(f"--lora-modules {name}={path}: {exc.message}") from None

    log.info("vLLM %s emulator: model %s, profile %s, max_loras %d, max_cpu_loras %d, on %s:%d", "0.32.0",
             args.model, profile.name, engine.config.max_loras, engine.config.max_cpu_loras, args.host, args.port)
    # vLLM's own start-up lines for its limits (``loraplane bench profile`` reads either runtime's log alike)
    log.info("GPU KV cache size: %s tokens", f"{engine.pool.num_blocks * args.block_size:,}")
    log.info("max_num_batched_tokens %d, max_num_seqs %d", engine.config.max_num_batched_tokens,
             engine.config.max_num_seqs)
    from loraplane.emulator.serve import serve

    serve(build_app(api, load_lora_modules), args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
