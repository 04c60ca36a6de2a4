"""loraplane's version. ``loraplane`` is a namespace package: each component folder holds its own part of it
(``picker/loraplane/picker``, ``runtime-sidecar/loraplane/sidecar``, ...; CONTRIBUTING.md, "Layout"), this folder
the ``loraplane`` command and the shared plumbing."""

__version__ = "0.1.0"
