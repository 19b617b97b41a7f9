"""OpenBLAS for MLX's CPU backend on Linux.

The ``mlx-cpu`` wheel links a bundled reference BLAS; float32 matmuls run 25-45x faster with OpenBLAS. The wheel's
BLAS symbols are resolved when the process starts, so the only way to swap the library is ``LD_PRELOAD`` at exec
time: ``maybe_reexec_with_openblas`` re-executes mlxd once with OpenBLAS preloaded (``python -P -m mlxd``: the
working directory is not searched for modules, see :func:`reexec_command`).

Where OpenBLAS comes from, in this order:

1. ``MLXD_OPENBLAS``: ``0`` disables all of this, a path chooses the library, ``pip`` or ``system`` limits the
   search to one of the two places below.
2. The ``cmeel-openblas`` wheel, a dependency of mlxd on Linux x86-64 (``cmeel.prefix/lib/libopenblas.so.0`` in
   site-packages). It comes first because it is the one this environment asked for: its version is the one
   mlxd declares and benchmarks, it is the same on every machine, and it is there without root; a Python
   environment's own packages win over the system's, as for any import.
3. The distribution's (Debian/Ubuntu/Fedora paths, then ``ldconfig -p``): where the wheel is not installed
   (other architectures, ``pip install --no-deps``) or when ``MLXD_OPENBLAS=system`` says so.

The wheel's library needs ``libgfortran.so.5``, which a fresh machine does not have. The ``mlx-cpu`` wheel ships
one under a hashed name (``mlx_cpu.libs/libgfortran-<hash>.so.5...``), and the loader matches a needed library by
file name or soname only, so preloading that copy is not enough: a folder in the cache holds a
``libgfortran.so.5`` link to it and goes first in ``LD_LIBRARY_PATH``, and the copy itself is preloaded by its real
path (its ``$ORIGIN`` run path finds its own ``libquadmath``). Each candidate is first tried on a throwaway
``python -S`` so that a library that does not load never takes the daemon down with it.

The re-executed process also gets ``OPENBLAS_THREAD_TIMEOUT=4`` unless the environment sets it: after each call
OpenBLAS's worker threads spin for 2^28 cycles by default before they sleep, and a decode step calls it every few
milliseconds, so on a 2-core machine one worker spun through 60-85% of a core (system time in ``sched_yield``)
beside the engine thread. 2^4 cycles lets it sleep at once: 8 streams of the tiny benchmark model ran 1.08-1.36x
faster, 1 and 16 streams the same (``docs/benchmarks/engine.md``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from mlxd.errors import ConfigError
from mlxd.runtime.paths import default_cache_dir

ENV_SETTING = "MLXD_OPENBLAS"
# Set in the re-executed process, so that it never re-executes again whatever else goes wrong.
ENV_REEXECED = "MLXD_OPENBLAS_REEXECED"
THREAD_TIMEOUT = "OPENBLAS_THREAD_TIMEOUT"
LIBRARY = "libopenblas.so.0"
PIP_DISTRIBUTION = "cmeel-openblas"
GFORTRAN = "libgfortran.so.5"
FIX = "pip install cmeel-openblas (Linux x86-64) or apt-get install libopenblas0-pthread"

_DISABLED = {"0", "false", "no", "off"}
_AUTO = {"", "1", "true", "yes", "on", "auto"}
_ONLY = {"pip", "system"}
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


def system_openblas() -> Path | None:
    """The distribution's OpenBLAS (its usual paths for this machine, then ``ldconfig -p``), or ``None``."""
    machine = platform.machine()
    found = next((path for path in _candidates(machine) if path.is_file()), None)
    return found or _from_ldconfig(machine)


def pip_openblas() -> Path | None:
    """``libopenblas.so.0`` of the installed ``cmeel-openblas`` wheel, or ``None`` when it is not installed."""
    try:
        files = metadata.distribution(PIP_DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return None
    paths = (Path(str(file.locate())) for file in files if file.name == LIBRARY)
    return next((path for path in paths if path.is_file()), None)


def openblas_candidates() -> list[Path]:
    """The OpenBLAS libraries to try, best first (see the module docstring); empty when disabled or none found.

    ``MLXD_OPENBLAS=/path`` forces that file (a ``ConfigError`` if it does not exist).
    """
    setting = os.environ.get(ENV_SETTING, "").strip()
    choice = setting.lower()
    if choice in _DISABLED:
        return []
    if choice not in _AUTO | _ONLY:
        forced = Path(setting)
        if not forced.is_file():
            raise ConfigError(
                f"{ENV_SETTING}={setting!r}: no such file; set it to the path of {LIBRARY}, to pip or system to "
                f"search only there, to 0 to run without OpenBLAS, or leave it unset to search both",
                param=ENV_SETTING,
            )
        return [forced]
    found = [pip_openblas() if choice != "system" else None, system_openblas() if choice != "pip" else None]
    return [path for path in found if path is not None]


def find_openblas() -> Path | None:
    """The OpenBLAS library that would be preloaded first, or ``None`` when it is disabled or not installed."""
    return next(iter(openblas_candidates()), None)


def bundled_gfortran() -> Path | None:
    """The ``libgfortran.so.5`` copy inside the ``mlx-cpu`` wheel (a hashed file name), or ``None``."""
    try:
        folder = Path(str(metadata.distribution("mlx-cpu").locate_file("mlx_cpu.libs")))
    except metadata.PackageNotFoundError:
        return None
    return next(iter(sorted(folder.glob("libgfortran*.so.5*"))), None)


def _gfortran_link_folder(gfortran: Path) -> Path:
    """A cache folder whose ``libgfortran.so.5`` links to ``gfortran``; one per target, so venvs can share a cache."""
    folder = default_cache_dir() / "libs" / hashlib.sha256(str(gfortran).encode()).hexdigest()[:16]
    link = folder / GFORTRAN
    if link.is_symlink() and os.readlink(link) == str(gfortran):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f".{GFORTRAN}.{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(gfortran)
    os.replace(staged, link)
    return folder


def _prepend(value: str, existing: str | None) -> str:
    return f"{value}:{existing}" if existing else value


def preload_environment(lib: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` changed so that a process started with it has ``lib`` preloaded (and whatever it needs).

    For the pip wheel's library (one inside a ``cmeel.prefix``), the ``mlx-cpu`` wheel's gfortran is preloaded too
    and a link folder for it goes first in ``LD_LIBRARY_PATH``. Raises ``OSError`` when that folder cannot be made.
    """
    env = dict(environ)
    preload = [str(lib)]
    gfortran = bundled_gfortran() if lib.parent.parent.name == "cmeel.prefix" else None
    if gfortran is not None:
        env["LD_LIBRARY_PATH"] = _prepend(str(_gfortran_link_folder(gfortran)), environ.get("LD_LIBRARY_PATH"))
        preload.insert(0, str(gfortran))
    env["LD_PRELOAD"] = _prepend(":".join(preload), environ.get("LD_PRELOAD"))
    env.setdefault(THREAD_TIMEOUT, "4")  # its workers sleep right after a call instead of spinning (module doc)
    return env


def _load_problem(env: Mapping[str, str]) -> str | None:
    """Why a process started with ``env`` fails to load its preloads, or ``None`` when it loads them."""
    try:
        result = subprocess.run([sys.executable, "-S", "-c", ""], env=env, capture_output=True, text=True,
                                timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if result.returncode != 0 or "LD_PRELOAD" in result.stderr:
        return result.stderr.strip() or f"exit status {result.returncode}"
    return None


def _preloaded(preload: str, lib: Path) -> bool:
    """Whether ``LD_PRELOAD`` (entries separated by spaces or colons) already names ``lib`` or any OpenBLAS."""
    entries = [entry for entry in re.split(r"[\s:]+", preload) if entry]
    return any(entry == str(lib) or Path(entry).name.startswith("libopenblas") for entry in entries)


def _loadable_environment() -> dict[str, str] | None:
    """The environment preloading the first candidate that loads; ``None`` when none does or one is preloaded."""
    candidates = openblas_candidates()
    if any(_preloaded(os.environ.get("LD_PRELOAD", ""), lib) for lib in candidates):
        return None
    for lib in candidates:
        try:
            env = preload_environment(lib, os.environ)
        except OSError as e:
            log.warning("cannot preload %s: %s", lib, e)
            continue
        problem = _load_problem(env)
        if problem is None:
            return env
        log.warning("cannot preload %s: %s", lib, problem)
    return None


def reexec_command(module: str, argv: list[str], env: dict[str, str]) -> list[str]:
    """``python -P -m <module> *argv``: ``-P`` keeps the working directory off ``sys.path``, so that a file there
    named like a dependency (``msgspec.py``, ``litestar.py``) is not imported in its place, as ``python -m`` alone
    would; ``PYTHONPATH`` and the environment's packages stay as they are (``-I`` would drop ``PYTHONPATH``, which
    third-party stages may be found through). Run from the root of an mlxd checkout, that folder is added to
    ``env``'s ``PYTHONPATH``, so that a checkout that is not installed runs as it did."""
    root = Path(__file__).resolve().parents[2]
    if root == Path.cwd().resolve():
        env["PYTHONPATH"] = _prepend(str(root), env.get("PYTHONPATH"))
    return [sys.executable, "-P", "-m", module, *argv]


def maybe_reexec_with_openblas(argv: list[str], *, module: str = "mlxd") -> None:
    """Re-execute ``python -P -m <module> *argv`` (:func:`reexec_command`) with OpenBLAS in ``LD_PRELOAD``, or
    return doing nothing.

    Does nothing off Linux, when ``MLXD_OPENBLAS=0``, when no OpenBLAS is found or none loads (each is tried in
    a throwaway process first), when one is already preloaded, and in a process that is itself the re-execution
    (``MLXD_OPENBLAS_REEXECED``), so it can never loop. On success it does not return: the process image is
    replaced, keeping its pid, stdio and the rest of the environment.

    Call it first thing in the command-line entry point, before mlx is imported and before any thread, socket or
    file is opened: everything the process did before is thrown away (importing mlx first only wastes a second;
    the re-executed process loads it afresh). Raises ``ConfigError`` when ``MLXD_OPENBLAS`` names a missing file.
    """
    if sys.platform != "linux" or os.environ.get(ENV_REEXECED):
        return
    env = _loadable_environment()
    if env is None:
        return
    env[ENV_REEXECED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, reexec_command(module, argv, env), env)
    except OSError as e:  # exec failed; the process is intact, so carry on with the bundled BLAS
        log.warning("could not re-execute %s with OpenBLAS preloaded (%s); running with mlx's bundled BLAS", module, e)


def mapped_blas() -> list[str]:
    """Paths of the BLAS/LAPACK shared libraries mapped into this process, in the order of ``/proc/self/maps``.

    With OpenBLAS preloaded both it and the wheel's bundled libraries are listed (the preloaded one wins symbol
    resolution); the pip wheel's shows as ``.../site-packages/cmeel.prefix/lib/libopenblas.so.0``. Empty where
    there is no ``/proc`` (macOS) and before mlx is imported.
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


def reference_blas_warning(dtype: str, device: str, mapped: list[str]) -> str | None:
    """The warning to log when float32 matmuls run on the ``mlx-cpu`` wheel's reference BLAS, else ``None``.

    ``dtype`` is the loaded model's, ``device`` MLX's default device (``str(mx.default_device())``), ``mapped``
    what ``mapped_blas()`` returned. Only Linux CPU float32 is concerned: quantized and half-precision weights do
    not go through BLAS, and Metal and CUDA have their own.
    """
    if sys.platform != "linux" or "cpu" not in device or "float32" not in dtype:
        return None
    if any(Path(path).name.startswith("libopenblas") for path in mapped):
        return None
    disabled = os.environ.get(ENV_SETTING, "").strip().lower() in _DISABLED
    cause = f"{ENV_SETTING}=0 disables OpenBLAS" if disabled else "no loadable OpenBLAS was found"
    return (f"float32 matmuls run on the reference BLAS bundled with mlx-cpu, 25-45x slower than OpenBLAS "
            f"({cause}); fix: {FIX}" + (f", and unset {ENV_SETTING}" if disabled else ""))
