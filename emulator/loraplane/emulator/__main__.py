"""``python -m loraplane.emulator``: the same flags as ``python -m vllm.entrypoints.openai.api_server``."""

from loraplane.emulator.cli import main

raise SystemExit(main())
