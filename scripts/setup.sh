#!/usr/bin/env bash
# Install everything loraplane needs on a fresh Debian machine: system packages (as root), a virtual
# environment in .venv with the project and its dev extras. Idempotent: re-running skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(redis-server redis-sentinel nginx-light wrk docker-registry gcc libc6-dev)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing system packages: ${missing[*]} (run as root, or install them with apt-get)" >&2
    exit 1
  fi
  echo "setup: apt-get install ${missing[*]}"
  apt-get update -qq
  # Install without starting services: the tests start their own servers on free loopback ports.
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ "$made_policy" -eq 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.loraplane-installed
# the packaging: pyproject.toml, setup.py and the folders holding parts of the namespace (an editable install maps
# the packages it saw: a new part needs a new install)
want=$( (cat pyproject.toml setup.py; printf '%s\n' */loraplane/*/__init__.py) | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: pip install -e .[dev,gpu] into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # torch is pinned to 2.13.0 in pyproject.toml: a CPU build; an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -e '.[dev,gpu]'
  echo "$want" > "$stamp"
fi
bash scripts/install-tools.sh
bash scripts/setup-vllm.sh
echo "setup: ready (.venv, .venv-vllm, .tools/bin)"
