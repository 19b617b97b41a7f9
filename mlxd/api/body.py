"""Request bodies decoded strictly, in one place.

Litestar converts a handler's ``data`` with msgspec in lax mode, which turns ``"NaN"`` or ``"0.5"`` into floats.
:class:`StrictJSON` is a data DTO that decodes the raw bytes itself with a strict msgspec decoder instead, while the
OpenAPI document keeps the struct's own schema (ranges included):

    @post("/chat/completions", dto=StrictJSON[ChatCompletionRequest], return_dto=None)
    async def handler(data: ChatCompletionRequest) -> ...

Every way a body can be wrong (not JSON, not UTF-8, nested too deep, not an object, a wrong type, a value out of
range) is a :class:`RequestError`, a 400 naming the field where there is one; a body not declared JSON is a 415.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Generator
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
from litestar.dto import AbstractDTO, DTOFieldDefinition
from litestar.typing import FieldDefinition

from mlxd.api.errors import clip
from mlxd.errors import RequestError, UnsupportedMediaType

T = TypeVar("T")

# msgspec ends a validation message with where it failed: "- at `$.messages[0].role`", "- at `key` in `$.x`".
_AT = re.compile(r" - at (?:`key` in )?`\$\.?([A-Za-z_][A-Za-z0-9_]*)?[^`]*`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


@functools.cache
def _decoder(type_: type[T]) -> msgspec.json.Decoder[T]:
    return msgspec.json.Decoder(type_, strict=True)


def decode(type_: type[T], body: bytes, content_type: str | None) -> T:
    """Decode a JSON body into ``type_`` strictly (no string-to-number coercion), or raise a 400 (a 415 when
    ``content_type`` is not JSON)."""
    check_media_type(content_type)
    try:
        return _decoder(type_).decode(body)
    except msgspec.ValidationError as e:
        message = str(e)
        raise RequestError(f"invalid request body: {message}", param=_param_of(message)) from e
    except msgspec.DecodeError as e:
        raise RequestError(f"malformed JSON body: {e}") from e
    except RecursionError as e:
        raise RequestError("malformed JSON body: nested too deeply") from e
    except UnicodeDecodeError as e:
        raise RequestError("malformed JSON body: not valid UTF-8") from e
    except ValueError as e:
        raise RequestError("malformed JSON body") from e


def check_media_type(content_type: str | None) -> None:
    """A 415 unless ``content_type`` is ``application/json`` or ``*/*+json`` (parameters and case aside). A missing
    one is refused too: a POST without it, like text/plain and form bodies, is one any web page may send to any
    origin without a CORS preflight."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if not media_type:
        raise UnsupportedMediaType("the request body must be sent with `Content-Type: application/json`")
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise UnsupportedMediaType(f"the request body must be application/json, not {clip(media_type)!r}")


def _param_of(message: str) -> str | None:
    """The top-level field a msgspec validation message points at (an unknown field names itself)."""
    at = _AT.search(message)
    if at and at.group(1):
        return at.group(1)
    unknown = _UNKNOWN.search(message)
    return unknown.group(1) if unknown else None


def _closed_structs(type_: Any) -> set[type]:
    """The struct types reachable from ``type_`` that forbid unknown fields."""
    closed: set[type] = set()
    seen: set[type] = set()

    def visit(info: msgspec.inspect.Type) -> None:
        if isinstance(info, msgspec.inspect.StructType):
            if info.cls in seen:
                return
            seen.add(info.cls)
            if info.forbid_unknown_fields:
                closed.add(info.cls)
            for field in info.fields:
                visit(field.type)
            return
        for name in info.__struct_fields__:
            value = getattr(info, name)
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, msgspec.inspect.Type):
                    visit(item)

    visit(msgspec.inspect.type_info(type_))
    return closed


class StrictJSON(AbstractDTO[T]):
    """A data DTO that decodes the body with :func:`decode`; not for return values (use ``return_dto=None``)."""

    @classmethod
    def create_for_field_definition(cls, field_definition: FieldDefinition, handler_id: str,
                                    backend_cls: Any = None) -> None:
        """Build the struct's decoder now, as the app is built: there is no transfer model, the struct itself is
        decoded, and building its decoder resolves every annotation of the request's structs (several ms), which
        the first request of each endpoint would otherwise pay on the event loop, delaying every request beside it."""
        _decoder(cls.model_type)

    @classmethod
    def create_openapi_schema(cls, field_definition: FieldDefinition, handler_id: str, schema_creator: Any) -> Any:
        """The struct's own schema; structs that refuse unknown fields say so (``additionalProperties: false``)."""
        schema = schema_creator.for_field_definition(
            FieldDefinition.from_annotation(cls.model_type, kwarg_definition=field_definition.kwarg_definition)
        )
        registry = schema_creator.schema_registry
        for struct in _closed_structs(cls.model_type):
            if (reference := registry.get_reference_for_field_definition(FieldDefinition.from_annotation(struct))):
                registry.from_reference(reference).schema.additional_properties = False
        return schema

    def decode_bytes(self, value: bytes) -> T:
        return decode(self.model_type, value, self.asgi_connection.headers.get("content-type"))

    def decode_builtins(self, value: dict[str, Any]) -> T:
        raise UnsupportedMediaType("the request body must be application/json")

    @classmethod
    def generate_field_definitions(cls, model_type: type[Any]) -> Generator[DTOFieldDefinition, None, None]:
        yield from ()

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:
        return False
