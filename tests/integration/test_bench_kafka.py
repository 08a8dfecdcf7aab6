"""The benches that need a Kafka broker, each run at its --smoke size on the session's broker
(tests/test_bench_smoke.py runs the others; issue 52: every bench in the suite's smoke lane).
Each writes no doc and runs in a scratch directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (bench, its smoke flags)
KAFKA_SMOKES = [
    ("service.e2e", ["--smoke"]),
    ("service.multi_agg", ["--smoke"]),
    ("service.intake_stall", ["--smoke"]),
    ("service.registry_cost", ["--smoke"]),
    ("service.registry_cost", ["--smoke", "--group", "items"]),
    ("service.shuffler_throughput", ["--smoke"]),
    ("service.group", ["--smoke", "--throughput"]),
    ("service.group", ["--smoke", "--throughput", "--client", "confluent", "--no-one"]),
    ("service.group", ["--smoke", "--restarts", "1"]),  # its own broker: it stops it
    ("service.group", ["--smoke", "--memory"]),  # peak RSS: one process, one member
    ("service.views", ["--smoke", "recovery", "--bootstrap", "{bootstrap}"]),
]


@pytest.mark.parametrize("module,args", KAFKA_SMOKES, ids=[m for m, _ in KAFKA_SMOKES])
def test_bench_smoke_on_the_broker(module, args, kafka_broker, tmp_path):
    argv = [a.format(bootstrap=kafka_broker) for a in args]
    res = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PANAGG_KAFKA_BOOTSTRAP=kafka_broker),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
