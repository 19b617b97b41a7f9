"""One file of the prefix cache's disk tier (:mod:`mlxd.cache.disk`): a snapshot written by mlx-lm's
``save_prompt_cache`` and read back by its ``load_prompt_cache`` (safetensors with metadata), the checks a file
passes before use, and the model identity files are kept under.

``load_prompt_cache`` finds each layer's class by name in ``mlx_lm.models.cache``. A layer of one of mlxd's own
subclasses of such a class (``mlxd.cache.quantized.QuantizedLayer``: mlx-lm's ``QuantizedKVCache`` that a batch can
merge) keeps its base's state layout, so it is written as that base and turned back into its own class on reading;
the file's ``classes`` metadata names it (only classes of the ``mlxd`` package are imported from there). A snapshot
holding any other class is not written.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_cache

from mlxd.cache.store import Snapshot, take_snapshot

FORMAT = "mlxd-prefix-1"
MAX_HEADER_BYTES = 256 * 1024**2  # a safetensors header larger than this is not one of ours
SAMPLES_PER_PARAMETER = 64


class CorruptFile(ValueError):
    """A file of the tier that cannot be used: torn, truncated, altered or another model's."""


# ---- the model's identity ----

def weights_digest(model: Any) -> str:
    """A digest of the model's parameters: names, shapes, dtypes and ``SAMPLES_PER_PARAMETER`` values spread
    over each (cheap: no pass over all the weights). Call on the thread that runs the model."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    samples = []
    for _, value in params:
        flat = value.reshape(-1)
        step = max(1, flat.size // SAMPLES_PER_PARAMETER)
        samples.append(mx.contiguous(flat[::step][:SAMPLES_PER_PARAMETER]))
    mx.eval(samples)
    digest = hashlib.sha256()
    for (name, value), sample in zip(params, samples, strict=True):
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        digest.update(bytes(memoryview(sample)))
    return digest.hexdigest()


def identity_key(identity: dict[str, Any]) -> str:
    """The folder name and metadata value that stand for an identity."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


# ---- metadata and checks ----

def encode_tokens(tokens: Sequence[int]) -> str:
    return base64.b64encode(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)).decode("ascii")


def decode_tokens(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 8:
        raise CorruptFile("token list is not whole int64 values")
    return tuple(int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8))


def file_digest(path: Path) -> str:
    """BLAKE2b of the file's bytes (the name a file of the tier has)."""
    digest = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024**2):
            digest.update(chunk)
    return digest.hexdigest()


def read_metadata(path: Path) -> dict[str, str]:
    """The ``save_prompt_cache`` metadata of a file (keys without their ``0.`` prefix), after checking that the
    header parses and that the file is exactly as long as the header says. Raises ``CorruptFile``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFile(f"{size} bytes: shorter than a safetensors header")
        num_header = int.from_bytes(head, "little")
        if num_header > min(MAX_HEADER_BYTES, size - 8):
            raise CorruptFile(f"header of {num_header} bytes in a file of {size}")
        try:
            header = json.loads(f.read(num_header))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            metadata = header.get("__metadata__") or {}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise CorruptFile(f"unreadable header: {e}") from e
    if 8 + num_header + max(ends, default=0) != size:
        raise CorruptFile(f"{size} bytes where the header describes {8 + num_header + max(ends, default=0)}")
    return {k.removeprefix("0."): v for k, v in metadata.items() if k.startswith("0.")}


# ---- layers as mlx-lm writes them ----

def _is_mlx_lm(cls: type) -> bool:
    return not cls.__name__.startswith("_") and getattr(mlx_lm_cache, cls.__name__, None) is cls  # public classes


def _file_class(cls: type) -> type | None:
    """The class a layer of ``cls`` is written as: itself when mlx-lm has it, the nearest mlx-lm base of one of
    mlxd's own subclasses, else None."""
    if _is_mlx_lm(cls):
        return cls
    if cls.__module__.split(".")[0] == "mlxd":
        return next((base for base in cls.__mro__[1:] if _is_mlx_lm(base)), None)
    return None


def writable(snapshot: Snapshot) -> bool:
    """Whether every layer of ``snapshot`` (and every layer inside a ``CacheList``, named in its state) can be
    written and read back."""
    for cls, state, _ in snapshot.layers:
        if _file_class(cls) is None:
            return False
        if cls is mlx_lm_cache.CacheList and not all(hasattr(mlx_lm_cache, name) for _, name in state):
            return False
    return True


def _layer(cls: type, state: Any, meta: Any) -> Any:
    state = copy.copy(state)  # new containers; the arrays are shared (immutable)
    return cls.from_state(state) if meta is None else cls.from_state(state, copy.deepcopy(meta))


def save_snapshot(path: Path, snapshot: Snapshot, metadata: dict[str, str]) -> None:
    """Write ``snapshot`` with ``metadata`` (and the layers' own classes) through ``save_prompt_cache``."""
    layers = [_layer(_file_class(cls), state, meta) for cls, state, meta in snapshot.layers]
    classes = [f"{cls.__module__}:{cls.__qualname__}" for cls, _, _ in snapshot.layers]
    mlx_lm_cache.save_prompt_cache(str(path), layers, {**metadata, "classes": json.dumps(classes)})


def _own_class(name: str, loaded: type) -> type:
    """The class a file names for a layer ``load_prompt_cache`` made of class ``loaded``."""
    module, _, qualname = name.partition(":")
    if module == loaded.__module__ and qualname == loaded.__qualname__:
        return loaded
    if module.split(".")[0] != "mlxd":
        raise CorruptFile(f"a layer of class {name!r}, which is not mlx-lm's nor mlxd's")
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError) as e:
        raise CorruptFile(f"a layer of class {name!r}, which this mlxd does not have") from e
    if not (isinstance(cls, type) and issubclass(cls, loaded)):
        raise CorruptFile(f"a layer of class {name!r} stored as {loaded.__name__}")
    return cls


def load_snapshot(path: Path) -> tuple[Snapshot, dict[str, str]]:
    """The snapshot a file holds (its layers in their own classes, evaluated) and its metadata."""
    layers, metadata = mlx_lm_cache.load_prompt_cache(str(path), return_metadata=True)
    try:
        classes = json.loads(metadata["classes"])
    except (KeyError, ValueError) as e:
        raise CorruptFile(f"unreadable classes: {e}") from e
    if not isinstance(classes, list) or len(classes) != len(layers):
        raise CorruptFile(f"{len(layers)} layers but classes {classes!r}")
    own = [_own_class(name, type(layer)) for name, layer in zip(classes, layers, strict=True)]
    layers = [layer if cls is type(layer) else _layer(cls, layer.state, _meta_state(layer))
              for cls, layer in zip(own, layers, strict=True)]
    return take_snapshot(layers), metadata


def _meta_state(layer: Any) -> Any:
    return layer.meta_state if hasattr(type(layer), "meta_state") else None
