"""Device selection (``[model] device``, :mod:`mlxd.runtime.device`) and ``mlxd launch``'s rank → device mapping.

Several GPUs are reported by a double of the part of ``mlx.core`` that device selection uses, which keeps MLX's
rules as its sources state them: the default device is one for the process (``mx.stream`` sets it), streams
belong to the thread that made them, and reading an array on the host copies on the thread's current CUDA device
(the device of the last evaluation on that thread), which must be the array's.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mlxd.config import load_config
from mlxd.errors import ConfigError
from mlxd.launch import local_ranks
from mlxd.runtime import device as dev
from mlxd.runtime.device import DeviceChoice, choose_device, local_rank


@dataclass(frozen=True)
class FakeDevice:
    type: str
    index: int = 0


@dataclass(frozen=True)
class FakeStream:
    index: int
    device: FakeDevice
    thread: int


@dataclass
class FakeArray:
    values: list[int]
    stream: FakeStream

    def tolist(self) -> list[int]:
        current = FAKE_THREADS.current.get(threading.get_ident())
        if self.stream.device.type == "gpu" and current != self.stream.device:
            raise RuntimeError("cudaMemcpy(data, buf.data, buf.size, kind) failed: invalid argument")
        return list(self.values)


class FakeThreads:
    current: dict[int, FakeDevice] = {}


FAKE_THREADS = FakeThreads()


@dataclass
class FakeMLX:
    """The device and stream calls of ``mlx.core`` on a host with ``num_gpus`` GPUs."""

    num_gpus: int
    gpu: str = "gpu"
    cpu: str = "cpu"
    int32: str = "int32"
    made: list[tuple[str, FakeDevice]] = field(default_factory=list)
    _default: FakeDevice = FakeDevice("gpu", 0)
    _streams: list[FakeStream] = field(default_factory=list)
    _thread_defaults: dict[tuple[int, FakeDevice], FakeStream] = field(default_factory=dict)

    def Device(self, kind: str, index: int = 0) -> FakeDevice:  # noqa: N802 - mlx.core's name
        return FakeDevice(kind, index)

    @property
    def cuda(self) -> FakeMLX:
        return self

    def is_available(self) -> bool:  # mx.cuda.is_available
        return self.num_gpus > 0

    def device_count(self, kind: str) -> int:
        """Like CUDA: the GPUs that CUDA_VISIBLE_DEVICES leaves (read when asked: CUDA starts later here)."""
        if kind != "gpu":
            return 1
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return self.num_gpus if visible is None else min(self.num_gpus, len(visible.split(",")))

    def default_device(self) -> FakeDevice:
        return self._default

    def set_default_device(self, device: FakeDevice) -> None:
        self._check(device)
        self._default = device

    def new_stream(self, device: FakeDevice) -> FakeStream:
        self._check(device)
        stream = FakeStream(len(self._streams), device, threading.get_ident())
        self._streams.append(stream)
        return stream

    def default_stream(self, device: FakeDevice) -> FakeStream:
        key = (threading.get_ident(), device)
        if key not in self._thread_defaults:
            self._thread_defaults[key] = self.new_stream(device)
        return self._thread_defaults[key]

    def set_default_stream(self, stream: FakeStream) -> None:
        self._own(stream)
        self._thread_defaults[(threading.get_ident(), stream.device)] = stream

    @contextmanager
    def stream(self, stream: FakeStream):
        before = self.default_stream(self._default)
        self.set_default_device(stream.device)
        self.set_default_stream(stream)
        try:
            yield
        finally:
            self.set_default_device(before.device)
            self.set_default_stream(before)

    def arange(self, n: int, dtype: str = "int32", stream: FakeStream | None = None) -> FakeArray:
        stream = stream or self.default_stream(self._default)
        self._own(stream)
        self.made.append((threading.current_thread().name, stream.device))
        return FakeArray(list(range(n)), stream)

    def eval(self, *arrays: FakeArray) -> None:
        for array in arrays:
            self._own(array.stream)
            FAKE_THREADS.current[threading.get_ident()] = array.stream.device  # Device::make_current

    def synchronize(self, stream: FakeStream) -> None:
        self._own(stream)

    def _check(self, device: FakeDevice) -> None:
        if device.index >= self.device_count(device.type):
            raise ValueError(f"no device {device}")

    def _own(self, stream: FakeStream) -> None:
        if stream.thread != threading.get_ident():
            raise RuntimeError(f"There is no Stream(gpu, {stream.index}) in current thread.")


DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "MLXD_NARROWED_DEVICE", "MLX_RANK", "MLXD_LOCAL_RANKS")


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    """A host with two GPUs: MLX's double, and the driver's list of GPUs (no CUDA_VISIBLE_DEVICES)."""
    fake = FakeMLX(num_gpus=2)
    monkeypatch.setattr(dev, "mlx_core", lambda: fake)
    monkeypatch.setattr(dev, "_chosen", None)
    monkeypatch.setattr(dev, "mlx_imported", lambda: False)  # this is the serving process's start
    for bus in ("0000:19:00.0", "0000:3b:00.0"):
        (tmp_path / "driver" / bus).mkdir(parents=True)
    monkeypatch.setattr(dev, "NVIDIA_GPUS", tmp_path / "driver")
    FAKE_THREADS.current.clear()
    saved = {name: os.environ.pop(name) for name in DEVICE_ENV if name in os.environ}
    yield fake
    for name in DEVICE_ENV:  # what the code under test set in this process's environment
        os.environ.pop(name, None)
    os.environ.update(saved)


def run_on_thread(name: str, work) -> None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join(10)
    if errors:
        raise errors[0]


def write_config(tmp_path: Path, device: str, extra: str = "") -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_text(f'[model]\nsource = "embedded:smollm2-135m"\ndevice = "{device}"\n{extra}')
    return path


def test_the_chosen_gpu_is_used_by_every_thread_and_for_every_array(two_gpus, tmp_path):
    """``gpu:1`` of two: the process narrows what it sees to that GPU before MLX starts CUDA, so it is MLX's gpu:0,
    and every thread that makes arrays (the loader, the engine) makes them there."""
    assert dev.narrow_process(write_config(tmp_path, "gpu:1")) == DeviceChoice("gpu", 1)
    choice = dev.select_device("gpu:1")
    assert choice == DeviceChoice("gpu", 0)

    def engine() -> None:
        with dev.device_stream():
            two_gpus.arange(8)  # what the engine makes with no stream named: the default stream's device
            two_gpus.eval(two_gpus.arange(300))
            assert two_gpus.arange(300).tolist()[-1] == 299

    run_on_thread("loader", lambda: dev.use_device(choice))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and two_gpus.device_count("gpu") == 1
    run_on_thread("engine", engine)
    assert {name for name, _ in two_gpus.made} == {"loader", "engine"}
    assert {device for _, device in two_gpus.made} == {FakeDevice("gpu", 0)}
    assert two_gpus.default_device() == FakeDevice("gpu", 0)
    assert set(FAKE_THREADS.current.values()) == {FakeDevice("gpu", 0)}


def test_where_the_gpus_cannot_be_narrowed_every_thread_uses_the_chosen_index(two_gpus, monkeypatch):
    """No driver list to count GPUs by (or CUDA already started): the process keeps seeing both, and every thread
    and array is on the chosen index."""
    monkeypatch.setattr(dev, "NVIDIA_GPUS", Path("/nonexistent/driver"))
    choice = dev.select_device("gpu:1")

    def engine() -> None:
        with dev.device_stream():
            two_gpus.arange(8)
            assert two_gpus.arange(300).tolist()[-1] == 299

    run_on_thread("loader", lambda: dev.use_device(choice))
    run_on_thread("engine", engine)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert {device for _, device in two_gpus.made} == {FakeDevice("gpu", 1)}
    assert set(FAKE_THREADS.current.values()) == {FakeDevice("gpu", 1)}


def test_the_default_narrows_to_the_first_gpu_and_a_rank_to_its_own(two_gpus, tmp_path):
    assert dev.narrow_process(write_config(tmp_path, "auto")) == DeviceChoice("gpu", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    os.environ.pop("CUDA_VISIBLE_DEVICES")
    os.environ.update(MLX_RANK="1", MLXD_LOCAL_RANKS="0,1")
    ranked = write_config(tmp_path, "auto", '[distributed]\nbackend = "ring"\n')
    assert dev.narrow_process(ranked) == DeviceChoice("gpu", 1) and os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_narrowing_refuses_a_gpu_not_seen_and_never_comes_late(two_gpus, tmp_path, monkeypatch):
    path = write_config(tmp_path, "gpu:2")
    with pytest.raises(ConfigError) as info:
        dev.narrow_process(path)
    assert info.value.message.startswith(f"{path}: model.device: 'gpu:2' is not a device here: MLX reports 2 gpu")
    assert dev.narrow_process(write_config(tmp_path, "cpu:0")) is None  # the CPU: nothing to narrow
    monkeypatch.setattr(dev, "mlx_imported", lambda: True)  # CUDA may have started: leave the view alone
    assert dev.narrow_process(write_config(tmp_path, "gpu:1")) is None
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and "MLXD_NARROWED_DEVICE" not in os.environ


def test_narrowing_keeps_the_operators_numbering(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert dev.narrow_to(DeviceChoice("gpu", 1), env) == DeviceChoice("gpu", 0) and env["CUDA_VISIBLE_DEVICES"] == "3"
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb,-1,4"}
    assert dev.visible_gpus(env) == ["GPU-aa", "GPU-bb"]  # CUDA stops at the first invalid entry
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    assert dev.narrow_to(DeviceChoice("gpu", 0), env) == DeviceChoice("gpu", 0) and env["CUDA_VISIBLE_DEVICES"] == "5"
    assert dev.narrow_to(DeviceChoice("cpu", 0), {}) == DeviceChoice("cpu", 0)
    assert dev.visible_gpus({}, tmp_path / "none") is None


def test_a_thread_that_is_not_set_up_reads_on_the_wrong_gpu(two_gpus):
    """The double's oracle: what the thread set-up prevents (a read on a thread whose current GPU is another)."""
    def stray() -> None:
        array = two_gpus.arange(300, stream=two_gpus.default_stream(FakeDevice("gpu", 1)))
        FAKE_THREADS.current[threading.get_ident()] = FakeDevice("gpu", 0)
        with pytest.raises(RuntimeError, match="invalid argument"):
            array.tolist()

    run_on_thread("stray", stray)


def test_the_default_is_the_first_gpu_and_a_rank_takes_its_own(two_gpus):
    assert dev.select_device("auto") == DeviceChoice("gpu", 0)
    assert dev.select_device("gpu") == DeviceChoice("gpu", 0)
    devices = {"gpu": 2, "cpu": 1}
    assert [choose_device("auto", devices, local_rank=r) for r in range(4)] == [
        DeviceChoice("gpu", 0), DeviceChoice("gpu", 1), DeviceChoice("gpu", 0), DeviceChoice("gpu", 1)]
    # mlx.launch --backend nccl shows each rank one GPU: every rank serves on gpu:0, its own.
    assert choose_device("auto", {"gpu": 1, "cpu": 1}, local_rank=1) == DeviceChoice("gpu", 0)
    assert choose_device("auto", {"gpu": 0, "cpu": 1}) == DeviceChoice("cpu", 0)
    assert choose_device("cpu", devices) == DeviceChoice("cpu", 0)


@pytest.mark.parametrize("setting", ["gpu:2", "gpu:17", "cpu:1"])
def test_a_device_mlx_does_not_report_is_refused_naming_file_and_field(two_gpus, setting, tmp_path):
    path = tmp_path / "mlxd.toml"
    with pytest.raises(ConfigError) as info:
        dev.check_device(setting, path)
    message = info.value.message
    assert message.startswith(f"{path}: model.device: {setting!r}")
    assert ("2 gpu device(s) (gpu:0 to gpu:1)" in message) if setting.startswith("gpu") else "cpu:0 only" in message


def test_no_gpu_at_all_is_said_so(monkeypatch):
    monkeypatch.setattr(dev, "mlx_core", lambda: FakeMLX(num_gpus=0))
    with pytest.raises(ConfigError, match=r"model.device: 'gpu:0' is not a device here: MLX reports 0 gpu"):
        dev.select_device("gpu:0")


def test_a_malformed_device_is_a_config_error_naming_file_and_field(tmp_path):
    path = tmp_path / "mlxd.toml"
    path.write_text('[model]\nsource = "embedded:smollm2-135m"\ndevice = "gpu1"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.message and "model.device" in info.value.message
    path.write_text('[model]\nsource = "embedded:smollm2-135m"\ndevice = "gpu:1"\n')
    assert load_config(path).model.device == "gpu:1"


def test_a_load_on_a_missing_gpu_fails_before_any_weight(tiny_qwen3_dir):
    """The real MLX of this machine (CPU backend: no GPU) refuses ``gpu:0`` from ``load`` itself."""
    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load

    with pytest.raises(ConfigError, match="model.device: 'gpu:3' is not a device here"):
        load(ModelConfig(source=str(tiny_qwen3_dir), device="gpu:3"))


def test_real_mlx_threads_serve_on_the_chosen_device(monkeypatch):
    """With the real MLX (CPU here): the loader's choice is MLX's default device, and a later thread serving inside
    ``device_stream`` makes and reads its arrays on a stream of its own on that device."""
    import mlx.core as mx

    monkeypatch.setattr(dev, "_chosen", None)
    choice = dev.select_device("auto")
    seen: list[object] = []

    def engine() -> None:
        with dev.device_stream() as stream:
            seen.append(stream)
            assert (mx.arange(10) * 2).tolist()[-1] == 18

    run_on_thread("loader", lambda: dev.use_device(choice))
    run_on_thread("engine", engine)
    assert dev.chosen_device() == choice and mx.default_device() == dev.to_mlx(choice)
    assert seen[0].device == dev.to_mlx(choice)


def test_local_ranks_number_the_ranks_of_each_host():
    assert local_ranks(["127.0.0.1"] * 4) == [0, 1, 2, 3]
    assert local_ranks(["a", "a", "b", "b"]) == [0, 1, 0, 1]
    assert local_ranks(["a", "b", "a", "b"]) == [0, 0, 1, 1]
    assert local_rank(3, {"MLXD_LOCAL_RANKS": "0,0,1,1"}) == 1
    assert local_rank(1, {}) == 1  # started by hand on one host


def launched_env(config: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "mlxd", "launch", "--config", str(config), "--print"],
                         capture_output=True, text=True, check=True, env=env).stdout
    args = shlex.split(out)
    return [args[i + 1] for i, arg in enumerate(args[:args.index("--")]) if arg == "--env"]


def test_launch_gives_each_local_rank_its_own_device(tmp_path, two_gpus, monkeypatch):
    base = '[model]\nsource = "embedded:smollm2-135m"\n'
    local = tmp_path / "local.toml"
    local.write_text(base + '[distributed]\nbackend = "nccl"\ntensor_parallel = 2\n')
    assert "MLXD_LOCAL_RANKS=0,1" in launched_env(local)
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(base + '[distributed]\nbackend = "ring"\nhosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2"]\n'
                     'tensor_parallel = 3\n')
    assert "MLXD_LOCAL_RANKS=0,1,0" in launched_env(hosts)
    # Each rank, seeing both GPUs of its host, serves on the one its local rank names.
    monkeypatch.setenv("MLXD_LOCAL_RANKS", "0,1,0")
    chosen = [dev.select_device("auto", group=FakeGroup(rank)) for rank in range(3)]
    assert chosen == [DeviceChoice("gpu", 0), DeviceChoice("gpu", 1), DeviceChoice("gpu", 0)]


@dataclass
class FakeGroup:
    """The one call device selection makes of an ``mx.distributed`` group."""

    number: int

    def rank(self) -> int:
        return self.number
