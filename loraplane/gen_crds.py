"""``loraplane gen-crds``: write or check the CRD YAML generated from the api models."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplane.api import crd
from loraplane.helptext import HelpFormatter


def main(argv: Sequence[str]) -> int:
    """Write ``crds/loraplane.io_adapterrevisions.yaml``, or with ``--check`` exit 1 when it is out of date."""
    parser = argparse.ArgumentParser(prog="loraplane gen-crds", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("crds"), help="output folder (default: ./crds)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed YAML is out of date")
    args = parser.parse_args(argv)
    if args.check:
        problem = crd.check(args.out)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(f"{args.out / crd.CRD_FILENAME} is up to date")
        return 0
    print(crd.write(args.out))
    return 0
