"""Which sampling default applies: the config's ``[model.sampling]``, else the model's own, else mlxd's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from mlxd.config.schema import SamplingDefaults

# mlxd's own, for what neither the config nor the model sets. repetition_penalty 0: off.
MLXD_SAMPLING = SamplingDefaults(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=0.0)
# The fields a model's generation_config.json may set (max_tokens is not one: a model's max_new_tokens is a cap).
MODEL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def resolve_sampling(configured: SamplingDefaults, model: Mapping[str, Any]) -> tuple[SamplingDefaults, dict[str, str]]:
    """Each of :data:`MODEL_FIELDS` set: the config's value, else the model's (``model``, by field name), else
    mlxd's (:data:`MLXD_SAMPLING`). Returns the resolved defaults and, per field, where its value came from:
    ``file``, ``model`` or ``default``.
    """
    values, origins = {}, {}
    for name in MODEL_FIELDS:
        if getattr(configured, name) is not None:
            values[name], origins[name] = getattr(configured, name), "file"
        elif name in model:
            values[name], origins[name] = model[name], "model"
        else:
            values[name], origins[name] = getattr(MLXD_SAMPLING, name), "default"
    return msgspec.structs.replace(configured, **values), origins
