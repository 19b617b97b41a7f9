"""The device one process serves on (``[model] device``), and what each thread that makes MLX arrays does first.

What MLX 0.32 does (``mlx/device.cpp``, ``mlx/stream.cpp``, ``mlx/utils.h``, ``mlx/backend/cuda/device.cpp``,
``eval.cpp``, ``allocator.cpp``):

- **The default device is one for the whole process** (``set_default_device`` writes a static), and
  ``mx.stream(s)`` sets it too, restoring the one it found on exit.
- **Streams belong to threads.** Each thread has its own default stream per device; ``mx.new_stream`` registers its
  CUDA command encoder in the creating thread only ("There is no Stream(gpu, N) in current thread" elsewhere, N
  being the stream's number, not a GPU's). mlx-lm's ``generation_stream`` is a thread-local stream whose *device*
  is fixed when ``mlx_lm.generate`` is first imported: MLX's default device then, which in mlxd is before any
  config is read. A thread that serves another device must therefore use a stream of its own on that device.
- **The CUDA device is chosen per thread** (``cudaSetDevice``, cached per thread by ``Device::make_current``): an
  evaluation makes its stream's device current; reading an array on the host (``tolist``, ``item`` of a device
  buffer) copies with ``cudaMemcpy`` on whichever device the thread has current. Creating MLX's allocator makes
  every visible GPU current in turn (one free-stream each), leaving the last one current on that thread.

Measured on two H200s (MLX 0.32.4, mlx-lm 0.32.2; README, "Hosts with several GPUs"): with both GPUs
visible, one process failed in warm-up with ``cudaMemcpy ... invalid argument`` on ``gpu:0`` and with
``cudaMemcpyAsync ... invalid argument`` and an illegal memory access on ``gpu:1``, even with every thread set up
for its device. The likely cause, in ``allocator.cpp``: MLX keeps one buffer cache for all GPUs, and a cached buffer
of one GPU handed to another (or read on the host) is copied on the calling thread's current device. So on CUDA a process **narrows what it sees to the GPU it serves on** before CUDA
starts (:func:`narrow_process`: ``CUDA_VISIBLE_DEVICES`` set in the process itself, from ``[model] device``, before
MLX is imported, since importing MLX starts CUDA; the operator sets nothing):
the chosen GPU is then MLX's ``gpu:0``, and no buffer of another GPU exists. GPUs are counted without starting
CUDA (``CUDA_VISIBLE_DEVICES`` when set, else the driver's ``/proc/driver/nvidia/gpus``). Measured the same way:
set after ``import mlx.core`` the variable changed nothing (MLX still reported 2 GPUs); set first, ``gpu:1`` and
the default both served, with the same greedy text, each process's memory on its own GPU only.

:func:`use_device` then makes the device MLX's default, gives the calling thread its default stream there and
evaluates and reads back a small array on it; :func:`device_stream` is what a long-lived thread (the engine's)
serves inside.

A ``[distributed]`` rank takes its own GPU on its host: ``mlxd launch`` tells every rank its local rank
(:data:`LOCAL_RANKS_ENV`), and the rank serves on ``gpu:(local rank % GPUs it sees)``. (``mlx.launch --backend
nccl`` shows each local rank one GPU already; MLX's NCCL group makes ``rank % GPUs`` current when it starts.)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.errors import ConfigError
from mlxd.log import get_logger

log = get_logger("mlxd.runtime")

AUTO = "auto"
FIELD = "model.device"
# Set by `mlxd launch` for every rank alike: each rank's local rank on its host, in rank order ("0,1,0,1").
LOCAL_RANKS_ENV = "MLXD_LOCAL_RANKS"
# Set by narrow_process: the configured device this process narrowed its view to (its MLX gpu:0 from then on).
NARROWED_ENV = "MLXD_NARROWED_DEVICE"
VISIBLE = "CUDA_VISIBLE_DEVICES"
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver runs
DEVICE_PATTERN = r"^(auto|cpu|gpu)(:[0-9]+)?$"
_DEVICE = re.compile(DEVICE_PATTERN)
# Elements read back when a thread is set up: 1 KiB, above MLX's small-block pool, so the read is a device copy.
_PROBE_ELEMENTS = 256


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """A device as MLX numbers them: ``type`` "gpu" or "cpu", ``index`` among the ones this process sees."""

    type: str
    index: int = 0

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


_chosen: DeviceChoice | None = None


def mlx_core() -> Any:
    """``mlx.core``, imported when first needed (the HTTP layer never imports MLX); tests put a double in its
    place to report devices that this machine does not have."""
    import mlx.core

    return mlx.core


def mlx_imported() -> bool:
    """Whether MLX is imported in this process (which starts CUDA)."""
    return "mlx.core" in sys.modules


def reported_devices() -> dict[str, int]:
    """How many devices of each type this process may serve on: on CUDA the GPUs it sees, counted without starting
    CUDA where the driver tells (:func:`visible_gpus`); else what MLX reports (GPUs: 0 with MLX's CPU backend)."""
    mx = mlx_core()
    visible = visible_gpus() if mx.cuda.is_available() else None
    num_gpus = len(visible) if visible is not None else mx.device_count(mx.gpu)
    return {"gpu": num_gpus, "cpu": max(1, mx.device_count(mx.cpu))}


def visible_gpus(environ: Mapping[str, str] | None = None, driver: Path | None = None) -> list[str] | None:
    """The NVIDIA GPUs CUDA will show this process, as ``CUDA_VISIBLE_DEVICES`` entries, found without starting
    CUDA: that variable's entries when it is set (up to the first that CUDA would stop at), else one per GPU the
    driver lists. None when neither tells (no NVIDIA driver here)."""
    value = (os.environ if environ is None else environ).get(VISIBLE)
    if value is not None:
        entries = []
        for entry in (e.strip() for e in value.split(",")):
            if not entry or entry.startswith("-"):
                break
            entries.append(entry)
        return entries
    try:
        return [str(i) for i in range(sum(1 for _ in (driver or NVIDIA_GPUS).iterdir()))]
    except OSError:
        return None


def narrow_to(choice: DeviceChoice, environ: MutableMapping[str, str] | None = None,
              driver: Path | None = None) -> DeviceChoice:
    """Before CUDA starts (see :func:`narrow_process`): let this process see only the GPU ``choice`` names (``CUDA_VISIBLE_DEVICES`` in its own
    environment, the operator's entry for it when they set the variable). Returns the device as MLX then numbers
    it (``gpu:0``); ``choice`` itself when there is nothing to narrow (a CPU, one GPU seen, GPUs not countable)."""
    visible = visible_gpus(environ, driver) if choice.type == "gpu" else None
    if visible is None or len(visible) <= 1 or choice.index >= len(visible):
        return choice
    (os.environ if environ is None else environ)[VISIBLE] = visible[choice.index]
    log.info("device_visibility", device=str(choice), cuda_visible_devices=visible[choice.index],
             reason="MLX's CUDA allocator shares cached buffers between the GPUs of one process")
    return DeviceChoice("gpu", 0)


def choose_device(setting: str, devices: Mapping[str, int], *, local_rank: int | None = None,
                  where: str = FIELD) -> DeviceChoice:
    """The device ``setting`` names, checked against ``devices`` (:func:`reported_devices`).

    ``auto``: the first GPU, or in a ``[distributed]`` job (``local_rank`` given) the rank's own GPU,
    ``gpu:(local_rank % GPUs)``; the CPU when MLX reports no GPU. ``gpu`` is ``gpu:0``. A device MLX does not
    report is a ``ConfigError`` that names ``where`` (the file and the field) and the devices there are."""
    match = _DEVICE.match(setting)
    if match is None:
        raise ConfigError(f"{where}: {setting!r} is not a device; use \"auto\", \"gpu:N\", \"gpu\" or \"cpu\"")
    kind, suffix = match.group(1), match.group(2)
    num_gpus = devices.get("gpu", 0)
    if kind == AUTO:
        if suffix:
            raise ConfigError(f"{where}: {setting!r}: \"auto\" takes no index; use \"auto\" or \"gpu:N\"")
        return DeviceChoice("gpu", (local_rank or 0) % num_gpus) if num_gpus else DeviceChoice("cpu", 0)
    index = int(suffix[1:]) if suffix else 0
    count = devices.get(kind, 0)
    if index >= count:
        there = f"{kind}:0 to {kind}:{count - 1}" if count > 1 else (f"{kind}:0 only" if count else f"no {kind}")
        raise ConfigError(f"{where}: {setting!r} is not a device here: MLX reports {count} {kind} device(s) "
                          f"({there}){_visible_note()}")
    return DeviceChoice(kind, index)


def _visible_note() -> str:
    visible = os.environ.get(VISIBLE)
    return f"; {VISIBLE}={visible} limits what this process sees" if visible is not None else ""


def local_rank(rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """This rank's local rank on its host: its entry in :data:`LOCAL_RANKS_ENV` (set by ``mlxd launch``), else
    ``rank`` (ranks started by hand, one host)."""
    entries = environ.get(LOCAL_RANKS_ENV, "").split(",")
    if rank < len(entries) and entries[rank].strip().isdigit():
        return int(entries[rank])
    return rank


def select_device(setting: str, *, group: Any = None, where: str = FIELD,
                  devices: Mapping[str, int] | None = None) -> DeviceChoice:
    """:func:`choose_device` for this process: MLX's devices, and in a distributed ``group`` this rank's local
    rank. After :func:`narrow_process` the one GPU this process sees, ``gpu:0``, is the configured one."""
    if os.environ.get(NARROWED_ENV):
        return DeviceChoice("gpu", 0)
    rank = local_rank(group.rank()) if group is not None else None
    return choose_device(setting, devices if devices is not None else reported_devices(), local_rank=rank,
                         where=where)


def narrow_process(config_path: os.PathLike | str) -> DeviceChoice | None:
    """First thing in a serving process, before MLX is imported (importing it starts CUDA): when CUDA shows it
    several GPUs, let it see only the one its config's ``[model] device`` names (a ``[distributed]`` rank: its
    local rank's, ``MLX_RANK`` being set by ``mlx.launch``). A device it does not see is a ``ConfigError`` naming
    the file and field. Returns the configured device, None when there was nothing to narrow."""
    from mlxd.config import load_config

    config = load_config(Path(config_path))
    visible = visible_gpus()
    if visible is None or len(visible) <= 1:
        return None
    rank = os.environ.get("MLX_RANK") if config.distributed is not None else None
    choice = choose_device(config.model.device, {"gpu": len(visible), "cpu": 1},
                           local_rank=local_rank(int(rank)) if rank and rank.isdigit() else None,
                           where=f"{config_path}: {FIELD}")
    if choice.type != "gpu":
        return None
    if mlx_imported():  # CUDA may have started with every GPU: narrowing now would mislead
        log.warning("device_visibility_late", device=str(choice), reason="MLX was imported before the device "
                    "was chosen; every GPU stays visible and the device is chosen by index")
        return None
    narrow_to(choice)
    os.environ[NARROWED_ENV] = str(choice)
    return choice


def use_device(choice: DeviceChoice) -> None:
    """Serve on ``choice`` from now on: MLX's default device (one for the process) becomes it, and the calling
    thread is set up for it (:func:`enter_thread`). Call it on the thread that loads the model, before the weights
    are made; later threads serve inside :func:`device_stream`."""
    global _chosen
    _chosen = choice
    enter_thread(choice)
    log.info("device", device=os.environ.get(NARROWED_ENV) or str(choice), mlx_device=str(choice),
             cuda_visible_devices=os.environ.get(VISIBLE), devices=reported_devices())


def chosen_device() -> DeviceChoice | None:
    """The device :func:`use_device` chose, None before it ran."""
    return _chosen


def enter_thread(choice: DeviceChoice | None = None) -> Any:
    """Set the calling thread up for ``choice`` (the chosen device by default, else MLX's default): the device is
    MLX's default, the thread's default stream is on it, and a small array made, evaluated and read back there
    makes it the thread's current CUDA device. Returns the thread's default stream on the device."""
    mx = mlx_core()
    choice = choice or _chosen
    device = to_mlx(choice) if choice is not None else mx.default_device()
    mx.set_default_device(device)
    stream = mx.default_stream(device)
    mx.set_default_stream(stream)
    probe = mx.arange(_PROBE_ELEMENTS, dtype=mx.int32, stream=stream)
    mx.eval(probe)
    if sum(probe.tolist()) != _PROBE_ELEMENTS * (_PROBE_ELEMENTS - 1) // 2:
        raise RuntimeError(f"MLX read back a wrong value from {device} on this thread")
    return stream


@contextmanager
def device_stream(choice: DeviceChoice | None = None) -> Iterator[Any]:
    """Run a long-lived thread's MLX work (the engine's, a follower's loop) on the chosen device: the thread is
    set up (:func:`enter_thread`) and a stream of its own on that device is the default inside; everything still
    running on it is waited for on the way out. Use it instead of mlx-lm's ``generation_stream``, whose device is
    fixed when mlx-lm is first imported."""
    mx = mlx_core()
    enter_thread(choice)
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        yield stream
    mx.synchronize(stream)


def to_mlx(choice: DeviceChoice) -> Any:
    """``choice`` as an ``mx.Device``."""
    mx = mlx_core()
    return mx.Device(mx.gpu if choice.type == "gpu" else mx.cpu, choice.index)


def check_device(setting: str, config_path: os.PathLike | str) -> DeviceChoice:
    """At start-up, before the port is bound: the configured device exists here (imports MLX). Errors name the
    config file and the field."""
    return choose_device(setting, reported_devices(), where=f"{config_path}: {FIELD}")
