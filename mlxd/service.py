"""``mlxd service install|uninstall|print``: run this environment's mlxd under launchd (macOS) or systemd (Linux).

The service runs ``mlxd --config FILE`` with absolute paths, restarts it when it fails (not after a clean exit:
a SIGTERM drain exits 0), and gives a stop ``[server] drain_timeout_s`` plus a margin before the kill.
"""

from __future__ import annotations

import argparse
import math
import os
import plistlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mlxd.assemble import load_everything
from mlxd.config.models import served_models
from mlxd.config.schema import DaemonConfig

# Beyond the drain: uvicorn's wait for open connections (5 s) and the engine's shutdown.
STOP_MARGIN_S = 15
# launchd: at least this long between restarts; systemd: RestartSec.
RESTART_DELAY_S = 10
# Exit code 2 is a bad config or a missing model: restarting cannot fix it (systemd only; launchd has no such key).
EXIT_BAD_CONFIG = 2
DEFAULT_NAMES = {"macos": "com.mlxd.daemon", "linux": "mlxd"}


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs and how; every path absolute."""

    platform: str  # "macos" | "linux"
    name: str  # launchd label / systemd unit name (without .service)
    system: bool  # launchd daemon / system unit, instead of an agent / user unit
    command: list[str]  # mlxd and its arguments
    workdir: Path
    stop_timeout_s: int
    log_file: Path | None  # mlxd --log-file; systemd without it logs to the journal
    stderr_file: Path | None  # launchd: what the process writes outside the log (a crash before logging starts)
    environment: dict[str, str]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd service",
        description="Write (install), remove (uninstall) or show (print) a launchd plist (macOS) or a systemd "
                    "unit (Linux) that runs this environment's mlxd with --config FILE. The config is "
                    "validated first; install and uninstall print the launchctl / systemctl commands to run.",
    )
    parser.add_argument("action", choices=["install", "uninstall", "print"])
    parser.add_argument("--config", "-c", required=True, type=Path,
                        help="daemon config (TOML); uninstall does not read it")
    parser.add_argument("--platform", choices=["macos", "linux"], default=current_platform(),
                        help="launchd (macos) or systemd (linux); default: this machine's")
    parser.add_argument("--system", action="store_true",
                        help="a launchd daemon in /Library/LaunchDaemons or a systemd system unit in "
                             "/etc/systemd/system (run as root); default: a per-user agent / user unit")
    parser.add_argument("--name", help="launchd label / systemd unit name (default: com.mlxd.daemon / mlxd)")
    parser.add_argument("--dest", type=Path, help="folder to write the file into, instead of the usual one")
    parser.add_argument("--log-file", type=Path,
                        help="mlxd's log file (default: ~/Library/Logs/LABEL.log, or /Library/Logs/LABEL.log "
                             "with --system, on macOS; the journal on Linux)")
    return parser


def current_platform() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def mlxd_command() -> list[str]:
    """This environment's mlxd, absolute: the console script beside this interpreter (a venv's ``bin/``), else
    ``python -m mlxd`` with this interpreter. The interpreter's path is not resolved: a venv's ``bin/python`` is
    a symlink, and resolving it would leave the venv."""
    python = Path(sys.executable).absolute()
    script = python.parent / "mlxd"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [str(python), "-m", "mlxd"]


def persist_s(config: DaemonConfig) -> float:
    """The longest a clean stop waits, after the drain, for a model's prefix-cache disk tier to be written."""
    return max((served.config.engine.prefix_cache_persist_s for served in served_models(config)
                if served.config.engine.prefix_cache_dir), default=0.0)


def build_spec(args: argparse.Namespace, drain_timeout_s: float, distributed: bool = False) -> ServiceSpec:
    """The service for ``args`` (parsed by :func:`parser`) and a config whose drain takes ``drain_timeout_s``;
    ``distributed``: the config has ``[distributed]``, so the service runs ``mlxd launch`` (every rank; their log
    lines go to the service's output)."""
    config = args.config.resolve()
    name = args.name or DEFAULT_NAMES[args.platform]
    log_file = args.log_file.expanduser().absolute() if args.log_file else None
    stderr_file = None
    if args.platform == "macos":
        logs = Path("/Library/Logs") if args.system else Path.home() / "Library" / "Logs"
        log_file = log_file or logs / f"{name}.log"
        stderr_file = log_file.with_name(f"{log_file.stem}.stderr.log")
    command = [*mlxd_command(), *(["launch"] if distributed else []), "--config", str(config)]
    if log_file is not None and not distributed:
        command += ["--log-file", str(log_file)]
    environment = {}
    if os.environ.get("MLXD_CACHE_DIR"):
        environment["MLXD_CACHE_DIR"] = str(Path(os.environ["MLXD_CACHE_DIR"]).expanduser().absolute())
    return ServiceSpec(
        platform=args.platform, name=name, system=args.system, command=command, workdir=config.parent,
        stop_timeout_s=math.ceil(drain_timeout_s) + STOP_MARGIN_S, log_file=log_file, stderr_file=stderr_file,
        environment=environment,
    )


def launchd_plist(spec: ServiceSpec) -> bytes:
    """The launchd property list (XML) for ``spec``."""
    job: dict[str, object] = {
        "Label": spec.name,
        "ProgramArguments": spec.command,
        "WorkingDirectory": str(spec.workdir),
        "RunAtLoad": True,
        # Restart after a failure (exit 1: the model failed to load, the engine stopped), not after a drain (0).
        "KeepAlive": {"SuccessfulExit": False},
        # SIGTERM drains for [server] drain_timeout_s; SIGKILL only after this.
        "ExitTimeOut": spec.stop_timeout_s,
        "ThrottleInterval": RESTART_DELAY_S,
        "ProcessType": "Interactive",
        "StandardOutPath": str(spec.stderr_file),
        "StandardErrorPath": str(spec.stderr_file),
    }
    if spec.environment:
        job["EnvironmentVariables"] = spec.environment
    return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=False)


def systemd_quote(arg: str, *, command: bool = True) -> str:
    """One word of a ``command`` (``ExecStart=``: ``$`` escaped too) or of ``Environment=``: ``%`` escaped, quoted
    when it holds spaces, quotes, backslashes or a semicolon."""
    arg = arg.replace("%", "%%")
    if command:
        arg = arg.replace("$", "$$")
    if any(c.isspace() or c in "\"'\\;" for c in arg):
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def systemd_unit(spec: ServiceSpec) -> str:
    """The systemd unit file for ``spec``."""
    lines = [
        "# Written by `mlxd service install`; `mlxd service print` shows what it would write now.",
        "[Unit]",
        f"Description=mlxd MLX model server ({spec.name})",
    ]
    if spec.system:
        lines += ["After=network-online.target", "Wants=network-online.target"]
    lines += [
        "",
        "[Service]",
        "Type=exec",
        f"WorkingDirectory={str(spec.workdir).replace('%', '%%')}",
        "ExecStart=" + " ".join(systemd_quote(arg) for arg in spec.command),
        # `systemctl reload`: reopen the log file and re-read the config's [logging] table.
        "ExecReload=/bin/kill -HUP $MAINPID",
    ]
    lines += [f"Environment={systemd_quote(f'{key}={value}', command=False)}" for key, value in spec.environment.items()]
    lines += [
        "# Exit 0 after a SIGTERM drain; 1 when the model fails to load or the engine stops (restarted);",
        "# 2 for a bad config or a missing model (not restarted: it would fail again).",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        f"RestartPreventExitStatus={EXIT_BAD_CONFIG}",
        "# SIGTERM drains for [server] drain_timeout_s; SIGKILL only after this.",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if spec.system else 'default.target'}",
        "",
    ]
    return "\n".join(lines)


def render(spec: ServiceSpec) -> bytes:
    if spec.platform == "macos":
        return launchd_plist(spec)
    return systemd_unit(spec).encode()


def default_dest(spec: ServiceSpec) -> Path:
    """Where launchd or systemd looks for the file."""
    if spec.platform == "macos":
        return Path("/Library/LaunchDaemons") if spec.system else Path.home() / "Library" / "LaunchAgents"
    return Path("/etc/systemd/system") if spec.system else Path.home() / ".config" / "systemd" / "user"


def file_name(spec: ServiceSpec) -> str:
    return f"{spec.name}.plist" if spec.platform == "macos" else f"{spec.name}.service"


def install_commands(spec: ServiceSpec, path: Path) -> list[str]:
    if spec.platform == "macos":
        domain = "system" if spec.system else "gui/$(id -u)"
        return [f"launchctl bootstrap {domain} {path}"]
    systemctl = "systemctl" if spec.system else "systemctl --user"
    return [f"{systemctl} daemon-reload && {systemctl} enable --now {spec.name}"]


def uninstall_commands(spec: ServiceSpec) -> list[str]:
    if spec.platform == "macos":
        domain = "system" if spec.system else "gui/$(id -u)"
        return [f"launchctl bootout {domain}/{spec.name}"]
    systemctl = "systemctl" if spec.system else "systemctl --user"
    return [f"{systemctl} disable --now {spec.name} && {systemctl} daemon-reload"]


def stop_command(spec: ServiceSpec) -> str:
    if spec.platform == "macos":
        return uninstall_commands(spec)[0]  # bootout stops it; bootstrap starts it again
    return f"{'systemctl' if spec.system else 'systemctl --user'} stop {spec.name}"


def log_hint(spec: ServiceSpec) -> str:
    if spec.log_file is None:
        return f"journalctl {'' if spec.system else '--user '}-u {spec.name} -f -o cat"
    if spec.stderr_file is None:
        return f"tail -f {spec.log_file}    (anything else the process prints: journalctl -u {spec.name})"
    return f"tail -f {spec.log_file}    (anything else the process prints: {spec.stderr_file})"


def install(spec: ServiceSpec, path: Path, out: TextIO) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(render(spec))
    if spec.stderr_file is not None and spec.platform == current_platform():
        # launchd opens StandardErrorPath itself, before mlxd runs, and creates no folders.
        spec.stderr_file.parent.mkdir(parents=True, exist_ok=True)
    out.write(f"wrote {path}\nstart it now and at every {'boot' if spec.system else 'login'}:\n")
    out.writelines(f"  {command}\n" for command in install_commands(spec, path))
    out.write(f"logs: {log_hint(spec)}\n")
    out.write(f"stop it: {stop_command(spec)}\n")
    out.write("remove it: mlxd service uninstall with the same --platform, --system, --name and --dest\n")


def uninstall(spec: ServiceSpec, path: Path, out: TextIO) -> None:
    if path.exists():
        path.unlink()
        out.write(f"removed {path}\n")
    else:
        out.write(f"{path} was not there\n")
    out.write("stop it and forget it:\n")
    out.writelines(f"  {command}\n" for command in uninstall_commands(spec))


def main(argv: list[str], out: TextIO | None = None) -> int:
    """``mlxd service ...``: validate the config, then install, uninstall or print. Raises ``MlxdError`` (a bad
    config) before anything is written."""
    out = out or sys.stdout
    args = parser().parse_args(argv)
    drain_timeout_s, distributed = 0.0, False
    if args.action != "uninstall":
        config, _ = load_everything(args.config)
        drain_timeout_s, distributed = config.server.drain_timeout_s + persist_s(config), config.distributed is not None
    spec = build_spec(args, drain_timeout_s, distributed)
    if args.action == "print":
        out.write(render(spec).decode())
        return 0
    path = (args.dest.absolute() if args.dest else default_dest(spec)) / file_name(spec)
    if args.action == "install":
        install(spec, path, out)
    else:
        uninstall(spec, path, out)
    return 0
