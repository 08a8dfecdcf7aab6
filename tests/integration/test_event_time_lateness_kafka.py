"""Allowed lateness on the real broker: 3 partitions, timestamps out of order within and beyond
the lateness, an idle partition, and a SIGKILL while two windows are live (a restored window
that was the second one, replaying its records among released ones, and the next window counting
already); after the restart every release has the exact n and late count the definitions give
(the reference of tests/test_event_time_lateness.py over the whole topic)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.helpers.event_time import reference, released_windows
from tests.helpers.kafka import env, make_topic, produce_at, run_service, service_args
from tests.helpers.service import durable, ledger_entries


SIZE, LATENESS = 10, 4

# timestamps (seconds after t0) per partition, in offset order, produced in three stages
STAGES = [
    # A. window 0 out of order with window 1 records within its lateness ([10, 14)); every
    #    partition passes 14 (16, 14, 15), so window 0 closes and window 1, which counts
    #    already, stays live; then window 1 with late records (2, 6) and window 2 records within
    #    window 1's lateness ([20, 24)). Partition 2 ends here: it holds window 1 open.
    {
        0: [3, 7, 12, 5, 16, 2, 18, 21, 11, 23],
        1: [8, 0, 13, 4, 10, 14, 6, 19, 22, 17],
        2: [9, 1, 11, 15, 12, 20, 13],
    },
    # B. more of windows 1 and 2 while partition 2 holds window 1 (the service is killed here);
    #    partitions 0 and 1 pass 24 (27, 33) with records behind them (24, 29; 25, 31)
    {0: [19, 1, 22, 27, 24, 29], 1: [15, 7, 20, 33, 25, 31]},
    # C. partitions 0 and 1 pass window 2 and 3 (window 5 stays open)
    {0: [52], 1: [55]},
]


def test_allowed_lateness_exact_releases_across_a_kill_with_two_live_windows(
    kafka_broker, tmp_path
):
    topic = make_topic(kafka_broker, partitions=3)
    t0 = (int(time.time()) - 3600) // SIZE * SIZE
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
        f"window.allowed_lateness_s={LATENESS}",
        "--set",
        "window.late=next",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "release.estimator=threshold",
    )
    item = iter(range(10_000))

    def produce(stage):
        produce_at(
            kafka_broker,
            topic,
            [(p, t0 + t, next(item) % 50) for p, ts in stage.items() for t in ts],
        )

    # A: window 0 is released; window 1 (restored from here on with a replay that skips
    #    window 0's records among its own) and window 2 are live
    produce(STAGES[0])
    done = run_service(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [w["event_start_unix"] for w in released_windows(tmp_path)] == [t0]
    ck = durable(tmp_path)  # window 1 starts with 4 events, replayed among window 0's records
    assert ck.window["event_start_unix"] == t0 + SIZE and ck.window["events"] == 0
    assert ck.totals["events"] == 8 and len(ck.window["skip_until"]) == 3

    # B: a SIGKILL while both windows count (partition 2 holds window 1 open: nothing closes),
    #    after the restore (its ledger entry) and some reading
    produce(STAGES[1])
    restarts = sum(e["kind"] == "restart" for e in ledger_entries(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while sum(e["kind"] == "restart" for e in ledger_entries(tmp_path)) == restarts:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = run_service(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(released_windows(tmp_path)) == 1  # window 1 is still held open by partition 2

    # C: partition 2 stops holding the watermark once idle; windows 1, 2 and 3 close
    produce(STAGES[2])
    done = run_service(args + ["--set", "window.idle_partition_timeout_s=1"])
    assert done.returncode == 0, done.stderr[-2000:]

    parts = {
        f"{topic}:{p}": [(t, None) for stage in STAGES for t in stage.get(p, [])] for p in range(3)
    }
    _, windows = reference(parts, LATENESS, "next")
    expected = [
        {
            "event_start_unix": t0 + k * SIZE,
            "event_end_unix": t0 + (k + 1) * SIZE,
            "events": ev,
            "late": late,
            "n": ev,
        }
        for k, (ev, late) in sorted(windows.items())
        if k < 5
    ]  # 5 stays open
    assert [(w["events"], w["late"]) for w in expected] == [(8, 0), (19, 4), (10, 0), (2, 0)]
    assert released_windows(tmp_path) == expected
