"""End-to-end throughput of the service, as ratios measured in one run, with the machine's state.

    python -m bench.service.e2e [--events 1000000] [--reps 3] [--kafka-only] [--no-crc32c]
                        [--clients kafka-python,confluent] [--topic NAME] [--section NAME]
                        [--cprofile PATH]

1. Kafka: the service (decode -> count -> checkpoints, in-process Aggregator on the same
   KafkaSource the CLI builds, with the config's client settings) against a bare kafka-python
   consume loop over the same topic with the same client settings, alternating, each with a
   fresh consumer group. Both clocks start when the first records arrive (group join and the first
   fetch are left out of both) and stop once the last record is handled: the bare loop's after
   touching the last value, the service's at the first turn of its loop after counting the last
   event (the turn's lag, metrics and control checks included; the poll that would wait for
   records that are not there is not). Every repetition records the 1-minute load average before
   and after each run, and the bare loop's absolute events/s beside the ratio: a ratio measured on
   a slow baseline (a loaded machine) says little about the service's own speed.
2. File source: the service replaying a msgpack file, against a bare msgpack read of the file.
3. Checkpoint of a 10^7-counter state (LocalStore.save: serialize + fsync + rename) against
   np.save of the same int64 array plus fsync.
Each client of ``source.client`` is measured the same way against its own bare loop (kafka-python:
``poll``; confluent-kafka: ``consume(num_messages)``), and the confluent service against the
kafka-python service on the same backlog.
Scale-out throughput (several ``panagg run`` members of one group) is
``python -m bench.service.group --throughput``.

``--no-crc32c`` hides the ``crc32c`` package from kafka-python (it then checks record batches
with its pure-Python CRC-32C): the dependency's effect, measured. ``--topic`` reuses a topic that
already holds at least ``--events`` records (no producing: for profiling). ``--cprofile`` writes
a cProfile of the last service run.

A broker comes from $PANAGG_KAFKA_BOOTSTRAP or is started with deploy/kafka/kafka.sh. Writes its
tables into docs/e2e.md between ``<!-- bench.service.e2e NAME begin/end -->`` markers
(``--section``, default ``latest``), leaving the rest of the page as it is; prints them too.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if "--no-crc32c" in sys.argv:  # before kafka-python is imported anywhere: it looks once
    sys.modules["crc32c"] = None

import msgpack  # noqa: E402
import numpy as np  # noqa: E402


from aggregator.service.config import load_config  # noqa: E402
from aggregator.service import Aggregator  # noqa: E402
from aggregator.state import PanPrivateHistogram  # noqa: E402
from consumers.base import Source  # noqa: E402
from consumers.file_source import FileSource  # noqa: E402
from consumers.kafka.kafka_python import KafkaSource  # noqa: E402
from state_store.local import Checkpoint, LocalStore  # noqa: E402

from bench.harness import ROOT, cpu_model, git_rev, parser, versions, write_doc_section  # noqa: E402

D = 100_000
DOC = ROOT / "docs" / "e2e.md"


def load1() -> float:
    return os.getloadavg()[0]


def crc32c_active() -> bool:
    """Whether kafka-python checks record batches with the C crc32c (not its Python loop)."""
    from kafka.record import util

    return getattr(util, "crc32c_c", None) is not None and util._crc32c is util.crc32c_c


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "crc32c": crc32c_active(),
        "versions": versions(["kafka-python", "crc32c", "msgpack", "numpy", "confluent-kafka"]),
        "rev": git_rev(["aggregator", "consumers", "bench/service/e2e.py"]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def start_broker(tmp: Path) -> tuple[str, Path | None]:
    if os.environ.get("PANAGG_KAFKA_BOOTSTRAP"):
        return os.environ["PANAGG_KAFKA_BOOTSTRAP"], None
    state = tmp / "kafka"
    out = subprocess.run(
        [str(ROOT / "deploy/kafka/kafka.sh"), "start", str(state)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1].split("=", 1)[1], state


def stop_broker(state: Path | None) -> None:
    """Stop the broker :func:`start_broker` started (None: the environment's, left running)."""
    if state is not None:
        subprocess.run(
            [str(ROOT / "deploy/kafka/kafka.sh"), "stop", str(state)],
            capture_output=True,
            timeout=120,
        )


def produce(bootstrap: str, topic: str, events: int, partitions: int = 3) -> None:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    admin.close()
    rng = np.random.default_rng(0)
    w = 1 / np.arange(1, D + 1) ** 1.1
    ids = rng.choice(D, size=events, p=w / w.sum())
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        linger_ms=50,
        batch_size=512 * 1024,
        acks=1,
        compression_type=None,
    )
    for i in ids.tolist():
        producer.send(topic, msgpack.packb({"item": i}))
    producer.flush()
    producer.close()


def client_settings(cfg: dict) -> dict:
    """The kafka-python settings the service's source runs with (from the config, as the CLI)."""
    src = cfg.source
    return {
        "max_poll_records": src.max_records,
        "fetch_max_bytes": src.fetch_max_bytes,
        "max_partition_fetch_bytes": src.max_partition_fetch_bytes,
    }


def bare_consume_confluent(
    bootstrap: str, topic: str, events: int, settings: dict
) -> tuple[float, float]:
    """The same bare loop on confluent-kafka (librdkafka): ``consume(num_messages)`` batches,
    every value touched."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bare-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": settings["fetch_max_bytes"],
            "max.partition.fetch.bytes": settings["max_partition_fetch_bytes"],
            "queued.max.messages.kbytes": settings["fetch_max_bytes"] // 1024,
            "queued.min.messages": settings["max_poll_records"],
        }
    )
    consumer.subscribe([topic])
    seen, nbytes = 0, 0
    t0 = None
    while seen < events:
        msgs = consumer.consume(num_messages=settings["max_poll_records"], timeout=1.0)
        if t0 is None and msgs:
            t0, c0 = time.perf_counter(), time.process_time()
        for m in msgs:
            if m.error() is None:
                nbytes += len(m.value())
                seen += 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    consumer.close()
    return dt, cpu


def bare_consume(bootstrap: str, topic: str, events: int, settings: dict) -> tuple[float, float]:
    """Seconds (wall, and CPU of the process: all its threads) for a plain kafka-python loop to
    fetch every record and touch its value."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bare-{uuid.uuid4().hex}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **settings,
    )
    seen, nbytes = 0, 0
    t0 = None
    while seen < events:
        polled = consumer.poll(timeout_ms=1000, max_records=settings["max_poll_records"])
        if t0 is None and polled:
            t0, c0 = time.perf_counter(), time.process_time()
        for records in polled.values():
            for r in records:
                nbytes += len(r.value)
            seen += len(records)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    consumer.close()
    return dt, cpu


class TimedSource(Source):
    """Wraps a source for a throughput run: the clock starts at the first record delivered and
    stops at the first poll after ``done(self)`` holds (every record delivered before it has been
    counted by then), which calls ``stop()`` to end the service and returns no more records.
    ``delivered`` counts the records handed out, for a ``done`` that needs it."""

    def __init__(self, inner: Source, done, stop):
        self.inner, self.done, self.stop = inner, done, stop
        self.delivered = 0
        self.t0 = self.t1 = self.c0 = self.c1 = None

    def seek(self, offsets):
        self.inner.seek(offsets)

    def poll(self, timeout_s=1.0):
        if self.done(self):
            if self.t1 is None:
                self.t1, self.c1 = time.perf_counter(), time.process_time()
                self.stop()
            return []
        segs = self.inner.poll(timeout_s)
        if segs and self.t0 is None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.delivered += sum(len(s) for s in segs)
        return segs

    def __getattr__(self, name):  # lag, connected, caught_up, assigned ... of the inner source
        return getattr(self.inner, name)

    @property
    def exhausted(self):
        return self.inner.exhausted

    def commit(self, offsets, metadata=""):  # metadata: the ledger's anchor (Source.commit)
        self.inner.commit(offsets, metadata)

    def lag(self, positions=None):
        return self.inner.lag(positions)

    def close(self):
        self.inner.close()


def service_config(events: int, state_dir: Path, extra=()) -> dict:
    return load_config(
        None,
        [
            f"state.domain_size={D}",
            "window.kind=count",
            f"window.size={10 * events}",
            f"checkpoint.dir={state_dir}",
            f"release.dir={state_dir}/rel",
            "metrics.port=-1",
            "release.on_exhausted=false",
            # repetitions over one topic on purpose (no release is drawn, but
            # the registry's reads are not what this bench measures)
            "ledger.registry_topic=",
            *extra,
        ],
        env={},
    )


#: extra ``--set`` pairs of every service run (``--no-plan``: release.plan_errors=false)
SERVICE_SETS: list[str] = []


def service_run(
    make_source, events: int, tmp: Path, profile: str | None = None
) -> tuple[float, float]:
    """Seconds (wall, CPU of the process) for the service to count ``events`` records."""
    state_dir = tmp / f"svc-{uuid.uuid4().hex[:8]}"
    cfg = service_config(events, state_dir, SERVICE_SETS)
    ref: list = [None]
    wrapped = TimedSource(
        make_source(cfg),
        lambda _: ref[0].task.window["events"] >= events,
        lambda: ref[0].stop_event.set(),
    )
    agg = Aggregator(cfg, wrapped)
    ref[0] = agg
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(agg.run, poll_timeout_s=1.0)
        prof.dump_stats(profile)
    else:
        agg.run(poll_timeout_s=1.0)
    if wrapped.t1 is None:
        wrapped.t1, wrapped.c1 = time.perf_counter(), time.process_time()
    assert agg.task.window["events"] >= events, agg.task.window
    return wrapped.t1 - wrapped.t0, wrapped.c1 - wrapped.c0


def kafka_source(bootstrap: str, topic: str, client: str = "kafka-python"):
    def make(cfg):
        src = cfg.source
        if client == "confluent":
            from consumers.kafka.confluent import ConfluentSource

            return ConfluentSource(
                bootstrap,
                topic,
                f"svc-{uuid.uuid4().hex}",
                src.max_records,
                fetch_max_bytes=src.fetch_max_bytes,
                max_partition_fetch_bytes=src.max_partition_fetch_bytes,
            )
        return KafkaSource(
            bootstrap,
            topic,
            f"svc-{uuid.uuid4().hex}",
            src.max_records,
            consumer_config={
                "fetch_max_bytes": src.fetch_max_bytes,
                "max_partition_fetch_bytes": src.max_partition_fetch_bytes,
            },
        )

    return make


def throughput_row(name: str, events: int, bare_t: list, svc_t: list, target: str) -> tuple:
    """Report row from paired timings of the same events: median events/s of the service and of
    the bare loop, and the per-repetition ratio service / bare in events/s (= bare_t / svc_t)."""
    ratios = [b / s for b, s in zip(bare_t, svc_t)]
    return (
        name,
        events / statistics.median(svc_t),
        events / statistics.median(bare_t),
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        target,
    )


def kafka_reps(
    bootstrap: str, topic: str, args, tmp: Path, client: str = "kafka-python"
) -> list[dict]:
    settings = client_settings(service_config(args.events, tmp / "probe"))
    bare = bare_consume_confluent if client == "confluent" else bare_consume
    reps = []
    for rep in range(args.reps):
        r = {"load_bare": [load1()]}
        r["bare_s"], r["bare_cpu"] = bare(bootstrap, topic, args.events, settings)
        r["load_bare"].append(load1())
        r["load_svc"] = [load1()]
        last = rep == args.reps - 1
        r["svc_s"], r["svc_cpu"] = service_run(
            kafka_source(bootstrap, topic, client),
            args.events,
            tmp,
            profile=args.cprofile if last else None,
        )
        r["load_svc"].append(load1())
        reps.append(r)
        print(
            f"  {client} rep {rep}: bare {args.events / r['bare_s']:,.0f} ev/s (load "
            f"{r['load_bare'][0]:.2f}->{r['load_bare'][1]:.2f}), service "
            f"{args.events / r['svc_s']:,.0f} ev/s (load {r['load_svc'][0]:.2f}->"
            f"{r['load_svc'][1]:.2f}), ratio {r['bare_s'] / r['svc_s']:.2f}, CPU ratio "
            f"{r['bare_cpu'] / r['svc_cpu']:.2f}",
            flush=True,
        )
    return reps


def kafka_lines(
    events: int, reps: list[dict], settings: dict, client: str = "kafka-python"
) -> list[str]:
    lines = [
        f"| rep | bare {client} ev/s | load before -> after | service ev/s | "
        "load before -> after | ratio | CPU µs/event bare, service | CPU ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(reps):
        lines.append(
            f"| {i} | {events / r['bare_s']:,.0f} | {r['load_bare'][0]:.2f} -> "
            f"{r['load_bare'][1]:.2f} | {events / r['svc_s']:,.0f} | "
            f"{r['load_svc'][0]:.2f} -> {r['load_svc'][1]:.2f} | "
            f"{r['bare_s'] / r['svc_s']:.2f} | {1e6 * r['bare_cpu'] / events:.2f}, "
            f"{1e6 * r['svc_cpu'] / events:.2f} | {r['bare_cpu'] / r['svc_cpu']:.2f} |"
        )
    row = throughput_row("", events, [r["bare_s"] for r in reps], [r["svc_s"] for r in reps], "")
    cpu = [r["bare_cpu"] / r["svc_cpu"] for r in reps]
    loads = [x for r in reps for x in r["load_bare"] + r["load_svc"]]
    lines += [
        "",
        f"Median: service **{row[1]:,.0f} ev/s**, bare loop **{row[2]:,.0f} ev/s**, "
        f"ratio **{row[3]:.2f}** ({row[4]:.2f}..{row[5]:.2f}); 1-minute load average "
        f"{min(loads):.2f}..{max(loads):.2f} during the runs; CPU ratio (bare CPU seconds "
        f"over the service's, all threads of the process) {statistics.median(cpu):.2f}. "
        "Client settings of both: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + ".",
    ]
    return lines


def cross_line(events: int, by_client: dict) -> str:
    """The confluent service against the kafka-python service on the same backlog (paired by
    repetition), and CPU per event of each."""
    kp, cf = by_client["kafka-python"], by_client["confluent"]
    speed = [a["svc_s"] / b["svc_s"] for a, b in zip(kp, cf)]
    cpu = [b["svc_cpu"] / a["svc_cpu"] for a, b in zip(kp, cf)]
    return (
        f"confluent service over kafka-python service (events/s, same backlog, per "
        f"repetition): median **{statistics.median(speed):.2f}x** ({min(speed):.2f}.."
        f"{max(speed):.2f}; target >= 2.5x); CPU per event, confluent over kafka-python: "
        f"{statistics.median(cpu):.2f}."
    )


def write_section(name: str, lines: list[str]) -> None:
    write_doc_section(DOC, "bench.service.e2e", name, lines, title="End-to-end throughput")


def main(argv=None) -> None:
    ap = parser(__doc__, "--events 2000 --reps 1 --no-write")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kafka-only", action="store_true", help="skip the file and checkpoint rows")
    ap.add_argument(
        "--no-plan",
        action="store_true",
        help="release.plan_errors = false: leave out the start's simulated accuracy "
        "plan (a one-time CPU cost that overlaps the first seconds of intake)",
    )
    ap.add_argument(
        "--clients",
        default="kafka-python,confluent",
        help="comma-separated Kafka clients to measure (kafka-python, confluent)",
    )
    ap.add_argument(
        "--no-crc32c",
        action="store_true",
        help="hide the crc32c package from kafka-python (its pure-Python fallback)",
    )
    ap.add_argument("--topic", help="reuse this topic (it holds >= --events records)")
    ap.add_argument("--section", default="latest", help="name of the block in docs/e2e.md")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--cprofile", help="cProfile of the last service run to this file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.events, args.reps, args.no_write = 2000, 1, True
    if args.no_plan:
        SERVICE_SETS.append("release.plan_errors=false")
    m = machine()
    cmd = "python -m bench.service.e2e " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd}` ({m['when']}; {m['cpus']} CPUs, {m['cpu']}; {m['versions']}; "
        f"kafka-python's CRC-32C: {'C (crc32c package)' if m['crc32c'] else 'pure Python'}"
        f"; git {m['rev']}; broker on loopback). Load average at start: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + ".",
        "",
    ]
    print(lines[0], flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="panagg-e2e-") as t:
        tmp = Path(t)
        bootstrap, broker_state = start_broker(tmp)
        try:
            topic = args.topic or f"e2e-{uuid.uuid4().hex[:8]}"
            if not args.topic:
                print(f"producing {args.events:,} events to {topic} ...", flush=True)
                produce(bootstrap, topic, args.events)
            settings = client_settings(service_config(args.events, tmp / "probe"))
            by_client = {}
            for client in args.clients.split(","):
                by_client[client] = reps = kafka_reps(bootstrap, topic, args, tmp, client)
                target = (
                    "target >= 0.9x idle, >= 0.8x loaded"
                    if client == "kafka-python"
                    else "target >= 0.8x"
                )
                lines += [
                    f'Kafka -> counters on {client} (`source.client = "{client}"`), '
                    f"service vs a bare {client} loop ({target}):",
                    "",
                    *kafka_lines(args.events, reps, settings, client),
                    "",
                ]
            if len(by_client) == 2:
                lines += [cross_line(args.events, by_client), ""]
        finally:
            stop_broker(broker_state)
        if not args.kafka_only:
            rows += other_rows(args, tmp)
    if rows:
        lines += ["| measured | ours | baseline | ratio median (min..max) |", "|---|---|---|---|"]
        for name, ours, basev, med, lo, hi, _ in rows:
            unit = "ev/s" if "counters" in name and "checkpoint" not in name else "s"
            f = (lambda v: f"{v:,.0f} {unit}") if unit == "ev/s" else (lambda v: f"{v:.3f} {unit}")
            lines.append(f"| {name} | {f(ours)} | {f(basev)} | {med:.2f} ({lo:.2f}..{hi:.2f}) |")
        lines += [
            "",
            "File row: service events/s over bare events/s (1.0 = as fast as the bare "
            "loop); checkpoint row: our time over the baseline's (smaller is better).",
        ]
    lines += [
        "",
        "Load average at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + ".",
    ]
    if not args.no_write:
        write_section(args.section, lines)
    print("\n".join(lines))


def other_rows(args, tmp: Path) -> list[tuple]:
    rows = []
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
        s, _ = service_run(
            lambda cfg: FileSource(str(path), "msgpack", batch=20000, progress=False),
            args.events,
            tmp,
        )
        bare_t.append(b)
        svc_t.append(s)
        print(
            f"  file rep {rep}: bare unpack {args.events / b:,.0f} ev/s, service "
            f"{args.events / s:,.0f} ev/s",
            flush=True,
        )
    rows.append(
        throughput_row(
            "msgpack file -> counters (service vs bare msgpack.Unpacker loop)",
            args.events,
            bare_t,
            svc_t,
            "(report)",
        )
    )
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
    rows.append(
        (
            "checkpoint of 10^7 counters (LocalStore.save vs np.save + fsync)",
            statistics.median(ck),
            statistics.median(base),
            statistics.median(ratio),
            min(ratio),
            max(ratio),
            "(report)",
        )
    )
    return rows


if __name__ == "__main__":
    main()
