#!/usr/bin/env bash
# The project's test command: lint, types, generated files, the import contracts, then every test but gpu/npu ones.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy -p loraplane
echo "== crds"; loraplane gen-crds --check
echo "== imports"; lint-imports --no-cache  # the layering contracts of .importlinter
echo "== pytest"
# pytest exits 5 when no test ran: that is a failure here, as any non-zero exit is.
pytest -m "not gpu and not npu" "$@"
