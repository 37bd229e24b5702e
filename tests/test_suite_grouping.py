"""The suite's own scheduling (tests/conftest.py): under `--dist loadgroup`, a file whose module fixtures start
processes or train must run on one worker, so that they are computed once. When the grouping marks were added after
xdist had read them, each worker computed them again (the scale-out launches, TRL's scripts: minutes of CI)."""

from __future__ import annotations

import subprocess
import sys

from .fixtures.paths import REPO

MODULE = '''
import os, pytest

@pytest.fixture(scope="module")
def computed():
    with open(os.environ["SETUP_LOG"], "a") as log:
        log.write(f"{__name__} {os.environ.get('PYTEST_XDIST_WORKER')}\\n")

@pytest.mark.parametrize("case", range(4))
def test_case(computed, case):
    pass
'''


def test_a_files_module_fixtures_are_computed_once_under_two_workers(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    for name in ("test_first.py", "test_second.py"):
        (tmp_path / name).write_text(MODULE)
    log = tmp_path / "setups.log"
    env = {"PYTHONPATH": str(REPO), "SETUP_LOG": str(log), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    setups = sorted(line.split()[0] for line in log.read_text().splitlines())
    assert setups == ["test_first", "test_second"], setups  # each once, not once per worker
