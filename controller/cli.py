"""The ``loraplane-controller`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplane-controller``."""
    parser = argparse.ArgumentParser(prog="loraplane-controller", description="loraplane controller (not yet implemented)")
    parser.parse_args(argv)
    print("loraplane-controller: not yet implemented", file=sys.stderr)
    return 2
