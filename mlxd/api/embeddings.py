"""``POST /v1/embeddings`` in OpenAI's shape, served by a ``kind = "embedding"`` model's engine.

``input``: a string, a list of strings, a list of token ids, or a list of lists of token ids (at most
:data:`MAX_INPUTS`); ``encoding_format``: ``float`` or ``base64`` (each vector's float32 values, little-endian, as
OpenAI sends them); ``dimensions``: the first N features, renormalized, for models configured with
``dimensions_allowed = true`` (Matryoshka-trained ones), else a 400. A body whose ``model`` is a chat model is a
400 naming it, as is a chat request to an embedding model (the engine refuses it).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from mlxd.api.body import StrictJSON
from mlxd.api.metrics import Metrics
from mlxd.daemon import Daemon
from mlxd.engine.embedding import Embedded, EmbeddingRequest
from mlxd.errors import MlxdError, RequestError
from mlxd.log import get_logger

log = get_logger("mlxd.api.embeddings")

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs


class EmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    input: str | list[str | int | list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None  # NO-OP, accepted for compatibility


class EmbeddingsController(Controller):
    path = "/v1"
    tags = ["OpenAI"]

    @post("/embeddings", status_code=200, dto=StrictJSON[EmbeddingsRequest], return_dto=None)
    async def embeddings(self, data: JSONBody[EmbeddingsRequest], daemon: NamedDependency[Daemon],
                         metrics: NamedDependency[Metrics]) -> Response:
        """Vectors for each input, in input order, with the tokens they used."""
        try:
            body, num_tokens = await _embed(data, daemon)
        except MlxdError as e:  # counted and logged, then answered by the API's error handlers
            metrics.requests.labels("embeddings", f"error_{e.status}").inc()
            log.info("request", endpoint="embeddings", model=data.model[:64], outcome=f"error {e.status}: {e.message}")
            raise
        metrics.requests.labels("embeddings", "ok").inc()
        metrics.prompt_tokens.inc(num_tokens)
        return Response(content=body, media_type="application/json")


async def _embed(data: EmbeddingsRequest, daemon: Daemon) -> tuple[bytes, int]:
    """The response body and the tokens it used; its log line written."""
    started = time.monotonic()
    served = await daemon.models.acquire(data.model)  # loads it if it is not loaded
    name, model_config, engine = served.name, served.config.model, served.engine
    if model_config.kind != "embedding":
        raise RequestError(f"model {name!r} is a chat model, not an embedding model (kind = \"embedding\" in "
                           "its config): use /v1/chat/completions", param="model")
    request = embedding_request(data, f"embd-{uuid.uuid4().hex[:24]}", model_config.dimensions_allowed,
                                engine.hidden_size)
    embedded = await engine.embed(request)
    body = await asyncio.to_thread(render, embedded, name, data.encoding_format)
    log.info("request", request_id=request.request_id, endpoint="embeddings", model=name,
             num_inputs=len(embedded.vectors), prompt_tokens=embedded.num_tokens,
             dimensions=int(embedded.vectors.shape[-1]), seconds=round(time.monotonic() - started, 4))
    return body, embedded.num_tokens


def embedding_request(data: EmbeddingsRequest, request_id: str, dimensions_allowed: bool,
                      hidden_size: int) -> EmbeddingRequest:
    """The engine's request for a body: its inputs sorted into texts or token id lists (a mix, an empty list, or
    nesting deeper than lists of token ids is a 400 naming the field), ``dimensions`` checked."""
    if data.dimensions is not None:
        if not dimensions_allowed:
            raise RequestError("this model's vectors cannot be shortened: `dimensions` needs dimensions_allowed = "
                               "true in its config (for Matryoshka-trained models)", param="dimensions")
        if data.dimensions > hidden_size:
            raise RequestError(f"dimensions is {data.dimensions}, more than this model's {hidden_size}",
                               param="dimensions")
    common = {"request_id": request_id, "dimensions": data.dimensions}
    if isinstance(data.input, str):
        return EmbeddingRequest(texts=[data.input], single=True, **common)
    items = data.input
    if not items:
        raise RequestError("input is an empty list: give a string, strings, or token ids", param="input")
    if len(items) > MAX_INPUTS and not isinstance(items[0], int):
        raise RequestError(f"input holds {len(items)} inputs, more than {MAX_INPUTS}", param="input")
    if isinstance(items[0], str):
        return EmbeddingRequest(texts=[_of_type(items, str, index) for index in range(len(items))], **common)
    if isinstance(items[0], int):
        return EmbeddingRequest(token_ids=[[_token(items, index, "input") for index in range(len(items))]],
                                single=True, **common)
    rows = [_of_type(items, list, index) for index in range(len(items))]
    return EmbeddingRequest(token_ids=[[_token(row, position, f"input[{index}]") for position in range(len(row))]
                                       for index, row in enumerate(rows)], **common)


def _of_type(items: list[Any], kind: type, index: int) -> Any:
    item = items[index]
    if not isinstance(item, kind) or isinstance(item, bool):
        raise RequestError(f"input[{index}] is a {type(item).__name__}, but input[0] is a {kind.__name__}: input "
                           "is a list of strings, of token ids, or of lists of token ids, not a mix",
                           param=f"input[{index}]")
    return item


def _token(row: list[Any], position: int, field: str) -> int:
    token = row[position]
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise RequestError(f"{field}[{position}] is {token!r}: token ids are integers from 0", param=field)
    return token


class _Item(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class _Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class _EmbeddingList(msgspec.Struct):
    data: list[_Item]
    model: str
    usage: _Usage
    object: str = "list"


def render(embedded: Embedded, model: str, encoding_format: str) -> bytes:
    """The response body: each vector as floats, or as base64 of its little-endian float32 bytes."""
    vectors = embedded.vectors
    if encoding_format == "base64":
        items = [_Item(index, base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii"))
                 for index, vector in enumerate(vectors)]
    else:
        items = [_Item(index, vector) for index, vector in enumerate(vectors.tolist())]
    usage = _Usage(embedded.num_tokens, embedded.num_tokens)
    return msgspec.json.encode(_EmbeddingList(items, model, usage))
