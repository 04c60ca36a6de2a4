"""``python -m loraplane.sidecar``: the same as ``loraplane-sidecar``."""

from loraplane.sidecar.cli import main

raise SystemExit(main())
