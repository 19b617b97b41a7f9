"""benchmarks/tp_floor.py: the greedy comparison of a tensor-parallel group's streams against one device's (where
each parts, and the one device's top-2 margin there), its report, and a whole run on the CPU (two ranks over
``ring``) that must find every stream of a float32 model equal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import benchmark_module

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def floor():
    return benchmark_module("tp_floor")


def test_agreement_finds_where_each_stream_parts_and_the_margin_there(floor):
    one = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    group = [[1, 2, 3], [4, 9, 6], [7], [9]]
    margins = [[0.5, 0.5, 0.5], [0.5, 0.0, 0.2], [0.1, 0.3], [0.4]]
    same = floor.agreement(one, group, margins)
    assert same == {"streams": 4, "equal": 2, "parted": [{"stream": 1, "at": 1, "margin": 0.0},
                                                          {"stream": 2, "at": 1, "margin": 0.3}]}
    assert floor.agreement(one, one, None)["parted"] == []
    assert floor.agreement([[1, 2]], [[1, 3]], None)["parted"] == [{"stream": 0, "at": 1, "margin": None}]


def test_report_gives_ratios_per_width_and_counts_exact_ties(floor):
    def run(rate, tokens, margins=None):
        return {"decode_tps": rate, "wall_tps": rate / 2, "tokens": tokens, "margins": margins, "runs": [[rate, 1]]}

    one = {"best": {"1": run(100.0, [[1]]), "4": run(400.0, [[1, 2], [3, 4], [5, 6], [7, 8]],
                                                    [[1.0, 1.0], [1.0, 0.0], [0.25, 1.0], [1.0, 1.0]])}}
    group = {"best": {"1": run(50.0, [[1]]), "4": run(300.0, [[1, 2], [3, 5], [6, 6], [7, 8]])}}
    text = floor.report(one, group, 2, [1, 4])
    assert "| 1 | 100 / 50 | 50 / 25 | 0.50x; 0.50x |" in text
    assert "| 4 | 400 / 200 | 300 / 150 | 0.75x; 0.75x |" in text
    assert "2 of 4 streams equal" in text
    assert "stream 1 at token 1 (margin 0.0000), stream 2 at token 0 (margin 0.2500)" in text
    assert "1 of 2 exact ties, the largest 0.2500" in text


def test_a_run_on_the_cpu_over_ring_finds_every_float32_stream_equal(tmp_path):
    out = tmp_path / "floor.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tp_floor.py"), "--tiny", "qwen3",
                             "--backend", "ring", "--concurrency", "1,4", "--max-tokens", "12", "--rounds", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    assert "| 1 |" in text and "| 4 |" in text
    assert "Greedy agreement at 4 streams: 4 of 4 streams equal" in text
