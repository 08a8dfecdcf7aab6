"""Releases beside the loop on a real broker, with a producer running: a release made to take
longer than a window does not stop intake, windows close on the clock, every window's n equals
its source range, and with backpressure (release.max_in_flight = 1) the lag gauge grows while
intake waits and comes back to 0."""

import json
import subprocess
import sys
import threading
import time
import urllib.request

import msgpack
from kafka import KafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.kafka import D, env, make_topic, service_args


def _producer(bootstrap, topic, rate, seconds, stop):
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    t0, sent = time.monotonic(), 0
    while not stop.is_set() and time.monotonic() - t0 < seconds:
        due = int((time.monotonic() - t0) * rate)
        for _ in range(due - sent):
            producer.send(topic, value=msgpack.packb({"item": sent % D}))
            sent += 1
        time.sleep(0.01)
    producer.flush()
    producer.close()


def scrape(url):
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _run_while_producing(bootstrap, topic, args, seconds):
    """Run the service (releases made to take 3 s) while a producer sends 1,500 events/s for
    ``seconds``; scrape /metrics every 0.3 s. Returns (samples, log lines)."""
    stop = threading.Event()
    producing = threading.Thread(target=_producer, args=(bootstrap, topic, 1500, seconds, stop))
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=dict(env(), PANAGG_TEST_RELEASE_DELAY_S="3"),
        stderr=subprocess.PIPE,
        text=True,
    )
    log, samples = [], []
    try:
        url = None
        deadline = time.time() + 60
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            log.append(line)
            if line.startswith("metrics on "):
                url = line.split()[-1]
        assert url, "".join(log)[-3000:]
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        producing.start()
        while proc.poll() is None:
            try:
                samples.append(scrape(url))
            except OSError:
                break
            time.sleep(0.3)
        assert proc.wait(timeout=120) == 0, "".join(log)[-3000:]
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    producing.join(timeout=30)
    return samples, log


def _args(bootstrap, topic, tmp_path, *sets):
    """2 s windows, no error bars, metrics on a free port, exit 6 s after the stream idles."""
    args = service_args(
        bootstrap,
        topic,
        tmp_path,
        "--exit-when-idle",
        "6",
        "--set",
        "release.error_bar_reps=0",
        *(x for kv in sets for x in ("--set", kv)),
    )
    args[args.index("window.size=100000000")] = "window.size=2"
    args[args.index("--metrics-port") + 1] = "0"
    return args


def _counted_while_waiting(samples):
    """Events counted between two scrapes while a window waited for its release."""
    return sum(
        b["panagg_events_total"] - a["panagg_events_total"]
        for a, b in zip(samples, samples[1:])
        if a.get("panagg_release_queue", 0) > 0
    )


def _ledger_releases(tmp_path):
    return [
        e
        for e in (
            json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()
        )
        if e["kind"] == "release"
    ]


def test_a_slow_release_never_stops_intake_and_lag_recovers(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, partitions=1)
    args = _args(
        kafka_broker,
        topic,
        tmp_path,
        "window.kind=time",
        "window.clock=process",
        "release.max_in_flight=1",
    )
    samples, log = _run_while_producing(kafka_broker, topic, args, 14)
    # intake went on while a release ran
    assert _counted_while_waiting(samples) > 0
    # backpressure: intake waited for a release (one line), the lag gauge grew and came back
    assert any("the release path is behind" in line for line in log)
    lags = [s.get("panagg_consumer_lag_records", 0.0) for s in samples]
    assert max(lags) > 0 and lags[-1] == 0, lags
    releases = _ledger_releases(tmp_path)
    assert len(releases) >= 4
    for e in releases:  # every window's n is exactly its source range (no rejects here)
        lo, hi = e["ranges"].get(f"{topic}:0", [0, 0])  # an empty window covers nothing
        assert e["n"] == hi - lo
    # windows close on the clock, not when the previous (3 s) release is done: a window that
    # waited for a release would be at least 3 s long
    lengths = [
        json.loads(e["document"])["window_info"]["ended_unix"]
        - json.loads(e["document"])["window_info"]["started_unix"]
        for e in releases[:-1]
    ]
    assert min(lengths) < 3.0, lengths


def test_event_time_windows_count_on_while_their_release_runs(kafka_broker, tmp_path):
    """Event-time windows of 2 s (record timestamps) with releases made to take 3 s while a
    producer runs: intake goes on while a window waits for its release, and every window's n is
    exactly its source range (one partition, timestamps in order)."""
    topic = make_topic(kafka_broker, partitions=1)
    args = _args(
        kafka_broker,
        topic,
        tmp_path,
        "window.kind=event_time",
        "release.max_in_flight=3",
        "window.idle_partition_timeout_s=2",
    )
    samples, log = _run_while_producing(kafka_broker, topic, args, 12)
    assert _counted_while_waiting(samples) > 0, "".join(log)[-3000:]
    releases = _ledger_releases(tmp_path)
    assert len(releases) >= 4
    for e in releases:
        lo, hi = e["ranges"].get(f"{topic}:0", [0, 0])
        assert e["n"] == hi - lo
