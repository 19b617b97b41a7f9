"""`mlxd service`: the launchd plist and the systemd unit it writes, checked by plistlib and systemd-analyze."""

from __future__ import annotations

import io
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import main as cli_main
from mlxd.service import ServiceSpec, render
from mlxd.service import main as service_main
from tests.helpers import write_config

DRAIN_S = 7.5


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A valid config (the model is not needed: `service` validates the config and pipeline only)."""
    path = write_config(tmp_path, tmp_path / "model")
    path.write_text(path.read_text().replace("keepalive_s = 0.5", f"keepalive_s = 0.5\ndrain_timeout_s = {DRAIN_S}"))
    return path


def run(*argv: str) -> str:
    out = io.StringIO()
    assert service_main(list(argv), out=out) == 0
    return out.getvalue()


def this_mlxd() -> str:
    script = Path(sys.executable).parent / "mlxd"
    assert script.is_file(), "tests run from an environment with mlxd installed (its console script)"
    return str(script)


def test_launchd_plist_runs_this_mlxd_with_the_config(config, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "logs" / "mlxd.log"
    job = plistlib.loads(run("print", "--platform", "macos", "--config", str(config), "--log-file", str(log))
                         .encode())
    assert job["Label"] == "com.mlxd.daemon"
    program = job["ProgramArguments"]
    assert Path(program[0]).is_absolute() and program[0] == this_mlxd()
    assert program[1:] == ["--config", str(config.resolve()), "--log-file", str(log)]
    assert job["WorkingDirectory"] == str(config.resolve().parent)
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}  # restarted after a failure, not after a drain
    assert job["ExitTimeOut"] > DRAIN_S and job["ExitTimeOut"] == 8 + 15
    assert job["StandardErrorPath"] == job["StandardOutPath"] == str(tmp_path / "logs" / "mlxd.stderr.log")
    assert job["EnvironmentVariables"] == {"MLXD_CACHE_DIR": str(tmp_path / "cache")}


def test_launchd_default_log_paths(config, monkeypatch):
    monkeypatch.delenv("MLXD_CACHE_DIR", raising=False)
    agent = plistlib.loads(run("print", "--platform", "macos", "--config", str(config)).encode())
    logs = Path.home() / "Library" / "Logs"
    assert agent["ProgramArguments"][-2:] == ["--log-file", str(logs / "com.mlxd.daemon.log")]
    assert agent["StandardErrorPath"] == str(logs / "com.mlxd.daemon.stderr.log")
    assert "EnvironmentVariables" not in agent
    daemon = plistlib.loads(run("print", "--platform", "macos", "--system", "--name", "org.example.llm",
                                "--config", str(config)).encode())
    assert daemon["Label"] == "org.example.llm"
    assert daemon["ProgramArguments"][-1] == "/Library/Logs/org.example.llm.log"


def systemd_analyze_verify(unit: Path, *, user: bool) -> tuple[int, list[str]]:
    """`systemd-analyze verify` on ``unit``: its exit code and the lines it prints about the unit. Some mistakes
    (an unknown key, a bad value: both ignored when loading) are printed with exit code 0, so both count.
    `--man=no`: no man pages here; `--generators=no`: nothing about this machine's other units."""
    command = ["systemd-analyze", "verify", "--man=no", "--generators=no", "--recursive-errors=no"]
    env = dict(os.environ)
    if user:
        runtime = unit.parent / "runtime"  # the user manager wants $XDG_RUNTIME_DIR, which a CI shell may lack
        runtime.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        command.append("--user")
    result = subprocess.run([*command, str(unit)], capture_output=True, text=True, env=env, timeout=60)
    lines = (result.stdout + result.stderr).splitlines()
    return result.returncode, [line for line in lines if unit.name in line]


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_systemd_unit_passes_systemd_analyze_verify(config, tmp_path, monkeypatch, system):
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: apt-get install systemd"
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache dir"))
    dest = tmp_path / "units"
    flags = ["--system"] if system else []
    out = run("install", "--platform", "linux", *flags, "--config", str(config), "--dest", str(dest))
    unit = dest / "mlxd.service"
    text = unit.read_text()
    assert f"ExecStart={this_mlxd()} --config {config.resolve()}\n" in text
    assert f"WorkingDirectory={config.resolve().parent}\n" in text
    assert "Restart=on-failure\n" in text and "RestartPreventExitStatus=2\n" in text
    assert "TimeoutStopSec=23\n" in text  # drain_timeout_s 7.5, rounded up, plus the margin
    assert f'Environment="MLXD_CACHE_DIR={tmp_path / "cache dir"}"\n' in text
    assert ("WantedBy=multi-user.target" if system else "WantedBy=default.target") in text
    assert systemd_analyze_verify(unit, user=not system) == (0, [])
    systemctl = "systemctl" if system else "systemctl --user"
    assert f"{systemctl} daemon-reload && {systemctl} enable --now mlxd" in out
    assert ("journalctl -u mlxd" if system else "journalctl --user -u mlxd") in out


def test_systemd_unit_with_a_log_file_and_odd_paths(tmp_path, monkeypatch):
    folder = tmp_path / "my configs 100%"
    folder.mkdir()
    config = write_config(folder, tmp_path / "model")
    monkeypatch.delenv("MLXD_CACHE_DIR", raising=False)
    log = tmp_path / "logs" / "mlxd.log"
    unit = tmp_path / "mlxd.service"
    unit.write_text(run("print", "--platform", "linux", "--config", str(config), "--log-file", str(log)))
    text = unit.read_text()
    assert f'--config "{str(config.resolve()).replace("%", "%%")}" --log-file {log}\n' in text
    assert "Environment=" not in text
    assert systemd_analyze_verify(unit, user=True) == (0, [])


def test_systemd_analyze_verify_reports_mistakes(tmp_path):
    """The check above would catch a broken unit."""
    mistakes = {  # [Service] lines → what the report names
        "ExecStart=/bin/true\nRestart=sometimes": "sometimes",
        "ExecStart=/bin/true\nNoSuchKey=1": "NoSuchKey",
        "ExecStart=/no/such/mlxd": "/no/such/mlxd",
    }
    unit = tmp_path / "broken.service"
    for lines, named in mistakes.items():
        unit.write_text(f"[Service]\n{lines}\n")
        code, report = systemd_analyze_verify(unit, user=False)
        assert any(named in line for line in report), (lines, code, report)


def test_install_and_uninstall_write_and_remove_the_file(config, tmp_path):
    dest = tmp_path / "LaunchAgents"
    log = tmp_path / "logs" / "mlxd.log"
    out = run("install", "--platform", "macos", "--config", str(config), "--dest", str(dest), "--log-file", str(log))
    plist = dest / "com.mlxd.daemon.plist"
    assert plistlib.loads(plist.read_bytes())["Label"] == "com.mlxd.daemon"
    assert f"wrote {plist}" in out
    assert f"launchctl bootstrap gui/$(id -u) {plist}" in out
    assert f"tail -f {log}" in out
    out = run("uninstall", "--platform", "macos", "--config", str(config), "--dest", str(dest))
    assert not plist.exists() and f"removed {plist}" in out
    assert "launchctl bootout gui/$(id -u)/com.mlxd.daemon" in out

    dest = tmp_path / "units"
    out = run("install", "--platform", "linux", "--system", "--name", "llm", "--config", str(config),
              "--dest", str(dest))
    assert (dest / "llm.service").is_file() and "systemctl daemon-reload && systemctl enable --now llm" in out
    assert "stop it: systemctl stop llm" in out
    out = run("uninstall", "--platform", "linux", "--system", "--name", "llm", "--config", str(config),
              "--dest", str(dest))
    assert not (dest / "llm.service").exists()
    assert "systemctl disable --now llm && systemctl daemon-reload" in out


def test_a_bad_config_writes_nothing(config, tmp_path, capsys):
    config.write_text(config.read_text().replace("keepalive_s = 0.5", "keepalive_s = 0.5\nno_such_field = 1"))
    dest = tmp_path / "units"
    code = cli_main(["service", "install", "--platform", "linux", "--config", str(config), "--dest", str(dest)])
    assert code == 2
    err = capsys.readouterr().err
    assert "server" in err and "no_such_field" in err and str(config) in err
    assert not dest.exists()


def test_the_command_line_prints_the_unit(config):
    result = subprocess.run([this_mlxd(), "service", "print", "--platform", "linux", "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# Written by `mlxd service install`")
    assert f"ExecStart={this_mlxd()} --config {config.resolve()}" in result.stdout


def test_the_example_files_are_what_the_command_writes():
    """launchd/ holds examples of the command's output, for a checkout in /Users/YOU/mlxd and /opt/mlxd."""
    root = Path(__file__).resolve().parent.parent
    agent = ServiceSpec(
        platform="macos", name="com.mlxd.daemon", system=False,
        command=["/Users/YOU/mlxd/.venv/bin/mlxd", "--config", "/Users/YOU/mlxd/configs/default.toml",
                 "--log-file", "/Users/YOU/Library/Logs/com.mlxd.daemon.log"],
        workdir=Path("/Users/YOU/mlxd/configs"), stop_timeout_s=45,
        log_file=Path("/Users/YOU/Library/Logs/com.mlxd.daemon.log"),
        stderr_file=Path("/Users/YOU/Library/Logs/com.mlxd.daemon.stderr.log"), environment={},
    )
    example = (root / "launchd" / "com.mlxd.daemon.plist").read_bytes()
    assert plistlib.loads(example) == plistlib.loads(render(agent))
    unit = ServiceSpec(
        platform="linux", name="mlxd", system=True,
        command=["/opt/mlxd/.venv/bin/mlxd", "--config", "/opt/mlxd/configs/default.toml"],
        workdir=Path("/opt/mlxd/configs"), stop_timeout_s=45, log_file=None, stderr_file=None,
        environment={"MLXD_CACHE_DIR": "/var/cache/mlxd"},
    )

    def settings(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert settings((root / "launchd" / "mlxd.service").read_text()) == settings(render(unit).decode())


def test_a_distributed_config_runs_every_rank_through_mlxd_launch(config, tmp_path):
    config.write_text(config.read_text() + '\n[distributed]\nbackend = "ring"\n')
    job = plistlib.loads(run("print", "--platform", "macos", "--config", str(config)).encode())
    assert job["ProgramArguments"] == [this_mlxd(), "launch", "--config", str(config.resolve())]
    unit = run("print", "--platform", "linux", "--config", str(config))
    assert f"ExecStart={this_mlxd()} launch --config {config.resolve()}" in unit
