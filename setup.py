"""The packages and where they live. ``loraplane`` is a namespace package (PEP 420) laid out in parts: ``loraplane/``
holds the command and the shared plumbing, and each component folder its own part under ``<folder>/loraplane/``
(``picker/loraplane/picker``, ``runtime-sidecar/loraplane/sidecar``, ...). Every part is found here, so a new
component folder needs no entry; everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).parent
FOLDERS = [".", *sorted({p.parents[2].name for p in HERE.glob("*/loraplane/*/__init__.py")})]
package_dir = {"loraplane": "loraplane"}
for folder in FOLDERS:
    for name in find_namespace_packages(folder, include=["loraplane.*"], exclude=["*.__pycache__"]):
        package_dir[name] = "/".join([folder, *name.split(".")]).removeprefix("./")

setup(packages=sorted(package_dir), package_dir=package_dir)
