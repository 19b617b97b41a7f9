"""OpenBLAS for MLX's CPU backend on Linux.

The ``mlx-cpu`` wheel links a bundled reference BLAS; float32 matmuls run 25-35x faster with OpenBLAS. The wheel's
BLAS symbols are resolved when the process starts, so the only way to swap the library is ``LD_PRELOAD`` at exec
time: ``maybe_reexec_with_openblas`` re-executes mlxd once with OpenBLAS preloaded.

Settings (environment): ``MLXD_OPENBLAS=0`` disables all of this, ``MLXD_OPENBLAS=/path/libopenblas.so.0``
chooses the library; unset, Debian/Ubuntu/Fedora paths are searched, then ``ldconfig -p``.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from mlxd.errors import ConfigError

ENV_SETTING = "MLXD_OPENBLAS"
# Set in the re-executed process, so that it never re-executes again whatever else goes wrong.
ENV_REEXECED = "MLXD_OPENBLAS_REEXECED"
LIBRARY = "libopenblas.so.0"

_DISABLED = {"0", "false", "no", "off"}
_AUTO = {"", "1", "true", "yes", "on", "auto"}
_BLAS_NAME = re.compile(r"blas|lapack|libmkl", re.IGNORECASE)
# ldconfig -p tags each entry with its ABI, e.g. "libopenblas.so.0 (libc6,x86-64) => /lib/x86_64-linux-gnu/...".
_LDCONFIG_ABI = {"x86_64": "x86-64", "aarch64": "AArch64"}

log = logging.getLogger(__name__)


def _candidates(machine: str) -> list[Path]:
    """Where distributions install OpenBLAS for ``machine`` (``platform.machine()``), most specific first."""
    triplet = f"{machine}-linux-gnu"
    dirs = [Path("/usr/lib") / triplet, Path("/lib") / triplet, Path("/usr/lib64"), Path("/usr/lib")]
    # Debian's libopenblas.so.0 is an alternatives link into one of the flavour folders; pthread is the default.
    flavours = ["", "openblas-pthread", "openblas-openmp", "openblas-serial"]
    return [folder / flavour / LIBRARY for folder in dirs for flavour in flavours]


def _from_ldconfig(machine: str) -> Path | None:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listing = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    abi = _LDCONFIG_ABI.get(machine, "")
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith(LIBRARY) and abi in name and Path(path).is_file():
            return Path(path)
    return None


def find_openblas() -> Path | None:
    """The OpenBLAS shared library to preload, or ``None`` when it is disabled or not installed.

    ``MLXD_OPENBLAS=0`` disables it; ``MLXD_OPENBLAS=/path`` forces that file (a ``ConfigError`` if it does not
    exist). Otherwise the distribution paths for this machine are tried, then ``ldconfig -p``.
    """
    setting = os.environ.get(ENV_SETTING, "").strip()
    if setting.lower() in _DISABLED:
        return None
    if setting.lower() not in _AUTO:
        forced = Path(setting)
        if not forced.is_file():
            raise ConfigError(
                f"{ENV_SETTING}={setting!r}: no such file; set it to the path of {LIBRARY}, "
                f"to 0 to run without OpenBLAS, or leave it unset to search the system",
                param=ENV_SETTING,
            )
        return forced
    machine = platform.machine()
    found = next((path for path in _candidates(machine) if path.is_file()), None)
    return found or _from_ldconfig(machine)


def _preloaded(preload: str, lib: Path) -> bool:
    """Whether ``LD_PRELOAD`` (entries separated by spaces or colons) already names ``lib`` or any OpenBLAS."""
    entries = [entry for entry in re.split(r"[\s:]+", preload) if entry]
    return any(entry == str(lib) or Path(entry).name.startswith("libopenblas") for entry in entries)


def maybe_reexec_with_openblas(argv: list[str], *, module: str = "mlxd") -> None:
    """Re-execute ``python -m <module> *argv`` with OpenBLAS in ``LD_PRELOAD``, or return doing nothing.

    Does nothing off Linux, when ``MLXD_OPENBLAS=0``, when OpenBLAS is not found, when it is already preloaded,
    and in a process that is itself the re-execution (``MLXD_OPENBLAS_REEXECED``), so it can never loop. On success
    it does not return: the process image is replaced, keeping its pid, stdio and the rest of the environment.

    Call it first thing in the command-line entry point, before mlx is imported and before any thread, socket or
    file is opened: everything the process did before is thrown away (importing mlx first only wastes a second;
    the re-executed process loads it afresh). Raises ``ConfigError`` when ``MLXD_OPENBLAS`` names a missing file.
    """
    if sys.platform != "linux" or os.environ.get(ENV_REEXECED):
        return
    lib = find_openblas()
    preload = os.environ.get("LD_PRELOAD", "")
    if lib is None or _preloaded(preload, lib):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    env[ENV_REEXECED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    except OSError as e:  # exec failed; the process is intact, so carry on with the bundled BLAS
        log.warning(
            "could not re-execute %s with %s preloaded (%s); running with mlx's bundled BLAS", module, lib, e
        )


def mapped_blas() -> list[str]:
    """Paths of the BLAS/LAPACK shared libraries mapped into this process, in the order of ``/proc/self/maps``.

    With OpenBLAS preloaded both it and the wheel's bundled libraries are listed (the preloaded one wins symbol
    resolution). Empty where there is no ``/proc`` (macOS) and before mlx is imported.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    seen: dict[str, None] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and _BLAS_NAME.search(Path(fields[5]).name):
            seen.setdefault(fields[5], None)
    return list(seen)
