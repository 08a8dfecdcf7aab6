"""The kafka-python bug reports of docs/upstream/ and their reproducers, on the real broker:
with the pinned client the bug shows (else the report and its patch in
consumers/kafka/compat.py can go), and with panagg's patch it does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script, bootstrap, *flags):
    res = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "upstream" / script), bootstrap, *flags],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "script", ["repro_parked_records.py", "repro_txn_offsets.py", "repro_stuck_join.py"]
)
def test_the_reproducer_shows_the_bug_and_the_patch_fixes_it(kafka_broker, script):
    assert _run(script, kafka_broker, "--patched") == "OK"
    plain = _run(script, kafka_broker)
    if plain == "OK":
        pytest.skip(
            f"the installed kafka-python no longer has the bug {script} shows: drop "
            "its patch in consumers/kafka/compat.py and the report in docs/upstream/"
        )
    assert plain.startswith("REPRODUCED"), plain
