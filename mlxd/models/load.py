"""Resolve a ``[model] source`` to an MLX model folder and load it with mlx-lm.

Sources: a local MLX folder, a ``.gguf`` file (converted once into the cache), or ``embedded:smollm2-135m``
(the default model shipped in a PyPI wheel). Hub ids fail with a clear message: mlxd never downloads models.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config.schema import ModelConfig
from mlxd.errors import ModelLoadError
from mlxd.log import get_logger
from mlxd.runtime.progress import phase

log = get_logger("mlxd.models")

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS = ("embedded:smollm2-135m",)


def cache_dir() -> Path:
    return Path(os.environ.get("MLXD_CACHE_DIR") or Path.home() / ".cache" / "mlxd")


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    kind: str
    context_length: int
    dtype: str
    # Vision models: mlx-vlm's processor (images → pixel inputs, placeholder tokens expanded in the prompt).
    processor: Any = None


def resolve_source(source: str, base_dir: Path | None = None) -> Path:
    """Return the MLX model folder for ``source``, converting GGUF files on first use."""
    if source.startswith(EMBEDDED_PREFIX):
        from mlxd.models.default_model import resolve_embedded

        return resolve_embedded(source, cache_dir())
    path = check_source(source, base_dir)
    if path.suffix.lower() == ".gguf":
        from mlxd.models.gguf import ensure_converted

        return ensure_converted(path, cache_dir() / "gguf")
    return path


def check_source(source: str, base_dir: Path | None = None) -> Path:
    """Check that ``source`` names something loadable here, converting and downloading nothing (no MLX import).

    Returns the local path (for ``embedded:`` sources, the source as a path). Raises ``ModelLoadError`` with the
    reason: a missing file or folder, a folder without ``config.json``, a hub id, an unknown embedded name.
    """
    if source.startswith(EMBEDDED_PREFIX):
        if source not in EMBEDDED_MODELS:
            raise ModelLoadError(f"unknown embedded model {source!r}; known: {', '.join(EMBEDDED_MODELS)}")
        return Path(source)
    path = Path(source).expanduser()
    if not path.is_absolute() and not path.exists() and base_dir is not None:
        path = base_dir / path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {source!r} not found")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an MLX model folder: it has no config.json")
        return path
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        raise ModelLoadError(
            f"model source {source!r} looks like a hub id, but mlxd does not download models: "
            "download the model folder yourself and give its local path as [model] source"
        )
    raise ModelLoadError(
        f"{source!r} not found: {path} does not exist. mlxd never downloads models: put an MLX model folder there "
        "first (one downloaded beforehand, e.g. `huggingface-cli download mlx-community/<model> --local-dir "
        f"{path}`, or made with `mlx_lm.convert` / `mlx_vlm.convert`), or give a .gguf file or "
        f"{EMBEDDED_MODELS[0]}"
    )


def detect_kind(folder: Path, requested: str) -> str:
    """``vision`` for a checkpoint with a ``vision_config`` (unless ``text`` is asked for: then its language model
    is served alone), else ``text``."""
    config = json.loads((folder / "config.json").read_text())
    kind = "vision" if "vision_config" in config else "text"
    if requested == "vision" and kind == "text":
        raise ModelLoadError(f"{folder} is a text model (its config.json has no vision_config) but [model] kind = "
                             "'vision'")
    return "text" if requested == "text" else kind


def choose_dtype(requested: str) -> str | None:
    """``auto``: float32 on Linux CPU (OpenBLAS makes float32 matmuls fast; bf16/quantized gain nothing)."""
    if requested != "auto":
        return None if requested == "native" else requested
    import mlx.core as mx

    on_linux_cpu = sys.platform == "linux" and mx.default_device() == mx.cpu
    return "float32" if on_linux_cpu else None


def load(config: ModelConfig, base_dir: Path | None = None, group: Any = None) -> LoadedModel:
    """Load the configured model and tokenizer. Raises ``ModelLoadError`` with a readable reason.

    ``group``: an ``mlx.core.distributed`` group to shard the model over, tensor-parallel (text models whose
    mlx-lm class has ``shard``): each rank materializes its shard only.
    """
    folder = resolve_source(config.source, base_dir)
    with phase("loading", folder=str(folder)):
        return _load_folder(config, folder, base_dir, group)


def _load_folder(config: ModelConfig, folder: Path, base_dir: Path | None, group: Any) -> LoadedModel:
    """:func:`load`'s work once the source is an MLX folder: the weights made and evaluated (or, sharded, lazily
    read), dtype and kernels chosen, the chat template read."""
    kind = _served_kind(folder, config, group)
    model, tokenizer, processor, model_config = _make_model(folder, kind, config, group)
    dtype = choose_dtype(config.dtype)
    model = _cast(model, dtype)
    if kind == "vision" and group is None:
        _attach_text_twin(model, folder, dtype)
    _swap_layers(model, kind, config, dtype, group)
    _evaluate_buffers(model)
    if config.chat_template:
        tokenizer.chat_template = _read_template(config.chat_template, base_dir)
    context = choose_context_length(config.context_length, _context_length(model_config))
    return LoadedModel(model, tokenizer, folder, kind, context, dtype or _native_dtype(model), processor)


def _served_kind(folder: Path, config: ModelConfig, group: Any) -> str:
    """The folder's kind as served (``text`` or ``vision``); ``[distributed]`` serves text models only."""
    kind = detect_kind(folder, config.kind)
    if group is not None and kind == "vision":
        raise ModelLoadError(f"{folder} is a vision model, and [distributed] serves text models only (serve it with "
                             "[model] kind = \"text\", or without [distributed])")
    return kind


def _make_model(folder: Path, kind: str, config: ModelConfig, group: Any) -> tuple[Any, Any, Any, dict]:
    """The model, its tokenizer, its processor (None for text) and its config.json, made by this thread on the
    served device (sharded loads read their weights lazily)."""
    from mlxd.runtime.cuda import prepare_cuda
    from mlxd.runtime.device import select_device, use_device

    prepare_cuda(kind)
    use_device(select_device(config.device, group=group))  # this thread makes the weights: on the served device
    if kind == "vision":
        from mlxd.models.vision_load import load_vision

        return load_vision(folder)
    model, tokenizer, model_config = _load_text(folder, lazy=group is not None)
    return model, tokenizer, None, model_config


def _cast(model: Any, dtype: str | None) -> Any:
    """The model in ``dtype`` (quantized weights dequantized first); unchanged when ``dtype`` is None."""
    if dtype is None:
        return model
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))
    return model


def _attach_text_twin(model: Any, folder: Path, dtype: str | None) -> None:
    """A vision model's token-only passes through mlx-lm's text model on the same weights, where the family has
    one (:mod:`mlxd.models.text_twin`)."""
    from mlxd.models.text_twin import language_twin

    twin = language_twin(folder, model.language_model, dequantize=dtype is not None)
    if twin is not None:
        model.attach_text_twin(twin)


def _swap_layers(model: Any, kind: str, config: ModelConfig, dtype: str | None, group: Any) -> None:
    """mlxd's layers where they serve better (a vision tower's attention; the CPU's blocked prompt attention, or
    the group's shards; the small-batch kernel on CUDA), the weights evaluated once cast or sharded."""
    import mlx.core as mx

    if kind == "vision":
        _use_tower_attention(model)
    if group is not None:
        shard(model, group)
    elif mx.default_device() == mx.cpu:
        _use_cpu_text_attention(model.text_twin if kind == "vision" else model)
    if dtype is not None or group is not None:
        mx.eval(model.parameters())
    if config.small_batch_kernel and mx.cuda.is_available():
        _use_small_batch_kernel(model)


def _evaluate_buffers(model: Any) -> None:
    """Evaluate, on this thread, the arrays modules keep beside their weights: scaled RoPE variants (Llama 3's,
    YaRN, LongRoPE) build frequency tables in ``__init__`` as private arrays, which ``parameters()`` leaves out.
    MLX makes them lazily on this thread's stream, and the engine thread that would evaluate them first has no such
    stream (\"There is no Stream(cpu, 0) in current thread\"): such models could not start."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    everything = model.filter_and_map(lambda _module, _key, value: isinstance(value, dict | list | mx.array))
    mx.eval([array for _, array in tree_flatten(everything) if isinstance(array, mx.array)])


def _load_text(folder: Path, lazy: bool = False) -> tuple[Any, Any, dict]:
    """mlx-lm's model for the folder; for a vision checkpoint, mlx-lm's text model of that family, which keeps the
    language weights only (the vision tower is never loaded). ``lazy``: weights are read when first evaluated."""
    from mlx_lm.utils import load as mlx_lm_load

    try:
        return mlx_lm_load(str(folder), lazy=lazy, return_config=True)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelLoadError(f"mlx-lm could not load {folder}: {e}") from e


def _use_small_batch_kernel(model: Any) -> None:
    """Swap the model's linear layers (a vision model's text twin included: it is a child module, ``_text``)."""
    from mlxd.runtime.small_batch_linear import use_small_batch_kernel

    log.info("small_batch_kernel", layers=use_small_batch_kernel(model))


def _use_tower_attention(model: Any) -> None:
    """Qwen-VL vision towers: one attention call a layer, not one per window (:mod:`mlxd.models.tower_attention`),
    on the CPU computed by numpy in cache-sized blocks (:mod:`mlxd.models.cpu_attention`); on the CPU, SigLIP-style
    towers' attention too (:mod:`mlxd.models.vision_attention`)."""
    import mlx.core as mx

    from mlxd.models.tower_attention import use_segment_attention

    swapped = use_segment_attention(model.vlm, model.family)
    if swapped:
        log.info("segment_attention", layers=swapped)
    if mx.default_device() == mx.cpu:
        from mlxd.models.vision_attention import use_cpu_vision_attention

        swapped = use_cpu_vision_attention(model.vlm)
        if swapped:
            log.info("cpu_vision_attention", layers=swapped)


def _use_cpu_text_attention(model: Any) -> None:
    """On the CPU, text models' prompt passes attend through numpy in blocks (:mod:`mlxd.models.text_attention`):
    a text model's, a vision model's text twin's (``None`` when it has none)."""
    from mlxd.models.text_attention import use_cpu_text_attention

    if model is None:
        return
    swapped = use_cpu_text_attention(model)
    if swapped:
        log.info("cpu_text_attention", layers=swapped)


def shard(model: Any, group: Any) -> None:
    """Tensor parallelism through mlx-lm's own ``Model.shard``: attention heads and MLP columns split over the
    group's ranks, their outputs summed across it in each layer."""
    if not hasattr(model, "shard"):
        raise ModelLoadError(f"mlx-lm has no tensor-parallel sharding for {type(model).__module__} (no "
                             "Model.shard): it cannot be served with [distributed]")
    try:
        model.shard(group)
    except (ValueError, AssertionError) as e:
        raise ModelLoadError(f"the model cannot be split over {group.size()} ranks: {e}") from e


def choose_context_length(configured: int, trained: int) -> int:
    """``[model] context_length`` when set (non-zero), else the model's trained length. A setting above the trained
    length is honoured but logged as a warning naming both, since quality past it depends on the model."""
    if not configured:
        return trained
    if configured > trained:
        log.warning("context_length_above_trained", context_length=configured, trained_context_length=trained)
    return configured


def _context_length(model_config: dict) -> int:
    """``max_position_embeddings`` of the config, or of its ``text_config`` (vision checkpoints keep it there)."""
    for table in (model_config, model_config.get("text_config") or {}):
        value = table.get("max_position_embeddings")
        if value:
            return int(value)
    return 4096


def _read_template(value: str, base_dir: Path | None) -> str:
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    try:
        return path.read_text()
    except OSError as e:
        raise ModelLoadError(f"chat_template file {value!r} cannot be read: {e}") from e


def _native_dtype(model: Any) -> str:
    from mlx.utils import tree_flatten

    dtypes = {str(v.dtype) for _, v in tree_flatten(model.parameters())}
    return ",".join(sorted(dtypes))


def platform_summary() -> dict[str, str]:
    import mlx.core as mx

    return {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__}
