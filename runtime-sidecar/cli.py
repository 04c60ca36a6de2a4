"""The ``loraplane-sidecar`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-sidecar``."""
    parser = argparse.ArgumentParser(prog="loraplane-sidecar", description="loraplane sidecar (not yet implemented)")
    parser.parse_args(argv)
    print("loraplane-sidecar: not yet implemented", file=sys.stderr)
    return 2
