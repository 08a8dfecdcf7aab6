"""End-to-end throughput of the service, as ratios measured in one run.

    python -m bench.e2e [--events 1000000] [--reps 3]

1. Kafka: the service (decode -> count -> checkpoints, in-process Aggregator) against a bare
   kafka-python consume loop over the same topic, alternating, each with a fresh consumer group.
2. File source: the service replaying a msgpack file, against a bare msgpack read of the file.
3. Checkpoint of a 10^7-counter state (LocalStore.save: serialize + fsync + rename) against
   np.save of the same int64 array plus fsync.

A broker comes from $PANAGG_KAFKA_BOOTSTRAP or is started with deploy/kafka/kafka.sh. Writes
docs/e2e.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.service.config import load_config  # noqa: E402
from aggregator.service import Aggregator  # noqa: E402
from aggregator.state import PanPrivateHistogram  # noqa: E402
from consumers.base import Source  # noqa: E402
from consumers.file_source import FileSource  # noqa: E402
from consumers.kafka_source import KafkaSource  # noqa: E402
from state_store.local import Checkpoint, LocalStore  # noqa: E402

D = 100_000


def start_broker(tmp: Path) -> tuple[str, Path | None]:
    if os.environ.get("PANAGG_KAFKA_BOOTSTRAP"):
        return os.environ["PANAGG_KAFKA_BOOTSTRAP"], None
    state = tmp / "kafka"
    out = subprocess.run([str(ROOT / "deploy/kafka/kafka.sh"), "start", str(state)],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1].split("=", 1)[1], state


def produce(bootstrap: str, topic: str, events: int) -> None:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    admin.close()
    rng = np.random.default_rng(0)
    w = 1 / np.arange(1, D + 1) ** 1.1
    ids = rng.choice(D, size=events, p=w / w.sum())
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, batch_size=512 * 1024,
                             acks=1, compression_type=None)
    for i in ids.tolist():
        producer.send(topic, msgpack.packb({"item": i}))
    producer.flush()
    producer.close()


def bare_consume(bootstrap: str, topic: str, events: int) -> float:
    """Seconds for a plain kafka-python loop to fetch every record and touch its value."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"bare-{uuid.uuid4().hex}",
                             enable_auto_commit=False, auto_offset_reset="earliest",
                             max_poll_records=20000, fetch_max_bytes=64 * 1024 * 1024,
                             max_partition_fetch_bytes=16 * 1024 * 1024)
    seen, nbytes = 0, 0
    t0 = None
    while seen < events:
        polled = consumer.poll(timeout_ms=1000, max_records=20000)
        if t0 is None and polled:
            t0 = time.perf_counter()
        for records in polled.values():
            for r in records:
                nbytes += len(r.value)
            seen += len(records)
    dt = time.perf_counter() - t0
    consumer.close()
    return dt


class _Counting(Source):
    """Wraps a source: starts the clock at the first record, stops the service at ``events``."""

    def __init__(self, inner: Source, events: int, agg_ref: list):
        self.inner, self.events, self.agg_ref = inner, events, agg_ref
        self.t0 = None
        self.t1 = None

    def seek(self, offsets):
        self.inner.seek(offsets)

    def poll(self, timeout_s=1.0):
        segs = self.inner.poll(timeout_s)
        if segs and self.t0 is None:
            self.t0 = time.perf_counter()
        agg = self.agg_ref[0]
        if agg.window["events"] >= self.events and self.t1 is None:
            self.t1 = time.perf_counter()
            agg.stop_event.set()
        return segs

    @property
    def exhausted(self):
        return self.inner.exhausted

    def commit(self, offsets):
        self.inner.commit(offsets)

    def close(self):
        self.inner.close()


def service_run(source: Source, events: int, tmp: Path) -> float:
    state_dir = tmp / f"svc-{uuid.uuid4().hex[:8]}"
    cfg = load_config(None, [f"state.domain_size={D}", "window.kind=count",
                             f"window.size={10 * events}", f"checkpoint.dir={state_dir}",
                             f"release.dir={state_dir}/rel", "metrics.port=-1",
                             "release.on_exhausted=false"], env={})
    ref: list = [None]
    wrapped = _Counting(source, events, ref)
    agg = Aggregator(cfg, wrapped)
    ref[0] = agg
    agg.run(poll_timeout_s=1.0)
    if wrapped.t1 is None:
        wrapped.t1 = time.perf_counter()
    assert agg.window["events"] >= events, agg.window
    return wrapped.t1 - wrapped.t0


def throughput_row(name: str, events: int, bare_t: list, svc_t: list, target: str) -> tuple:
    """Report row from paired timings of the same events: median events/s of the service and of
    the bare loop, and the per-repetition ratio service / bare in events/s (= bare_t / svc_t)."""
    ratios = [b / s for b, s in zip(bare_t, svc_t)]
    return (name, events / statistics.median(svc_t), events / statistics.median(bare_t),
            statistics.median(ratios), min(ratios), max(ratios), target)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="panagg-e2e-") as t:
        tmp = Path(t)
        bootstrap, broker_state = start_broker(tmp)
        try:
            topic = f"e2e-{uuid.uuid4().hex[:8]}"
            print(f"producing {args.events:,} events to {topic} ...", flush=True)
            produce(bootstrap, topic, args.events)
            bare_t, svc_t = [], []
            for rep in range(args.reps):
                b = bare_consume(bootstrap, topic, args.events)
                src = KafkaSource(bootstrap, topic, f"svc-{uuid.uuid4().hex}", 20000)
                s = service_run(src, args.events, tmp)
                bare_t.append(b)
                svc_t.append(s)
                print(f"  rep {rep}: bare {args.events / b:,.0f} ev/s, service "
                      f"{args.events / s:,.0f} ev/s, ratio {b / s:.2f}", flush=True)
            rows.append(throughput_row("Kafka -> counters (service vs bare kafka-python loop)",
                                       args.events, bare_t, svc_t, ">= 0.8x"))
        finally:
            if broker_state is not None:
                subprocess.run([str(ROOT / "deploy/kafka/kafka.sh"), "stop", str(broker_state)],
                               capture_output=True)
        # file source
        path = tmp / "events.msgpack"
        rng = np.random.default_rng(1)
        with open(path, "wb") as f:
            pack = msgpack.Packer().pack
            for chunk in range(0, args.events, 100_000):
                ids = rng.integers(0, D, min(100_000, args.events - chunk))
                f.write(b"".join(pack({"item": i}) for i in ids.tolist()))
        bare_t, svc_t = [], []
        for rep in range(args.reps):
            t0 = time.perf_counter()
            count = sum(1 for _ in msgpack.Unpacker(open(path, "rb"), raw=False))
            b = time.perf_counter() - t0
            assert count == args.events
            s = service_run(FileSource(str(path), "msgpack", batch=20000, progress=False),
                            args.events, tmp)
            bare_t.append(b)
            svc_t.append(s)
            print(f"  file rep {rep}: bare unpack {args.events / b:,.0f} ev/s, service "
                  f"{args.events / s:,.0f} ev/s", flush=True)
        rows.append(throughput_row("msgpack file -> counters (service vs bare msgpack.Unpacker "
                                   "loop)", args.events, bare_t, svc_t, "(report)"))
        # checkpoint time for 10^7 counters
        state = PanPrivateHistogram(1.0, size=10_000_000)
        store = LocalStore(tmp / "ckpt")
        ck, base = [], []
        for rep in range(args.reps):
            t0 = time.perf_counter()
            store.save(Checkpoint(state=state.serialize(), window={"id": 0}, offsets={"p:0": 1}))
            ck.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(tmp / "raw.npy", "wb") as f:
                np.save(f, state.counts)
                f.flush()
                os.fsync(f.fileno())
            base.append(time.perf_counter() - t0)
        ratio = [a / b for a, b in zip(ck, base)]
        rows.append(("checkpoint of 10^7 counters (LocalStore.save vs np.save + fsync)",
                     statistics.median(ck), statistics.median(base), statistics.median(ratio),
                     min(ratio), max(ratio), "(report)"))
    lines = ["# End-to-end throughput", "",
             f"Command: `.venv/bin/python -m bench.e2e --events {args.events} --reps {args.reps}` "
             f"({time.strftime('%Y-%m-%d %H:%M')}, 2-core machine; broker on loopback, same run).",
             "", "| measured | ours | baseline | ratio median (min..max) | target |",
             "|---|---|---|---|---|"]
    for name, ours, basev, med, lo, hi, target in rows:
        unit = "ev/s" if "counters" in name and "checkpoint" not in name else "s"
        fmt = (lambda v: f"{v:,.0f} {unit}") if unit == "ev/s" else (lambda v: f"{v:.3f} {unit}")
        lines.append(f"| {name} | {fmt(ours)} | {fmt(basev)} | {med:.2f} ({lo:.2f}..{hi:.2f}) | {target} |")
    lines += ["", "For throughput rows the ratio is service events/s divided by baseline events/s "
              "(1.0 = as fast as the bare loop); for the checkpoint row it is our time divided "
              "by the baseline's (smaller is better)."]
    (ROOT / "docs" / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
