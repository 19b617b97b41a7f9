"""Where mlxd keeps files between runs (importable before mlx, which the re-execution for OpenBLAS needs)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$MLXD_CACHE_DIR`` if set, else ``~/.cache/mlxd``."""
    return Path(os.environ.get("MLXD_CACHE_DIR") or Path.home() / ".cache" / "mlxd")
