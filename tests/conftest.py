"""Shared fixtures: tiny random-weight models built once per test run; ``MLXD_FORBID_SKIPS=1`` turns skips into
failures (CI sets it, so that a missing dependency cannot hide a test)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FORBID_SKIPS = "MLXD_FORBID_SKIPS"


def _skips_forbidden() -> bool:
    return os.environ.get(FORBID_SKIPS, "") not in ("", "0")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.longrepr = f"{_skip_reason(report)}\nSkipped tests are failures when {FORBID_SKIPS}=1."
    report.outcome = "failed"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report = yield
    # An expected failure (xfail) is reported as skipped too; only real skips are turned into failures.
    if _skips_forbidden() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    # A module-level skip (pytest.importorskip, allow_module_level=True) never reaches pytest_runtest_makereport.
    if _skips_forbidden() and report.skipped:
        _fail_skip(report)
    return report


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the tiny models of this test run are built into."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models_root: Path) -> Path:
    """A tiny random-weight llama model folder (mlx-lm format, with tokenizer)."""
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_models_root: Path) -> Path:
    """A tiny random-weight qwen3 model folder."""
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tiny_models_root: Path) -> Path:
    """A tiny random-weight qwen3_next (hybrid linear attention + attention, MoE) model folder."""
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "qwen3_next")


@pytest.fixture(scope="session")
def tiny_vlm(tiny_models_root: Path):
    """A factory: ``tiny_vlm("qwen2_5_vl")`` is the folder of that tiny random-weight vision-language model."""
    from tests.support.tiny_vlm import tiny_vlm_cached

    return lambda family: tiny_vlm_cached(tiny_models_root, family)
