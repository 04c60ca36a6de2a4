#!/usr/bin/env bash
# Install inference-perf (the Gateway API Inference Extension project's benchmark client) into its own virtual
# environment, .venv-iperf beside .venv, for `loraplane bench inference-perf`. A benchmark tool only: neither
# `make setup` nor CI runs this, and the tests that need it skip without it.
#   - inference-perf needs Python >= 3.12 (loraplane's .venv may be older): the first of $LORAPLANE_IPERF_PYTHON,
#     python3.13, python3.12 that runs and is >= 3.12 makes the environment; without one this exits 2 and says so;
#   - inference-perf pins transformers (it always builds a Hugging Face tokenizer) but needs no torch: none is
#     installed, and the script fails if a resolve ever pulls one in (a CUDA build would be gigabytes).
# Idempotent: re-running does nothing once the pinned version is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

IPERF_PIN=inference-perf==0.7.0
VENV=.venv-iperf

# A command that runs and is Python >= 3.12 (a pyenv shim of a version that is not selected fails to run).
usable() {
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

if [ ! -x "$VENV/bin/python" ] || ! usable "$VENV/bin/python"; then
  PY=
  for candidate in ${LORAPLANE_IPERF_PYTHON:+"$LORAPLANE_IPERF_PYTHON"} python3.13 python3.12; do
    if usable "$candidate"; then
      PY=$candidate
      break
    fi
  done
  if [ -z "$PY" ]; then
    echo "setup-inference-perf: inference-perf needs Python >= 3.12 and none was found (tried" \
         "${LORAPLANE_IPERF_PYTHON:+\$LORAPLANE_IPERF_PYTHON=$LORAPLANE_IPERF_PYTHON, }python3.13, python3.12)." >&2
    echo "setup-inference-perf: install one, or point LORAPLANE_IPERF_PYTHON at its interpreter" \
         "(with pyenv: LORAPLANE_IPERF_PYTHON=\$(pyenv root)/versions/3.12.x/bin/python)." >&2
    exit 2
  fi
  rm -rf "$VENV"
  echo "setup-inference-perf: creating $VENV with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
fi

# What is installed, from package metadata. Prints what is missing or wrong.
check() {
  "$VENV/bin/python" - "$IPERF_PIN" <<'EOF'
import sys
from importlib import metadata

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

name, want = sys.argv[1].split("==")
have = version(name)
problems = [] if have == want else [f"{name} {have or 'missing'} (want {want})"]
problems += [f"{extra} {version(extra)} present (inference-perf needs no torch)"
             for extra in ("torch", "torchvision", "torchaudio") if version(extra)]
print("; ".join(problems))
EOF
}

problems=$(check)
if [ -n "$problems" ]; then
  echo "setup-inference-perf: installing $IPERF_PIN into $VENV ($problems)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q "$IPERF_PIN"
  problems=$(check)
  if [ -n "$problems" ]; then
    echo "setup-inference-perf: $VENV is still wrong after installing: $problems" >&2
    exit 1
  fi
fi
"$VENV/bin/inference-perf" --help >/dev/null
echo "setup-inference-perf: ready ($VENV: $IPERF_PIN, $("$VENV/bin/python" --version 2>&1))"
