"""HTTP header names that cross process boundaries (engine -> sidecar, picker, controller)."""

from __future__ import annotations

#: On every completion response: the served name of the adapter that answered (the base model id for base requests).
SERVED_ADAPTER_HEADER = "x-loraplane-served-adapter"

#: On every completion response: the digest of the weights that answered (``loraplane.api.adapter_digest`` for an
#: adapter, the base model digest for base requests).
ADAPTER_DIGEST_HEADER = "x-loraplane-adapter-digest"
