"""The benchmark documents show the present: each ``docs/benchmarks/*.md`` is at most 400 lines, opens (in its
first 15 lines) with the command or tool that produces its numbers, and every benchmark script it names is one
that is kept in ``benchmarks/``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
MAX_LINES = 400


def test_there_are_benchmark_documents():
    assert len(DOCS) >= 5


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_a_benchmark_document_is_short_opens_with_its_command_and_names_kept_tools(doc: Path):
    lines = doc.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{doc.name}: {len(lines)} lines (at most {MAX_LINES}; git keeps the diary)"
    assert lines[0].startswith("# "), f"{doc.name} opens with no title"
    opening = "\n".join(lines[:15])
    assert re.search(r"`(benchmarks/\w+\.py|mlxd |curl |python )", opening), (
        f"{doc.name}: its first 15 lines name no command or benchmark tool that produces its numbers")
    missing = sorted({name for name in re.findall(r"benchmarks/\w+\.py", doc.read_text())
                      if not (ROOT / name).is_file()})
    assert not missing, f"{doc.name} names benchmark scripts that are not kept: {missing}"
