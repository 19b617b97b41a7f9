"""The temporary folders of GGUF conversions (:func:`mlxd.models.gguf.ensure_converted`): how they are named, and
removing those that conversions which never finished left behind."""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from pathlib import Path

from mlxd.log import get_logger

log = get_logger("mlxd.models")

# A conversion's temporary folder: ".<target>.tmp-<host>-<pid>-<random>"; an older converter's had no host or pid
# (".<target>.<random>", tempfile's eight characters). Either is removed once clearly abandoned.
_HOST = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:64]
_TEMP = re.compile(r"\.(?P<target>.+-[0-9a-f]{16}-c\d+)\.tmp-(?P<host>\w+)-(?P<pid>\d+)-\w+")
_LEGACY_TEMP = re.compile(r"\.(?P<target>.+-[0-9a-f]{16}-c\d+)\.\w{8}")
STALE_TEMP_S = 24 * 3600


def temp_prefix(target_name: str) -> str:
    """The prefix of a conversion's temporary folder for ``target_name``, naming this machine and process."""
    return f".{target_name}.tmp-{_HOST}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _interrupted(folder: Path, now: float) -> bool:
    if not folder.is_dir() or folder.is_symlink():
        return False
    if (match := _TEMP.fullmatch(folder.name)) is not None and match["host"] == _HOST:
        return not _alive(int(match["pid"]))
    if match is None and _LEGACY_TEMP.fullmatch(folder.name) is None:
        return False  # not a conversion's folder
    try:
        return now - folder.stat().st_mtime > STALE_TEMP_S
    except OSError:
        return False


def remove_interrupted_conversions(cache_dir: Path) -> list[Path]:
    """Remove the temporary folders that conversions which never finished (the process was killed) left in
    ``cache_dir``: those of a process of this machine that no longer runs, and any older than a day (another
    machine's, on a shared cache, or an older converter's, whose names carry no process id). Returns them."""
    now = time.time()
    removed = [folder for folder in sorted(Path(cache_dir).glob(".*")) if _interrupted(folder, now)]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
        log.info("removed_interrupted_conversion", folder=str(folder))
    return removed
