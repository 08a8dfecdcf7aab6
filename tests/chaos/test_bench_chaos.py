"""bench.service.chaos at its --smoke size (one count-window case under kill -9, its own broker,
which it kills): the bench's table around tests/chaos/harness.py runs (issue 52: every bench in
the suite's smoke lane; tests/test_bench_smoke.py has the others)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.chaos
def test_bench_chaos_smoke(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "bench.service.chaos", "--smoke"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert "VIOLATED" not in res.stdout, res.stdout[-3000:]
