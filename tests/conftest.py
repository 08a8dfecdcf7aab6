"""Shared fixtures. ``kafka_broker`` starts a real single-node KRaft broker via deploy/kafka."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KAFKA_SH = ROOT / "deploy" / "kafka" / "kafka.sh"


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """bootstrap address of a real Apache Kafka broker on 127.0.0.1 (stopped at session end)."""
    if os.environ.get("PANAGG_KAFKA_BOOTSTRAP"):
        yield os.environ["PANAGG_KAFKA_BOOTSTRAP"]
        return
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"integration tests need {', '.join(missing)} on PATH (a real broker, no mocks)")
    state = tmp_path_factory.mktemp("kafka")
    res = subprocess.run([str(KAFKA_SH), "start", str(state)], capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0:
        pytest.fail(f"could not start Kafka: {res.stderr.strip()[-2000:]}")
    bootstrap = res.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        yield bootstrap
    finally:
        subprocess.run([str(KAFKA_SH), "stop", str(state)], capture_output=True, timeout=120)
