#!/usr/bin/env bash
# Lint, types and the import contracts (make lint; the first half of scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy  # the files and the namespace's folders: pyproject.toml [tool.mypy]
echo "== crds"; loraplane gen-crds --check
# import-linter reads the loraplane namespace from folders on sys.path, not through the editable install's finder
echo "== imports"; PYTHONPATH="$(bash scripts/namespace-path.sh)" lint-imports --no-cache  # .importlinter's contracts
