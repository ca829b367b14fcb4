"""Skips are reported, and in CI an unexpected one fails the run.

Every skipped test (or module) is listed at the end of the run with its reason. Under CI
(`CI=true`, which CI services set and `.ci/run` exports) or `AXRL_STRICT_SKIPS=1`, each skip must
match a rule of `ALLOWED_SKIPS` whose condition holds on this machine; any other skip — a broken
import, a missing tool, a golden file that no longer matches — turns the run into a failure
(exit status 1), so a suite cannot go green by not running. `AXRL_STRICT_SKIPS=0` turns the check
off even under CI.

This file is self-contained (tests/test_skip_policy.py copies it next to a generated test file).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Callable

import pytest


def _no_cuda_device() -> bool:
    import torch

    return not torch.cuda.is_available()


@dataclass(frozen=True)
class SkipRule:
    pattern: str                 # regex searched in the skip reason
    why: str                     # why such a skip is legitimate
    holds: Callable[[], bool]    # on this machine: the skip is allowed only while this is true


#: Skips that are legitimate, each only where its condition holds (checked at the end of the run).
ALLOWED_SKIPS = (
    SkipRule(r"needs a CUDA device",
             "GPU tests (tests/test_*_gpu.py) on a machine without a CUDA device; scripts/gpu-check-*.sh run them",
             _no_cuda_device),
    SkipRule(r"real-SGLang suite: set AXRL_SGLANG_PYTHON",
             "the real-SGLang suite without AXRL_SGLANG_PYTHON (.ci/run runs it in a second pass with it set)",
             lambda: not os.environ.get("AXRL_SGLANG_PYTHON")),
    SkipRule(r"real-vLLM suite: set AXRL_VLLM_PYTHON",
             "the real-vLLM suite without AXRL_VLLM_PYTHON (.ci/run runs it in a pass of its own with it set)",
             lambda: not os.environ.get("AXRL_VLLM_PYTHON")),
    SkipRule(r"sglang is installed",
             "tests of the error shown when sglang is missing, in an interpreter that has sglang",
             lambda: importlib.util.find_spec("sglang") is not None),
)


def strict() -> bool:
    flag = os.environ.get("AXRL_STRICT_SKIPS")
    if flag is not None and flag != "":
        return flag not in ("0", "false", "no")
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def _rule(reason: str) -> SkipRule | None:
    for rule in ALLOWED_SKIPS:
        if re.search(rule.pattern, reason) and rule.holds():
            return rule
    return None


_SKIPS: list[tuple[str, str]] = []   # (test or module id, reason)


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid or str(getattr(report, "fspath", "?")), _reason(report)))


def pytest_collectreport(report) -> None:
    _record(report)   # module-level pytest.skip(..., allow_module_level=True)


def pytest_runtest_logreport(report) -> None:
    _record(report)


def _classified() -> list[tuple[str, str, SkipRule | None]]:
    return [(nodeid, reason, _rule(reason)) for nodeid, reason in _SKIPS]


def pytest_sessionfinish(session, exitstatus) -> None:
    if strict() and any(rule is None for _, _, rule in _classified()) and exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    rows = _classified()
    mode = "strict: an unexpected skip fails the run" if strict() else "not strict (CI=true or AXRL_STRICT_SKIPS=1)"
    terminalreporter.section(f"skips ({len(rows)}; {mode})")
    for nodeid, reason, rule in rows:
        verdict = f"allowed: {rule.why}" if rule else "UNEXPECTED"
        terminalreporter.write_line(f"{nodeid}: {reason}  [{verdict}]")
    unexpected = [r for r in rows if r[2] is None]
    if unexpected and strict():
        terminalreporter.write_line(f"FAILED: {len(unexpected)} unexpected skip(s); a required suite did not run "
                                    "(allow-list: ALLOWED_SKIPS in tests/conftest.py)", red=True, bold=True)


# ----------------------------------------------------------------------------- shared fixtures
@pytest.fixture(scope="module")
def tok():
    """The default tokenizer (tests that need another define their own ``tok``)."""
    from axrl.tokenizer import Tokenizer
    return Tokenizer.default()


@pytest.fixture(scope="module")
def proxy(tok):
    """A recording proxy serving ``policy`` (sessions are opened per test)."""
    from axrl.agents.proxy import ProxyServer
    with ProxyServer(tok, model_name="policy") as p:
        yield p
