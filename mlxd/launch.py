"""``mlxd launch --config FILE``: start every rank of a ``[distributed]`` job through ``mlx.launch``.

The command is ``mlx.launch`` with the config's backend and hosts (or hostfile, or ``tensor_parallel`` processes on
this machine), running ``python -m mlxd --config FILE`` on each rank: rank 0 serves HTTP, the others follow it.
Every rank is told its local rank (``MLXD_LOCAL_RANKS``), so that the ranks on one host
serve on different GPUs without the operator setting ``CUDA_VISIBLE_DEVICES`` (:mod:`mlxd.runtime.device`; with
``--backend nccl`` and ``-n``, ``mlx.launch`` itself shows rank r only GPU r). ``mlx.launch`` ends the
other ranks when one fails, but exits 0 whatever happened to them, so this command
watches its report (``Node with rank N exited with code C`` / ``was killed``) and exits 1 when a rank failed:
launchd and systemd then restart the job. SIGTERM and SIGINT go to every rank (rank 0 drains, then stops the
others); a second one kills them all.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from mlxd.errors import ConfigError
from mlxd.runtime.device import LOCAL_RANKS_ENV

_RANK_FAILED = re.compile(r"Node with rank (\d+) (exited with code (-?\d+)|was killed)")


def launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxd launch",
                                     description="Start every rank of the config's [distributed] job through "
                                                 "mlx.launch; rank 0 serves HTTP.")
    parser.add_argument("--config", "-c", required=True, type=Path, help="daemon config (TOML) with [distributed]")
    parser.add_argument("--host", help="listen address of rank 0 (overrides [server] host)")
    parser.add_argument("--port", type=int, help="listen port of rank 0 (overrides [server] port)")
    parser.add_argument("--print", action="store_true", help="print the mlx.launch command and exit")
    return parser


# mlx.launch's own entry point (what its console script runs), started with SIGTERM and SIGINT ignored: a signal
# must reach the ranks (rank 0 drains, then stops the others) while mlx.launch stays to relay their output and
# their exit. The ranks inherit the ignored signals; rank 0's server installs its own handlers.
_MLX_LAUNCH = ("import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "signal.signal(signal.SIGINT, signal.SIG_IGN); sys.argv[0] = 'mlx.launch'; "
               "from mlx._distributed_utils.launch import main; sys.exit(main())")


def mlx_launch() -> list[str]:
    """How to run ``mlx.launch`` of the MLX this Python runs."""
    try:
        import mlx._distributed_utils.launch  # noqa: F401 - checked here, run in the child
    except ImportError as e:
        raise ConfigError(f"mlx.launch cannot be run from this Python ({e})") from e
    return [sys.executable, "-c", _MLX_LAUNCH]


def launch_command(args: argparse.Namespace) -> list[str]:
    from mlxd.config import load_config

    config = load_config(args.config)
    settings = config.distributed
    if settings is None:
        raise ConfigError(f"{args.config}: distributed: `mlxd launch` needs a [distributed] table")
    command = mlx_launch()
    if settings.backend != "any":
        command += ["--backend", settings.backend]
    if settings.hostfile:
        hostfile = Path(settings.hostfile).expanduser()
        if not hostfile.is_absolute():
            hostfile = args.config.resolve().parent / hostfile
        command += ["--hostfile", str(hostfile)]
        hosts = hostfile_hosts(hostfile)
    elif settings.hosts:
        command += ["--hosts", ",".join(settings.hosts)]
        hosts = list(settings.hosts)
    else:
        command += ["-n", str(settings.tensor_parallel), *local_threads(settings.tensor_parallel)]
        hosts = ["127.0.0.1"] * settings.tensor_parallel
    command += ["--env", f"{LOCAL_RANKS_ENV}={','.join(map(str, local_ranks(hosts)))}"]
    if settings.starting_port:
        command += ["--starting-port", str(settings.starting_port)]
    serve = [sys.executable, "-m", "mlxd", "--config", str(args.config.resolve())]
    serve += [*(["--host", args.host] if args.host else []), *(["--port", str(args.port)] if args.port else [])]
    return [*command, "--", *serve]


def local_ranks(hosts: list[str]) -> list[int]:
    """Each rank's number among the ranks on its host (``hosts``: one entry per rank, in rank order). A rank
    serves on its host's GPU of that number (modulo the GPUs it sees: :mod:`mlxd.runtime.device`), so the ranks
    sharing a host never share a GPU, whatever ``CUDA_VISIBLE_DEVICES`` the operator left unset."""
    seen: dict[str, int] = {}
    ranks = []
    for host in hosts:
        ranks.append(seen.get(host, 0))
        seen[host] = ranks[-1] + 1
    return ranks


def hostfile_hosts(path: Path) -> list[str]:
    """The host of each rank in an ``mlx.launch`` hostfile (its ``ssh`` names), read by MLX's own parser."""
    from mlx._distributed_utils.common import Hostfile

    try:
        return [host.ssh_hostname for host in Hostfile.from_file(path).hosts]
    except ValueError as e:
        raise ConfigError(f"distributed.hostfile: {e}") from e


def local_threads(num_ranks: int) -> list[str]:
    """Ranks on one machine share its cores: each BLAS gets its share of them (OpenBLAS's threads busy-wait; two
    ranks each running one per core made a 2-core machine's 16-stream decode 7x slower), unless the environment
    already says how many."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return []
    return ["--env", f"OPENBLAS_NUM_THREADS={max(1, (os.cpu_count() or 1) // num_ranks)}"]


def main(argv: list[str]) -> int:
    args = launch_parser().parse_args(argv)
    command = launch_command(args)
    if args.print:
        print(shlex.join(command))  # noqa: T201 - the command is the output
        return 0
    process = subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True)
    signals = {"count": 0}

    def forward(sig: int, _frame: object) -> None:
        signals["count"] += 1
        os.killpg(process.pid, sig if signals["count"] == 1 else signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed: list[str] = []
    relay = threading.Thread(target=_relay, args=(process.stderr, failed), daemon=True)
    relay.start()
    code = process.wait()
    relay.join(timeout=5)
    if failed:
        print(f"mlxd launch: {'; '.join(failed)}", file=sys.stderr)  # noqa: T201
        return 1
    return code


def _relay(stream, failed: list[str]) -> None:
    """Copy mlx.launch's stderr through, noting the ranks it reports as failed."""
    for raw in iter(stream.readline, b""):
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()
        match = _RANK_FAILED.search(raw.decode(errors="replace"))
        if match is not None:
            failed.append(f"rank {match.group(1)} {match.group(2)}")
