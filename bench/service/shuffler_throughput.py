"""Shuffler throughput against a bare kafka-python consume-produce loop, in one run.

    python -m bench.service.shuffler_throughput [--events 30000] [--n 10000] [--buckets 100]
                                        [--epsilon 1] [--reps 3] [--no-doc] [--section NAME]
    python -m bench.service.shuffler_throughput --analyzer [--events 30000] [--n 10000]
                                                [--buckets 200]

``--analyzer`` (issue 31): the same client records go through the shuffler once (timed: the
shuffler's events/s in this run), then, alternating per repetition, the analyzer
(:class:`aggregator.service.analyzer.ShuffleAnalyzer` in-process on the Kafka source, a fresh
state directory and group each time, ``release.estimator = threshold`` and no error bars so the
clock measures reading and decrypting) reads the shuffled windows with its decryption in its own
process only (``PANAGG_SHUFFLE_DECRYPT_WORKERS=0``: the pre-issue-31 path, one box at a time)
and with the default helper processes (CPUs - 1). Clock: first poll to the last window decided.

One client topic (3 partitions) is filled once with ``--events`` sealed client records
(:class:`ShuffleClient`, GKMP with the given epsilon, n, B, delta 1e-6). Then, alternating, each
with a fresh consumer group and a fresh one-partition output topic:

* **bare**: a kafka-python consumer and producer (the shuffler's producer settings: acks=all,
  linger 5 ms) forwarding every record's value to the output topic, then ``flush``;
* **bare txn**: the same loop in Kafka transactions of n records with the consumed offsets
  (``send_offsets_to_transaction``): what exactly-once costs by itself;
* **bare batched**: the bare loop producing one output record per ~5,000 boxes' worth of input
  values (concatenated), as the shuffler chunks its output: kafka-python's per-record produce
  cost taken out, what is left of the difference is the shuffler's own work;
* **shuffler**: :class:`aggregator.service.shuffler.Shuffler` in-process (the code behind
  ``panagg shuffle``): parse and dedupe every record, collect windows of n events, permute every
  box of a window with the OS CSPRNG, write chunks and the end marker, commit each window in a
  transaction with its offsets and the state file.

Clocks: client creation (group coordinator, ``init_transactions``) is outside; each clock runs
from the first poll until the last output is acknowledged (``flush``/``commit_transaction``).
events/s = client records / time, messages/s = sealed boxes / time (the same records in all
four). The ratio is the shuffler's events/s over the bare loop's in the same repetition.

A broker comes from $PANAGG_KAFKA_BOOTSTRAP or is started with deploy/kafka/kafka.sh. Writes its
table into docs/shuffle.md between ``<!-- bench.service.shuffler_throughput NAME begin/end -->``
markers (``--section``, default ``latest``; inside the section "## Shuffler throughput"),
leaving the rest of the page as it is.
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

import numpy as np


from aggregator.service.config import load_config  # noqa: E402
from aggregator.service.shuffle_client import ShuffleClient  # noqa: E402
from aggregator.service.shuffle_wire import new_keypair, public_key_hex  # noqa: E402
from aggregator.service.shuffler import CHUNK_BOXES, Shuffler  # noqa: E402
from bench.harness import ROOT, cpu_model, git_rev, parser, versions, write_doc_section  # noqa: E402

DOC = ROOT / "docs" / "shuffle.md"
PRODUCER = dict(acks="all", linger_ms=5, max_request_size=16 * 1024 * 1024)


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


def create(bootstrap, name, partitions):
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    admin.close()


def fill(bootstrap, topic, records):
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, **PRODUCER)
    for k, v in records:
        p.send(topic, key=k, value=v)
    p.flush()
    p.close()


def bare_batched(bootstrap, topic, events, per_record: int) -> float:
    """The bare loop producing like the shuffler: one output record per ``per_record`` input
    values (their bytes concatenated), so the difference is the shuffler's own work."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    out = f"bare-{uuid.uuid4().hex[:8]}"
    create(bootstrap, out, 1)
    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=f"bare-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    tps = [TopicPartition(topic, q) for q in sorted(c.partitions_for_topic(topic))]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    p = KafkaProducer(bootstrap_servers=bootstrap, **PRODUCER)
    got = 0
    pend: list = []
    t0 = time.perf_counter()
    while got < events:
        for recs in c.poll(timeout_ms=200, max_records=5000).values():
            for r in recs:
                pend.append(r.value)
                got += 1
                if len(pend) >= per_record:
                    p.send(out, value=b"".join(pend), partition=0)
                    pend = []
    if pend:
        p.send(out, value=b"".join(pend), partition=0)
    p.flush()
    dt = time.perf_counter() - t0
    c.close()
    p.close()
    return dt


def bare(bootstrap, topic, events, n, transactional: bool) -> float:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    out = f"bare-{uuid.uuid4().hex[:8]}"
    create(bootstrap, out, 1)
    group = f"bare-{uuid.uuid4().hex[:8]}"
    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    tps = [TopicPartition(topic, q) for q in sorted(c.partitions_for_topic(topic))]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    extra = {"transactional_id": group} if transactional else {}
    p = KafkaProducer(bootstrap_servers=bootstrap, **PRODUCER, **extra)
    if transactional:
        p.init_transactions()
    got = in_txn = 0
    ends: dict = {}
    t0 = time.perf_counter()
    if transactional:
        p.begin_transaction()
    while got < events:
        for tp, recs in c.poll(timeout_ms=200, max_records=5000).items():
            for r in recs:
                p.send(out, value=r.value, partition=0)
                ends[tp.partition] = r.offset + 1
                got += 1
                in_txn += 1
                if transactional and in_txn == n:
                    p.send_offsets_to_transaction(
                        {
                            TopicPartition(topic, q): OffsetAndMetadata(o, "", -1)
                            for q, o in ends.items()
                        },
                        group,
                    )
                    p.commit_transaction()
                    p.begin_transaction()
                    in_txn = 0
    if transactional:
        p.commit_transaction()
    else:
        p.flush()
    dt = time.perf_counter() - t0
    c.close()
    p.close()
    return dt


def shuffler(
    bootstrap, topic, pub, events, n, epsilon, buckets, tmp, out: str | None = None
) -> tuple[float, dict]:
    out = out or f"analyzer-{uuid.uuid4().hex[:8]}"
    create(bootstrap, out, 1)
    cfg = load_config(
        None,
        [
            f"source.bootstrap={bootstrap}",
            f"source.topic={out}",
            "state.model=shuffle",
            f"state.epsilon={epsilon}",
            f"state.domain_size={buckets}",
            f"window.size={n}",
            f"shuffle.public_key={pub}",
            f"shuffle.client_topic={topic}",
            f"shuffle.group=sh-{uuid.uuid4().hex[:8]}",
            f"checkpoint.dir={tmp / uuid.uuid4().hex[:8]}",
            "metrics.port=-1",
        ],
        env={},
    )
    sh = Shuffler(cfg)
    sh._clients()
    t0 = time.perf_counter()
    try:
        sh._loop(None, events // n, None)
    finally:
        dt = time.perf_counter() - t0
        sh.close()
    return dt, sh.stats


def analyzer(
    bootstrap, topic, key, windows, n, epsilon, buckets, tmp, workers: int | None
) -> tuple[float, dict]:
    """The analyzer reading ``windows`` shuffled windows of ``topic``; (seconds from the first
    poll to the last window decided, totals)."""
    from aggregator.service.analyzer import ShuffleAnalyzer
    from aggregator.service.cli import _make_source
    from aggregator.service.shuffle_wire import WORKERS_ENV

    if workers is None:
        os.environ.pop(WORKERS_ENV, None)
    else:
        os.environ[WORKERS_ENV] = str(workers)
    d = tmp / uuid.uuid4().hex[:8]
    cfg = load_config(
        None,
        [
            f"source.bootstrap={bootstrap}",
            f"source.topic={topic}",
            "state.model=shuffle",
            f"state.epsilon={epsilon}",
            f"state.domain_size={buckets}",
            f"window.size={n}",
            f"checkpoint.dir={d / 'state'}",
            f"release.dir={d / 'releases'}",
            "metrics.port=-1",
            f"source.group=an-{uuid.uuid4().hex[:8]}",
            "release.error_bar_reps=0",
            "release.estimator=threshold",
        ],
        env={},
    )
    src = _make_source(cfg)
    an = ShuffleAnalyzer(cfg, src, private_key=key)
    clock: dict = {}
    poll = src.poll

    def timed_poll(timeout):
        clock.setdefault("first", time.perf_counter())
        return poll(timeout)

    src.poll = timed_poll
    decided = an._next_window

    def timed_next(k):
        decided(k)
        if an.totals["windows"] >= windows:
            clock["last"] = time.perf_counter()
            an.stop_event.set()

    an._next_window = timed_next
    an.run()
    released = len(list((d / "releases").glob("release-*.json")))
    return clock["last"] - clock["first"], dict(
        an.totals, released=released, workers=an.opener.workers
    )


def analyzer_main(args) -> int:
    events = args.events - args.events % args.n
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bootstrap, state = start_broker(tmp)
        try:
            key = new_keypair()
            pub = public_key_hex(key)
            cfg = load_config(
                None,
                [
                    "state.model=shuffle",
                    f"state.epsilon={args.epsilon}",
                    f"state.domain_size={args.buckets}",
                    f"window.size={args.n}",
                    f"shuffle.public_key={pub}",
                    "source.topic=x",
                ],
                env={},
            )
            client = ShuffleClient.from_config(cfg)
            rng = np.random.default_rng(1)
            records = []
            for i in range(0, events, 2000):
                records += client.records(rng.integers(0, args.buckets, min(2000, events - i)))
            import msgpack

            boxes = sum(len(msgpack.unpackb(v)["boxes"]) for _, v in records)
            topic = f"clients-{uuid.uuid4().hex[:8]}"
            create(bootstrap, topic, 3)
            fill(bootstrap, topic, records)
            shuffled = f"analyzer-{uuid.uuid4().hex[:8]}"
            ts, stats = shuffler(
                bootstrap, topic, pub, events, args.n, args.epsilon, args.buckets, tmp, out=shuffled
            )
            assert stats["events"] == events and stats["messages"] == boxes, stats
            windows = events // args.n
            print(
                f"{events} events, {boxes} messages ({boxes / events:.1f}/event); shuffler "
                f"{events / ts:,.0f} events/s",
                flush=True,
            )
            rows = []
            for rep in range(args.reps):
                la0 = loadavg()
                t1, s1 = analyzer(
                    bootstrap, shuffled, key, windows, args.n, args.epsilon, args.buckets, tmp, 0
                )
                tw, sw = analyzer(
                    bootstrap, shuffled, key, windows, args.n, args.epsilon, args.buckets, tmp, None
                )
                for s_ in (s1, sw):
                    assert s_["released"] == windows and s_["events"] == events, s_
                rows.append((t1, tw, sw["workers"], la0, loadavg()))
                print(
                    f"rep {rep + 1}: analyzer alone {events / t1:,.0f} ev/s, with "
                    f"{sw['workers']} helper(s) {events / tw:,.0f} ev/s: {t1 / tw:.2f}x",
                    flush=True,
                )
        finally:
            if state is not None:
                subprocess.run(
                    [str(ROOT / "deploy/kafka/kafka.sh"), "stop", str(state)], capture_output=True
                )
    speed = [t1 / tw for t1, tw, *_ in rows]
    lines = [
        f"`python -m bench.service.shuffler_throughput --analyzer --events {args.events} "
        f"--n {args.n} "
        f"--buckets {args.buckets} --epsilon {args.epsilon:g} --reps {args.reps}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{git_rev(['aggregator', 'bench/service/shuffler_throughput.py'])}; "
        f"{os.cpu_count()} CPUs, "
        f"{cpu_model()}; {versions(['kafka-python', 'PyNaCl', 'msgpack', 'numpy'])}; "
        "single-node broker on loopback, the same machine):",
        "",
        f"GKMP, eps {args.epsilon:g}, delta 1e-6, n = {args.n:,} events per window, B = "
        f"{args.buckets:,}: {events:,} events in {windows} windows, {boxes:,} sealed messages "
        f"({boxes / events:.1f} per event). The shuffler moved them at **{events / ts:,.0f} "
        f"events/s** ({boxes / ts:,.0f} messages/s) in this run.",
        "",
        "| rep | analyzer, decryption in its process: events/s (messages/s, s per window) | "
        "with helper processes: events/s (messages/s, s per window) | helpers | speed-up | "
        "load avg before, after |",
        "|---|---|---|---|---|---|",
    ]
    for i, (t1, tw, w, la0, la1) in enumerate(rows):
        lines.append(
            f"| {i + 1} | {events / t1:,.0f} ({boxes / t1:,.0f}, {t1 / windows:.2f}) | "
            f"{events / tw:,.0f} ({boxes / tw:,.0f}, {tw / windows:.2f}) | {w} | "
            f"{t1 / tw:.2f}x | {la0:.1f}, {la1:.1f} |"
        )
    lines += [
        "",
        f"Speed-up of the helper processes: median **{statistics.median(speed):.2f}x** "
        f"({min(speed):.2f}-{max(speed):.2f}).",
    ]
    print("\n".join(lines))
    if not args.no_doc:
        write_doc_section(DOC, "bench.service.shuffler_throughput", args.section, lines)
    return 0


def loadavg() -> float:
    return os.getloadavg()[0]


def main(argv=None) -> int:
    ap = parser(__doc__, "--events 2000 --n 1000 --reps 1 --no-doc")
    ap.add_argument("--events", type=int, default=30_000)
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--buckets", type=int, default=100)
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--section", default="latest", help="doc block name (several configurations)")
    ap.add_argument("--analyzer", action="store_true", help="the analyzer's throughput (issue 31)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.events, args.n, args.reps, args.no_doc = 2000, 1000, 1, True
    if args.analyzer:
        return analyzer_main(args)
    events = args.events - args.events % args.n
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bootstrap, state = start_broker(tmp)
        try:
            key = new_keypair()
            pub = public_key_hex(key)
            cfg = load_config(
                None,
                [
                    "state.model=shuffle",
                    f"state.epsilon={args.epsilon}",
                    f"state.domain_size={args.buckets}",
                    f"window.size={args.n}",
                    f"shuffle.public_key={pub}",
                    "source.topic=x",
                ],
                env={},
            )
            client = ShuffleClient.from_config(cfg)
            rng = np.random.default_rng(1)
            t0 = time.perf_counter()
            records = []
            for i in range(0, events, 2000):
                records += client.records(rng.integers(0, args.buckets, min(2000, events - i)))
            gen_s = time.perf_counter() - t0
            import msgpack

            boxes = sum(len(msgpack.unpackb(v)["boxes"]) for _, v in records)
            mb = sum(len(v) + len(k) for k, v in records) / 1e6
            topic = f"clients-{uuid.uuid4().hex[:8]}"
            create(bootstrap, topic, 3)
            fill(bootstrap, topic, records)
            print(
                f"{events} events, {boxes} messages ({boxes / events:.1f}/event, {mb:.0f} MB), "
                f"generated by the clients in {gen_s:.1f} s",
                flush=True,
            )
            rows = []
            for rep in range(args.reps):
                la0 = loadavg()
                tb = bare(bootstrap, topic, events, args.n, False)
                tt = bare(bootstrap, topic, events, args.n, True)
                tc = bare_batched(
                    bootstrap, topic, events, max(1, round(CHUNK_BOXES * events / boxes))
                )
                ts, stats = shuffler(
                    bootstrap, topic, pub, events, args.n, args.epsilon, args.buckets, tmp
                )
                assert stats["events"] == events and stats["messages"] == boxes, stats
                rows.append((tb, tt, tc, ts, la0, loadavg()))
                print(
                    f"rep {rep + 1}: bare {events / tb:,.0f} ev/s, bare txn {events / tt:,.0f} "
                    f"ev/s, bare batched {events / tc:,.0f} ev/s, shuffler {events / ts:,.0f} "
                    f"ev/s: ratio {tb / ts:.2f}",
                    flush=True,
                )
        finally:
            if state is not None:
                subprocess.run(
                    [str(ROOT / "deploy/kafka/kafka.sh"), "stop", str(state)], capture_output=True
                )
    lines = table(args, events, boxes, mb, rows)
    print("\n".join(lines))
    if not args.no_doc:
        write_doc_section(DOC, "bench.service.shuffler_throughput", args.section, lines)
    return 0


def table(args, events, boxes, mb, rows) -> list[str]:
    ratios = [tb / ts for tb, _tt, _tc, ts, *_ in rows]
    tratios = [tt / ts for _tb, tt, _tc, ts, *_ in rows]
    cratios = [tc / ts for _tb, _tt, tc, ts, *_ in rows]
    out = [
        f"`python -m bench.service.shuffler_throughput --events {args.events} --n {args.n} "
        f"--buckets {args.buckets} --epsilon {args.epsilon:g} --reps {args.reps}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{git_rev(['aggregator', 'bench/service/shuffler_throughput.py'])}; "
        f"{os.cpu_count()} CPUs, {cpu_model()}; "
        f"{versions(['kafka-python', 'PyNaCl', 'msgpack', 'numpy'])}; "
        "single-node broker on loopback, the same machine):",
        "",
        f"GKMP, eps {args.epsilon:g}, delta 1e-6, n = {args.n:,} events per window, B = "
        f"{args.buckets:,}: {events:,} events in {events // args.n} windows, {boxes:,} sealed "
        f"messages ({boxes / events:.1f} per event), {mb:.0f} MB of client records.",
        "",
        "| rep | bare loop events/s (messages/s) | bare, in transactions | bare, batched like "
        "the shuffler | shuffler events/s (messages/s) | shuffler / bare | / bare txn | "
        "/ bare batched | load avg before, after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (tb, tt, tc, ts, la0, la1) in enumerate(rows):
        out.append(
            f"| {i + 1} | {events / tb:,.0f} ({boxes / tb:,.0f}) | {events / tt:,.0f} | "
            f"{events / tc:,.0f} | {events / ts:,.0f} ({boxes / ts:,.0f}) | {tb / ts:.2f} | "
            f"{tt / ts:.2f} | {tc / ts:.2f} | {la0:.1f}, {la1:.1f} |"
        )
    out += [
        "",
        f"Shuffler / bare loop (events/s, the same records): median "
        f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}); against "
        f"the bare loop in transactions {statistics.median(tratios):.2f}x, against the bare "
        f"loop batching its output like the shuffler {statistics.median(cratios):.2f}x "
        f"({min(cratios):.2f}-{max(cratios):.2f}).",
    ]
    return out


if __name__ == "__main__":
    sys.exit(main())
