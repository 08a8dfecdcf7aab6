"""Event-time windows on the real broker: records with explicit Kafka timestamps, out of order
across partitions and some late, and a SIGKILL in the middle; each release's exact counts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


from tests.helpers.event_time import released_windows
from tests.helpers.kafka import env, make_topic, produce_at, run_service, service_args

SIZE = 10


def test_event_time_windows_exact_counts_with_late_records_and_a_kill(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, partitions=3)
    t0 = (int(time.time()) - 3600) // SIZE * SIZE  # window 0 = [t0, t0 + 10)
    args = service_args(
        kafka_broker,
        topic,
        tmp_path,
        "--exit-when-idle",
        "3",
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={SIZE}",
        "--set",
        "window.late=next",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "release.estimator=threshold",
    )
    # 1. window 0, out of order within and across partitions
    produce_at(
        kafka_broker,
        topic,
        [(p, t0 + (7 * i + 3 * p) % SIZE, i) for p in range(3) for i in range(40)],
    )
    assert run_service(args).returncode == 0
    # 2. a record of window 1 on partition 0 only: partitions 1 and 2 hold window 0 open (the
    #    watermark is the least of the partitions' latest timestamps; no idle timeout)
    produce_at(kafka_broker, topic, [(0, t0 + SIZE + 5, 1)])
    assert run_service(args).returncode == 0
    assert not list((tmp_path / "releases").glob("*.json"))
    # 3. window 1 out of order across partitions (p2 earlier than p0 and p1), plus 7 late
    #    records (window 0's timestamps) on partitions 1 and 2; a SIGKILL while counting
    produce_at(
        kafka_broker,
        topic,
        [(p, t0 + SIZE + (9 - 4 * p + i) % SIZE, i) for p in range(3) for i in range(30)]
        + [(1 + i % 2, t0 + i, 99) for i in range(7)],
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = run_service(args)
    assert done.returncode == 0, done.stderr[-2000:]
    # 4. window 3 on every partition (window 2 has no record): closes window 1
    produce_at(
        kafka_broker,
        topic,
        [(2, t0 + 3 * SIZE + 1, 5), (1, t0 + 3 * SIZE + 2, 6), (0, t0 + 3 * SIZE + 3, 7)],
    )
    assert run_service(args).returncode == 0
    assert released_windows(tmp_path) == [
        {"event_start_unix": t0, "event_end_unix": t0 + SIZE, "events": 120, "late": 0, "n": 120},
        {
            "event_start_unix": t0 + SIZE,
            "event_end_unix": t0 + 2 * SIZE,
            "events": 1 + 90 + 7,
            "late": 7,
            "n": 98,
        },
    ]
