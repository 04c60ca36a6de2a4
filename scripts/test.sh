#!/usr/bin/env bash
# The project's test command: lint, types, generated files, the import contracts, then every test but gpu/npu ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/lint.sh
source .venv/bin/activate
echo "== pytest"
# pytest exits 5 when no test ran: that is a failure here, as any non-zero exit is.
pytest -m "not gpu and not npu" "$@"
