"""The emulator's command line: vLLM's flags checked as vLLM checks them, ``loraplane emulate``, and a process that
imports neither torch nor numpy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraplane.cli import COMMANDS
from loraplane.emulator.cli import main, parser


def test_importing_the_emulator_loads_neither_torch_nor_numpy() -> None:
    code = ("import sys, loraplane.emulator.cli, loraplane.emulator.server, loraplane.emulator.serve; "
            "print(sorted({'torch', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize(("flags", "reason"), [
    (["--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be >= max_loras (4)."),
    (["--tensor-parallel-size", "2"], "only 1 is emulated"),
    (["--profile", "no-such-profile"], "unknown profile 'no-such-profile'"),
    (["--max-model-len", "64", "--long-prefill-token-threshold", "128"],
     "long_prefill_token_threshold (128) cannot be greater than the max_model_len (64)."),
])
def test_flags_vllm_refuses_exit_2_with_the_reason(flags: list[str], reason: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    assert reason in capsys.readouterr().err


def test_vllms_command_line_parses_with_defaults_from_vllm_and_the_profile() -> None:
    args = parser().parse_args([
        "--model", "m", "--host", "127.0.0.1", "--port", "9", "--enable-lora", "--max-loras", "2", "--max-cpu-loras",
        "3", "--max-lora-rank", "16", "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
        "--disable-uvicorn-access-log", "--served-model-name", "base", "--block-size", "32",
        "--kv-events-config", '{"enable_kv_cache_events": true}', "--enable-prompt-tokens-details",
        "--scheduling-policy", "priority", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
        "--no-enable-prefix-caching", "--api-key", "k1", "--api-key", "k2"])
    assert args.lora_modules == [("a", "/x"), ("b", "/y")] and args.api_key == ["k1", "k2"]
    assert not args.enable_prefix_caching and args.block_size == 32 and args.max_num_seqs is None
    defaults = parser().parse_args([])
    assert (defaults.max_loras, defaults.max_lora_rank, defaults.block_size, defaults.enable_prefix_caching,
            defaults.stream_interval) == (1, 16, 16, True, 0.25)


def test_loraplane_emulate_is_the_emulators_command() -> None:
    assert COMMANDS["emulate"][0] == "loraplane.emulator.cli:main"
    out = subprocess.run([sys.executable, "-m", "loraplane.cli", "emulate", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--stream-interval" in out.stdout
