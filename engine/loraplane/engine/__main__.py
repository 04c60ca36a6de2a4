"""``python -m loraplane.engine``: the same as ``loraplane-engine``."""

from loraplane.engine.cli import main

raise SystemExit(main())
