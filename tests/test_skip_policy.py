"""tests/conftest.py's skip policy, on a generated test file run by a separate pytest: every skip is
listed with its reason; under CI an unexpected skip fails the run, an allowed one does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
TESTS = '''
import pytest

def test_runs():
    assert True

def test_missing_package():
    pytest.importorskip("axrl_no_such_package_xyz")

@pytest.mark.skipif(True, reason="real-SGLang suite: set AXRL_SGLANG_PYTHON to the python of ...")
def test_sglang():
    pass
'''


def run_pytest(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_generated.py").write_text(source)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "AXRL_STRICT_SKIPS", "AXRL_SGLANG_PYTHON",
                                                              "PYTEST_ADDOPTS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)


def test_an_unexpected_skip_fails_under_ci_and_every_skip_is_listed(tmp_path):
    out = run_pytest(tmp_path, TESTS, CI="true")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "1 passed, 2 skipped" in text
    assert "test_generated.py::test_missing_package: could not import 'axrl_no_such_package_xyz'" in text
    assert "UNEXPECTED" in text and "1 unexpected skip(s)" in text
    assert "test_generated.py::test_sglang: real-SGLang suite" in text and "allowed: the real-SGLang suite" in text


def test_strictness_follows_the_environment(tmp_path):
    # Not under CI: the same skips are listed, the run passes.
    out = run_pytest(tmp_path, TESTS)
    assert out.returncode == 0 and "UNEXPECTED" in out.stdout, out.stdout + out.stderr
    # AXRL_STRICT_SKIPS=1 is strict anywhere; =0 turns it off even under CI.
    assert run_pytest(tmp_path, TESTS, AXRL_STRICT_SKIPS="1").returncode == 1
    assert run_pytest(tmp_path, TESTS, CI="true", AXRL_STRICT_SKIPS="0").returncode == 0


def test_allowed_skips_only_pass_where_their_condition_holds(tmp_path):
    allowed_only = TESTS.replace("def test_missing_package():", "def _not_a_test():")
    assert run_pytest(tmp_path, allowed_only, CI="true").returncode == 0
    # With AXRL_SGLANG_PYTHON set the real-SGLang suite was asked for: its skip is no longer allowed.
    out = run_pytest(tmp_path, allowed_only, CI="true", AXRL_SGLANG_PYTHON="/nonexistent/python")
    assert out.returncode == 1 and "test_sglang: real-SGLang suite" in out.stdout, out.stdout


def test_a_module_level_skip_is_caught(tmp_path):
    out = run_pytest(tmp_path, 'import pytest\npytest.skip("needs tmux", allow_module_level=True)\n'
                               'def test_x():\n    pass\n', CI="true")
    assert out.returncode == 1 and "test_generated.py: needs tmux  [UNEXPECTED]" in out.stdout, out.stdout
