"""loraplane: a multi-LoRA serving control plane.

The components live in their own folders and import packages (see CONTRIBUTING.md):
``loraplane.api`` (the contract), ``loraplane.kernels``, ``loraplane.engine``, ``loraplane.sidecar``,
``loraplane.picker``, ``loraplane.controller``, ``loraplane.devcluster`` (the embedded API server) and
``loraplane.sim``.
"""

__version__ = "0.1.0"
