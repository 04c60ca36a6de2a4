"""The ``loraplane-picker`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-picker``."""
    parser = argparse.ArgumentParser(prog="loraplane-picker", description="loraplane picker (not yet implemented)")
    parser.parse_args(argv)
    print("loraplane-picker: not yet implemented", file=sys.stderr)
    return 2
