#!/usr/bin/env bash
# Prints a PYTHONPATH that imports the loraplane namespace from the checkout without an install: the checkout and
# every component folder holding a part of it (<folder>/loraplane/<component>: setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
roots=("$PWD")
for init in */loraplane/*/__init__.py; do roots+=("$PWD/${init%%/*}"); done
printf '%s\n' "${roots[@]}" | awk '!seen[$0]++' | paste -sd:
