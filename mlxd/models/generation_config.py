"""Sampling defaults: the config's ``[model.sampling]``, else the model's own, else mlxd's.

The model's own are what its ``generation_config.json`` sets (as vLLM reads it: ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``; ``max_new_tokens`` is a generation cap, not an answer length, so
``max_tokens`` stays mlxd's), and for an embedded model the defaults shipped with it. Plain Python: ``check-config``
shows the result without loading anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from mlxd.config.sampling import MODEL_FIELDS, resolve_sampling
from mlxd.log import get_logger
from mlxd.models.default_model import embedded_generation

log = get_logger("mlxd.models")

# generation_config.json keys read (the [model.sampling] fields of the same names) and the values each may take:
# the ranges a request may ask for, as for [model.sampling] (mlxd/config/schema.py).
ALLOWED = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: 0 <= v <= 2**31 - 1 and float(v).is_integer(),
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: 0 < v <= 10,
}
GENERATION_FILE = "generation_config.json"


def read_generation_config(folder: Path) -> dict[str, float]:
    """The sampling fields (:data:`mlxd.config.sampling.MODEL_FIELDS`) a model folder's ``generation_config.json``
    sets.

    A missing or unreadable file gives ``{}``; a value of the wrong type or out of range is left out with a
    warning naming the file and the key (the model's file is not ours to refuse). ``repetition_penalty`` 1 (no
    penalty) is left out too.
    """
    path = Path(folder) / GENERATION_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("generation_config_unreadable", path=str(path), error=str(e))
        return {}
    if not isinstance(data, dict):
        log.warning("generation_config_unreadable", path=str(path), error="not a JSON object")
        return {}
    found = {}
    for key in MODEL_FIELDS:
        value = data.get(key)
        if value is None or (key == "repetition_penalty" and value == 1):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not ALLOWED[key](value):
            log.warning("generation_config_value_ignored", path=str(path), key=key, value=value)
            continue
        found[key] = int(value) if key == "top_k" else float(value)
    return found


def model_sampling(source: str, folder: Path | None) -> dict[str, float]:
    """The model's own sampling defaults: its folder's ``generation_config.json`` (when ``folder`` is a folder; a
    ``.gguf`` file not yet converted has none to read), overlaid by the defaults shipped with an embedded model."""
    found = read_generation_config(folder) if folder is not None and Path(folder).is_dir() else {}
    return {**found, **embedded_generation(source)}


def with_model_sampling(config: Any, folder: Path | None) -> Any:
    """``config`` (a ``DaemonConfig``) with ``[model.sampling]`` resolved for the loaded model in ``folder``; the
    model's values that apply are logged once."""
    model = model_sampling(config.model.source, folder)
    sampling, origins = resolve_sampling(config.model.sampling, model)
    taken = {name: getattr(sampling, name) for name, origin in origins.items() if origin == "model"}
    if taken:
        log.info("model_sampling_defaults", **taken)
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, sampling=sampling))
