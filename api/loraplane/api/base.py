"""The base class of every api model: camelCase on the wire, snake_case in Python."""

from __future__ import annotations

from typing import Any, ClassVar, Self

import orjson
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """A shape that crosses a process boundary.

    Field names are snake_case in Python and camelCase in JSON (the Kubernetes convention); either form is
    accepted on input. Unknown fields are rejected so that a typo in a manifest or a payload is an error, not a
    silently ignored setting.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=False,
        use_enum_values=False,
        ser_json_inf_nan="null",
    )

    def to_json(self) -> bytes:
        """Compact JSON with camelCase names, defaults included, ``None`` fields left out."""
        return orjson.dumps(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (camelCase names, ``None`` fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        """Parse and validate JSON text."""
        return cls.model_validate_json(data)


class PayloadModel(ApiModel):
    """A payload exchanged between loraplane processes through Redis or HTTP.

    Unknown fields are ignored rather than refused, so a newer writer can add an optional field without breaking
    older readers during a rolling upgrade; an incompatible change bumps ``SCHEMA_VERSION`` instead.
    """

    model_config = ConfigDict(extra="ignore")

    #: the schema versions a reader accepts (``read_payload``); empty: ``api.runtime.SCHEMA_VERSION`` alone
    READ_VERSIONS: ClassVar[tuple[int, ...]] = ()
