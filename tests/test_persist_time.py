"""A clean stop gives the prefix cache's disk tier ``[engine] prefix_cache_persist_s`` to write what memory holds
(``BatchedEngine.stop`` waits that long): the service unit's stop timeout makes room for it beyond the drain."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mlxd.service import STOP_MARGIN_S, main

CONFIG = """pipeline = "chat"
[server]
drain_timeout_s = 20
[model]
source = "embedded:smollm2-135m"
[engine]
{engine}
"""


def unit_stop_timeout(tmp_path: Path, engine: str) -> int:
    config = tmp_path / "mlxd.toml"
    config.write_text(CONFIG.format(engine=engine))
    out = io.StringIO()
    assert main(["print", "--platform", "linux", "--config", str(config)], out) == 0
    (line,) = [line for line in out.getvalue().splitlines() if line.startswith("TimeoutStopSec=")]
    return int(line.split("=")[1])


@pytest.mark.parametrize(("engine", "expected"), [
    ("", 20 + STOP_MARGIN_S),
    ('prefix_cache_dir = "cache"', 20 + 30 + STOP_MARGIN_S),
    ('prefix_cache_dir = "cache"\nprefix_cache_persist_s = 90', 20 + 90 + STOP_MARGIN_S),
    ("prefix_cache_persist_s = 90", 20 + STOP_MARGIN_S),  # no disk tier: nothing to write at a stop
])
def test_the_unit_s_stop_timeout_makes_room_for_the_disk_tier_s_writes(tmp_path, engine, expected):
    assert unit_stop_timeout(tmp_path, engine) == expected
