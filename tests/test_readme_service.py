"""The README's service sessions (launchd on macOS, systemd on Linux): each command ``mlxd service install`` tells
the user to run (start, logs, stop, remove) for the README's config is a line the README shows, and the README's
``mlxd service`` lines are ones the command accepts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from mlxd.service import (
    build_spec,
    default_dest,
    file_name,
    install_commands,
    log_hint,
    parser,
    render,
    stop_command,
    uninstall_commands,
)
from tests.test_readme_examples import readme_block

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("platform", "marker"), [("macos", "launchctl bootstrap"), ("linux", "systemctl --user")])
def test_the_readme_shows_the_commands_service_install_prints(platform, marker, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(ROOT)
    shown = [line.split("  #")[0].strip() for line in readme_block("sh", marker).splitlines()]
    services = [shlex.split(line) for line in shown if line.startswith(".venv/bin/mlxd service ")]
    assert [words[2] for words in services] == ["install", "uninstall"]
    for words in services:
        args = parser().parse_args([*words[2:], "--platform", platform])
        assert args.config == Path("configs/default.toml") and args.config.is_file()
    spec = build_spec(parser().parse_args(["install", "--platform", platform, "--config", "configs/default.toml"]),
                      30.0)
    path = default_dest(spec) / file_name(spec)
    printed = [*install_commands(spec, path), log_hint(spec).split("    (")[0], stop_command(spec),
               *uninstall_commands(spec)]
    printed = [command.replace(str(tmp_path), "~") for command in printed]
    missing = [command for command in printed if command not in shown]
    assert not missing, f"mlxd service install tells the user to run {missing}; the README shows {shown}"


def test_the_readme_s_logrotate_snippet_rotates_the_log_a_system_unit_writes(tmp_path, monkeypatch):
    """The logrotate snippet names the log file of a unit written with `--system --log-file /var/log/mlxd/mlxd.log`,
    and its postrotate reload is the unit's SIGHUP (which reopens the log: tests/test_log_file.py)."""
    from tests.test_readme_configs import fenced_blocks

    (snippet,) = [block for _, block in fenced_blocks() if "postrotate" in block]
    log_file, reload = snippet.splitlines()[0].removesuffix(" {"), snippet.split("postrotate")[1].split()[:3]
    monkeypatch.chdir(ROOT)
    spec = build_spec(parser().parse_args(["install", "--platform", "linux", "--system", "--config",
                                           "configs/default.toml", "--log-file", log_file]), 30.0)
    unit = render(spec).decode()
    assert reload == ["systemctl", "reload", spec.name]
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit.splitlines()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(f"--log-file {log_file}"), exec_start
