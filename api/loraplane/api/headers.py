"""HTTP header names that cross process boundaries (engine -> sidecar, picker, controller)."""

from __future__ import annotations

from collections.abc import Mapping

#: On every completion response: the served name of the adapter that answered (the base model id for base requests).
SERVED_ADAPTER_HEADER = "x-loraplane-served-adapter"

#: On every completion response: the digest of the weights that answered (``loraplane.api.adapter_digest`` for an
#: adapter, the base model digest for base requests).
ADAPTER_DIGEST_HEADER = "x-loraplane-adapter-digest"

#: llm-d-router's request headers, the current name first, then the deprecated Gateway API Inference Extension alias.
#: A gateway may send either; when both come the current name wins, even with an empty value (llm-d-router v0.10's
#: ``metadata.GetLowerCaseHeaderValue``). Names are matched case-insensitively.
FAIRNESS_ID_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
MODEL_NAME_REWRITE_HEADERS = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")


def first_present(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` in ``headers`` (lower-case names), as llm-d-router reads its headers:
    a present name wins even when its value is empty."""
    for name in names:
        if name in headers:
            return headers[name]
    return None

#: On every refusal the picker answers itself: why (llm-d-router's header; its flow-control values where it has them).
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
