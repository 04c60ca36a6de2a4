"""The ``loraplane-engine`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-engine``."""
    parser = argparse.ArgumentParser(prog="loraplane-engine", description="loraplane engine (not yet implemented)")
    parser.parse_args(argv)
    print("loraplane-engine: not yet implemented", file=sys.stderr)
    return 2


def tools_main(argv: Sequence[str]) -> int:
    """``loraplane engine ...`` helpers."""
    return main(argv)
