"""Scale-out on Kafka alone (``scale.store = kafka``): throughput, accuracy against P, and the
time from a member's kill -9 to the group's release. Issue "Scale-out on Kafka alone".

Run from the repository root::

    .venv/bin/python -m bench.service.group --accuracy    # offline: merged l1 at P = 1, 3, 6, 12
    .venv/bin/python -m bench.service.group --throughput  # real broker: events/s, 1-3 members
    .venv/bin/python -m bench.service.group --takeover    # real broker: kill -9 -> release
    .venv/bin/python -m bench.service.group --memory --members 2  # real broker: peak RSS
    .venv/bin/python -m bench.service.group --all         # the three; writes docs/group_bench.md

1. Accuracy (offline, production code paths): one true histogram per repetition (n events over a
   real profile or Zipf(1.1), D counters), split by counter index mod P into P slice states
   (:func:`aggregator.service.group.repartition.slice_size` counters each, the state noise drawn
   by :class:`~aggregator.state.PanPrivateHistogram`), each summarized with the release layer
   (``partition_summary``, joint model) and merged with ``merge_summaries``; l1 distance of the
   merged release to the true anonymized histogram, and the ratio to P = 1 (one process) on the
   same true histograms. Noise from the OS CSPRNG (unseeded).
2. Throughput (real Apache Kafka on loopback; ``deploy/kafka/kafka.sh`` or
   $PANAGG_KAFKA_BOOTSTRAP): a backlog of N msgpack records (unkeyed) on a 6-partition topic,
   then k = 1, 2, 3 members started at once on a new group; events/s = N / (time from the start
   until the releases (read from ``<group>.panagg.releases``) hold N events), window 5 s.
   Beside it the same for one process (``scale.partitioned = false``, windows by its clock, no
   accuracy plan) on a backlog of its own, and CPU seconds per event: user + system of each
   process's tree (release workers included) from /proc just before it is stopped, with and
   without each process's start-up CPU (its tree's CPU when its log says it starts to count),
   and the ratios of the group's figures to one process's. ``--client confluent`` asks every
   process for ``source.client = confluent`` (a process that refuses it: reported, its line).
   Each run records the peak RSS as 5. does.
3. Takeover: two members, a steady 2,000 events/s; kill -9 of the member that does not lead, not
   restarted; the time from the kill until the window open at the kill is released, against the
   same window's planned release time (its end + close grace).
4. Broker restarts (``--restarts K``, issue 46: "a group resumes releasing within 10 s of the
   broker's return"): a broker of its own (it is stopped and killed, so never
   $PANAGG_KAFKA_BOOTSTRAP's), three members (``--members``' last count) of 5 s time windows over
   D = 1,000 (releases without error bars: with 2 s windows a leader on this 2-core machine fell
   minutes behind before any outage, and the figure measured its backlog), a steady 2,000
   events/s; K outages, alternately a clean stop (SIGTERM) and a
   kill -9, each 10 s after the last return and 8 s long; for each, the seconds from the
   broker's return (``kafka.sh start`` answered) until the group's ledger holds one more
   release. The members keep the product's session timeout (``source.session_timeout_s``)
   unless ``--session-timeout-s`` says otherwise (the other runs use 6 s): after a kill -9 a
   KRaft broker loads the groups and starts their session clocks about 10 s before it takes
   requests (it waits out its old registration), so members with a shorter session are
   dropped, rejoin and rebalance more than once. The load average at each return is printed
   beside it: on a shared 2-core machine the leader's backlog before the outage, not Kafka,
   sets the tail.
5. Memory (``--memory``, issue 47: "memory per member = one process's"): for each D of
   ``--domains``, one process and then each k of ``--members`` members (views exchange unless
   ``--exchange items``), each on a backlog of its own (``--events`` records over D items, the
   throughput runs above with ``state.domain_size = D``); peak RSS is VmHWM from
   /proc/<pid>/status of each ``panagg run`` process and of its release workers (sampled 5 times
   a second; the process's own VmHWM is its peak whenever read), and each over one process's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from bench.harness import ROOT, parser


# -- 1. accuracy ------------------------------------------------------------------------------
def merged_l1(counts: np.ndarray, P: int, eps: float, reps_err: int = 0) -> float:
    from aggregator.estimate import l1_distance
    from aggregator.service.group.repartition import slice_size
    from aggregator.service.group.summary import merge_summaries, partition_summary
    from aggregator.state import PanPrivateHistogram

    D = len(counts)
    idx = np.arange(D)
    summaries = []
    info = {"kind": "time", "size": 1.0, "events": 0, "started_unix": 0.0, "ended_unix": 1.0}
    for p in range(P):
        st = PanPrivateHistogram(eps, size=slice_size(D, P, p))
        mine = counts[idx % P == p]
        st.add_indices(np.repeat(np.arange(len(mine)), mine))
        s = partition_summary(
            st,
            model="joint",
            window=0,
            partition=p,
            partitions=P,
            window_info=dict(info, events=int(mine.sum())),
        )
        summaries.append(s)
    release = merge_summaries(summaries, error_bar_reps=reps_err)
    pairs = release["histogram"]["pairs"]
    est = np.repeat([r for r, _ in pairs], [c for _, c in pairs]) if pairs else np.zeros(0)
    return float(l1_distance(counts[counts > 0], est))


def accuracy(profiles, D: int, n: int, eps: float, reps: int, Ps=(1, 3, 6, 12)) -> list[dict]:
    from bench._data import real_profile, weights

    rows = []
    for name in profiles:
        w = weights("zipf", D) if name == "zipf" else real_profile(name)[:D]
        w = w / w.sum()
        errs = {P: [] for P in Ps}
        for _ in range(reps):
            rng = np.random.default_rng()
            counts = rng.multinomial(n, w)
            counts = np.concatenate([counts, np.zeros(D - len(counts), dtype=counts.dtype)])
            rng.shuffle(counts)  # item ids carry no order
            for P in Ps:
                errs[P].append(merged_l1(counts, P, eps))
        base = float(np.mean(errs[1]))
        for P in Ps:
            m = float(np.mean(errs[P]))
            se = float(np.std(errs[P], ddof=1) / np.sqrt(reps)) if reps > 1 else 0.0
            rows.append({"profile": name, "P": P, "l1": m, "se": se, "ratio": m / base})
            print(
                f"{name:8s} P={P:2d} l1={m:9.0f} +- {se:6.0f}  ratio to P=1 {m / base:5.2f}",
                file=sys.stderr,
            )
    return rows


# -- 2. and 3. on a real broker -------------------------------------------------------------------
def _broker(tmp: Path):
    boot = os.environ.get("PANAGG_KAFKA_BOOTSTRAP")
    if boot:
        return boot, None
    out = subprocess.run(
        [str(ROOT / "deploy/kafka/kafka.sh"), "start", str(tmp / "kafka")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.strip().splitlines()[-1].split("=", 1)[1], tmp / "kafka"


def _topic(boot, parts=6):
    from kafka.admin import KafkaAdminClient, NewTopic

    name = f"gb-{uuid.uuid4().hex[:8]}"
    a = KafkaAdminClient(bootstrap_servers=boot)
    a.create_topics([NewTopic(name, num_partitions=parts, replication_factor=1)])
    a.close()
    return name


def _produce(boot, topic, n, rate=None, D=100_000, event_span_s=None):
    """n records; ``event_span_s``: stamped over that many seconds an hour ago (out of order
    within 2 s), then one record per partition far later, so every window of the span closes."""
    import msgpack
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=boot, linger_ms=20, batch_size=512 * 1024)
    rng = np.random.default_rng()
    items = np.minimum(rng.zipf(1.1, n), D - 1)
    vals = [msgpack.packb({"item": int(i)}) for i in items]
    stamps = [None] * n
    if event_span_s:
        t0 = time.time() - 3600
        stamps = (
            (1000 * (t0 + np.linspace(0, event_span_s, n) + rng.uniform(0, 2, n)))
            .astype(np.int64)
            .tolist()
        )
    step = max(1, int((rate or 1e9) / 20))
    for i in range(0, n, step):
        for v, ts in zip(vals[i : i + step], stamps[i : i + step]):
            p.send(topic, value=v, timestamp_ms=ts)
        if rate:
            time.sleep(0.05)
    if event_span_s:
        for part in sorted(p.partitions_for(topic)):
            p.send(
                topic,
                value=vals[0],
                partition=part,
                timestamp_ms=int(1000 * (t0 + event_span_s + 600)),
            )
    p.flush()
    p.close()


#: scale.exchange of the time-window runs (--exchange)
EXCHANGE = ["views"]


#: source.client of every process a run starts (--client)
CLIENT = ["kafka-python"]


def _member(
    boot,
    topic,
    group,
    name,
    tmp,
    window=5,
    event_time=False,
    count=0,
    alone=False,
    domain=100_000,
    extra=(),
    session_timeout_s: float | None = 6.0,
):
    """A ``panagg run`` child: a member of ``group``, or with ``alone`` one process
    (``scale.partitioned = false``, its releases in its release directory)."""
    log = open(tmp / f"{group}-{name}.log", "w")
    # one process: windows by its clock, as the group's intake time (not the records' stamps)
    # and no accuracy plan at start (a one-time simulation members do not make)
    scale = (
        [
            "--set",
            "scale.partitioned=false",
            "--set",
            "window.clock=process",
            "--set",
            "release.plan_errors=false",
        ]
        if alone
        else ["--set", "scale.partitioned=true", "--set", "scale.store=kafka"]
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            boot,
            "--topic",
            topic,
            "--state-dir",
            str(tmp / group / name),
            "--release-dir",
            str(tmp / group / name / "rel"),
            "--metrics-port",
            "-1",
            *scale,
            "--set",
            f"source.client={CLIENT[0]}",
            "--set",
            "window.kind=time",
            "--set",
            f"window.size={int(window)}",
            "--set",
            f"state.domain_size={int(domain)}",
            "--set",
            f"source.group={group}",
            "--set",
            f"source.instance_id={name}",
            # (None: the product's default, source.session_timeout_s)
            *(
                ["--set", f"source.session_timeout_s={session_timeout_s:g}"]
                if session_timeout_s is not None
                else []
            ),
            "--set",
            "scale.close_grace_s=1",
            *(
                ["--set", "window.kind=event_time", "--set", "window.allowed_lateness_s=2"]
                if event_time
                else []
            ),
            *(
                ["--set", "window.kind=count", "--set", f"window.size={int(count)}"]
                if count
                else []
            ),
            # count and event-time windows are the items exchange's (the views one: time windows)
            *(
                []
                if alone
                else ["--set", f"scale.exchange={'items' if event_time or count else EXCHANGE[0]}"]
            ),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def _released(boot, group, withheld: bool = True):
    """[(window, n, time of the ledger entry)] from the group's ledger topic; ``withheld``
    False leaves out the windows withheld (charged, nothing published)."""
    return [
        (e["window"], e.get("n", 0), e["time_unix"])
        for e in _ledger(boot, group)
        if e["kind"] == "release" and (withheld or not e.get("withheld"))
    ]


def _ledger(boot, group) -> list[dict]:
    """The entries of the group's ledger topic (none while it cannot be read)."""
    from kafka import KafkaConsumer

    from aggregator.service.group.ledger_topic import TopicLedger

    c = KafkaConsumer(
        bootstrap_servers=boot,
        isolation_level="read_committed",
        group_id=None,
        enable_auto_commit=False,
    )
    try:
        led = TopicLedger(c, f"{group}.panagg.ledger", budget_per_window=1.0)
        led.read_to_end()
        return list(led.entries)
    except Exception:
        return []
    finally:
        c.close()


def _released_alone(tmp, group, name="m0") -> int:
    """Events in the releases one process (``_member(alone=True)``) wrote to its directory."""
    n = 0
    for path in (tmp / group / name / "rel").glob("release-*.json"):
        try:
            n += json.loads(path.read_text())["window_info"]["events"]
        except (OSError, ValueError, KeyError):
            pass  # being written
    return n


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and every descendant alive now (a
    member's release workers, spawned), plus what each has reaped (``cutime``/``cstime``):
    each process of the tree counted once. Linux /proc."""
    stats: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        f = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ...
        stats[int(d.name)] = sum(int(x) for x in f[11:15])  # utime stime cutime cstime
        children.setdefault(int(f[1]), []).append(int(d.name))
    todo, total = [pid], 0
    while todo:
        p = todo.pop()
        total += stats.get(p, 0)
        todo += children.get(p, [])
    return total / _TICK


def own_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` alone, its children not included."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return sum(int(x) for x in raw[raw.rindex(")") + 2 :].split()[11:13]) / _TICK


def vm_hwm_mb(pid: int) -> float:
    """Peak resident set size (VmHWM, /proc/<pid>/status) of process ``pid`` in MB (10^6 bytes);
    0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    """The pids of every descendant of ``pid`` alive now (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                raw = (d / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(raw[raw.rindex(")") + 2 :].split()[1]), []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        c = todo.pop()
        out.append(c)
        todo += children.get(c, [])
    return out


class PeakRss:
    """Peaks of the VmHWM of processes and of their descendants (release workers), read from
    /proc each time :meth:`sample` is called (a worker that lives between two samples is
    missed; the processes' own VmHWM is their peak since they started, whenever read)."""

    def __init__(self, pids):
        self.pids = list(pids)
        self.own = [0.0] * len(self.pids)
        self.workers: list[dict[int, float]] = [{} for _ in self.pids]

    def sample(self) -> None:
        for i, pid in enumerate(self.pids):
            self.own[i] = max(self.own[i], vm_hwm_mb(pid))
            for c in descendants(pid):
                self.workers[i][c] = max(self.workers[i].get(c, 0.0), vm_hwm_mb(c))

    def worker_peak(self) -> list[float]:
        """Each process's largest descendant peak (0: none seen)."""
        return [max(w.values(), default=0.0) for w in self.workers]


def _exited(procs, tmp, group) -> str | None:
    """The last line of the log of a process of ``procs`` that has exited, None while all run."""
    for i, p in enumerate(procs):
        if p.poll() is not None:
            lines = (tmp / f"{group}-m{i}.log").read_text().strip().splitlines()
            return lines[-1] if lines else f"exit {p.returncode}"
    return None


def machine() -> dict:
    from bench.harness import cpu_model, git_rev

    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "rev": git_rev(["aggregator", "consumers", "bench/service/group.py"]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_start": [round(x, 2) for x in os.getloadavg()],
    }


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def _run(boot, tmp, n, k, event_time=False, domain=100_000) -> dict:
    """k members (k = 0: one process) on a new backlog of n records over ``domain`` items,
    from their start until the releases hold n events: seconds, CPU seconds of the processes'
    trees read just before they are stopped (start-up, join, counting, releases and the idle
    polls between them all inside), and peak RSS (VmHWM) of each process and of its largest
    release worker, sampled every 0.2 s."""
    topic = _topic(boot)
    _produce(boot, topic, n, event_span_s=200 if event_time else None, D=domain)
    group = f"gb-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    procs = [
        _member(
            boot, topic, group, f"m{i}", tmp, event_time=event_time, alone=k == 0, domain=domain
        )
        for i in range(max(k, 1))
    ]
    rss = PeakRss(p.pid for p in procs)
    who = f"{k} member(s)" if k else "one process"
    # the log line at which a process starts to count: its CPU until then is its start-up
    mark = "assigned partitions" if k == 0 else "counting partition"
    started: dict[int, tuple[float, float]] = {}  # tree, own CPU at the line
    try:
        while (
            _released_alone(tmp, group) if k == 0 else sum(r[1] for r in _released(boot, group))
        ) < n:
            gone = _exited(procs, tmp, group)
            if gone is not None:
                print(f"{who} on {CLIENT[0]}: exited: {gone}", file=sys.stderr)
                return {"members": k, "client": CLIENT[0], "refused": gone}
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"{who}: not done in 900 s")
            for i, p in enumerate(procs):
                if i not in started and mark in (tmp / f"{group}-m{i}.log").read_text():
                    started[i] = tree_cpu(p.pid), own_cpu(p.pid)
            # the releases read each second (a consumer each time), RSS 5 times a second
            for _ in range(1 if len(started) < len(procs) else 5):
                rss.sample()
                time.sleep(0.2)
        secs = time.monotonic() - t0
        rss.sample()
        cpu = [tree_cpu(p.pid) for p in procs]
        loop = [own_cpu(p.pid) for p in procs]
        releases = (
            len(list((tmp / group / "m0" / "rel").glob("release-*.json")))
            if k == 0
            else len(_released(boot, group))
        )
    finally:
        _stop(procs)
    # (0, 0): counted before it was seen
    start = [started.get(i, (0.0, 0.0))[0] for i in range(len(procs))]
    start_own = [started.get(i, (0.0, 0.0))[1] for i in range(len(procs))]
    row = {
        "members": k,
        "client": CLIENT[0],
        "events": n,
        "seconds": secs,
        "events_per_s": n / secs,
        "cpu_s": cpu,
        "cpu_us_per_event": 1e6 * sum(cpu) / n,
        "startup_cpu_s": start,
        "releases": releases,
        # the children: release workers (the leader's merges and releases, one process's)
        "worker_cpu_s": [c - o for c, o in zip(cpu, loop)],
        "net_cpu_us_per_event": 1e6 * (sum(cpu) - sum(start)) / n,
        "windows": "event_time" if event_time else "time",
        "domain": domain,
        "rss_mb": rss.own,
        "worker_rss_mb": rss.worker_peak(),
    }
    row["loop_cpu_us_per_event"] = 1e6 * (sum(loop) - sum(start_own)) / n
    print(
        f"{who}: {releases} releases; CPU of the release workers "
        f"{' + '.join(f'{c:.1f}' for c in row['worker_cpu_s'])} s; of the processes "
        f"themselves net of start-up {row['loop_cpu_us_per_event']:.1f} us/event",
        file=sys.stderr,
    )
    print(
        f"{who}, D = {domain:,}: peak RSS (VmHWM) {' + '.join(f'{r:.0f}' for r in rss.own)} "
        f"MB, its largest release worker's "
        f"{' + '.join(f'{r:.0f}' for r in row['worker_rss_mb'])} MB",
        file=sys.stderr,
    )
    print(
        f"{who}: {n} events in {secs:.1f} s = {n / secs:,.0f} events/s, CPU "
        f"{sum(cpu):.1f} s ({' + '.join(f'{c:.1f}' for c in cpu)}) = "
        f"{row['cpu_us_per_event']:.1f} us/event (start, group join and the last window's "
        f"close included), {row['net_cpu_us_per_event']:.1f} us/event without the start-up "
        f"(CPU until its '{mark}' line: {' + '.join(f'{c:.1f}' for c in start)} s)",
        file=sys.stderr,
    )
    return row


def throughput(boot, tmp, n=300_000, members=(1, 2, 3), event_time=False, one=True) -> list[dict]:
    """``event_time``: windows by the records' timestamps (5 s windows, 2 s lateness, the
    backlog stamped over 200 s: 40 windows). ``one``: one process first (k = 0: ``panagg run``
    with ``scale.partitioned = false``, intake-time windows of the same size), and each group
    row's ratios to it: CPU per event, and events/s over k times its events/s."""
    rows = []
    base = _run(boot, tmp, n, 0) if one and not event_time else None
    if base is not None:
        rows.append(base)
    for k in members:
        row = _run(boot, tmp, n, k, event_time=event_time)
        if base is not None and "refused" not in row and "refused" not in base:
            row["cpu_ratio"] = row["cpu_us_per_event"] / base["cpu_us_per_event"]
            row["net_cpu_ratio"] = row["net_cpu_us_per_event"] / base["net_cpu_us_per_event"]
            row["loop_cpu_ratio"] = row["loop_cpu_us_per_event"] / base["loop_cpu_us_per_event"]
            row["speed_ratio"] = row["events_per_s"] / (k * base["events_per_s"])
            print(
                f"{k} member(s) / one process: CPU per event {row['cpu_ratio']:.2f}x, "
                f"events/s over {k} x one process's {row['speed_ratio']:.2f}",
                file=sys.stderr,
            )
        rows.append(row)
    return rows


def throughput_lines(rows: list[dict], m: dict) -> list[str]:
    """The markdown table of :func:`throughput`'s rows."""
    out = [
        "| run | events/s | events/s over k x one process's | CPU s (each process) | "
        "CPU us/event | over one process's | start-up CPU s (until it counts) | "
        "CPU us/event net of start-up | over one process's | "
        "events/s per core net (1 / CPU per event) | releases | release workers' CPU s | "
        "CPU us/event of the processes without their workers, net of start-up | over one "
        "process's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for r in rows:
        who = f"{r['members']} member(s)" if r["members"] else "one process"
        if "refused" in r:
            out.append(f"| {who}, {r['client']} | refused: {r['refused']} |" + " |" * 12)
            continue
        net = r.get("net_cpu_us_per_event", nan)
        # ratios: 1 on the one-process row, "-" where no one-process run (--no-one)
        one = 1.0 if r["members"] == 0 else None

        def ratio(key, one=one, r=r):
            v = r.get(key, one)
            return "-" if v is None else f"{v:.2f}"

        out.append(
            f"| {who}, {r['client']} | {r['events_per_s']:,.0f} | "
            f"{ratio('speed_ratio')} | "
            f"{' + '.join(f'{c:.1f}' for c in r['cpu_s'])} | "
            f"{r['cpu_us_per_event']:.1f} | {ratio('cpu_ratio')} | "
            f"{' + '.join(f'{c:.1f}' for c in r['startup_cpu_s'])} | {net:.1f} | "
            f"{ratio('net_cpu_ratio')} | "
            f"{(1e6 / net if net > 0 else nan):,.0f} | {r['releases']} | "
            f"{' + '.join(f'{c:.1f}' for c in r['worker_cpu_s'])} | "
            f"{r['loop_cpu_us_per_event']:.1f} | {ratio('loop_cpu_ratio')} |"
        )
    out.append(
        f"Machine: {m['cpus']} CPUs, {m['cpu']}; git {m['rev']}; {m['when']}; load "
        f"average (1, 5, 15 min) at start {m['load_start']}, at end {m['load_end']}."
    )
    return out


def memory(boot, tmp, n=200_000, domains=(1_000, 1_000_000), members=(2,)) -> list[dict]:
    """Peak RSS per process (issue 47: a member's memory = one process's): for each D, one
    process, then each k of ``members`` on a backlog of n records of their own over D items
    (the throughput runs of :func:`_run`, D counters each); each row's peaks over one
    process's of the same D."""
    rows = []
    for D in domains:
        base = _run(boot, tmp, n, 0, domain=D)
        rows.append(base)
        for k in members:
            row = _run(boot, tmp, n, k, domain=D)
            if "refused" not in row and "refused" not in base:
                row["rss_ratio"] = [r / base["rss_mb"][0] for r in row["rss_mb"]]
                row["worker_rss_ratio"] = [
                    r / base["worker_rss_mb"][0] if base["worker_rss_mb"][0] else float("nan")
                    for r in row["worker_rss_mb"]
                ]
                row["cpu_ratio"] = row["cpu_us_per_event"] / base["cpu_us_per_event"]
                row["net_cpu_ratio"] = row["net_cpu_us_per_event"] / base["net_cpu_us_per_event"]
            rows.append(row)
    return rows


def memory_lines(rows: list[dict], m: dict) -> list[str]:
    """The markdown table of :func:`memory`'s rows."""
    out = [
        "| D | run | peak RSS of each process, MB | over one process's | peak RSS of its "
        "largest release worker, MB | over one process's | CPU us/event (tree) | over one "
        "process's | net of start-up, us/event | over one process's | releases |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def each(xs, f="{:.0f}"):
        return " + ".join(f.format(x) for x in xs) if xs else "1"

    for r in rows:
        who = f"{r['members']} member(s)" if r["members"] else "one process"
        if "refused" in r:
            out.append(f"| {r.get('domain', '-')} | {who} | refused: {r['refused']} |" + " |" * 8)
            continue
        one = r["members"] == 0
        out.append(
            f"| {r['domain']:,} | {who} | {each(r['rss_mb'])} | "
            f"{'1' if one else each(r.get('rss_ratio', []), '{:.2f}')} | "
            f"{each(r['worker_rss_mb'])} | "
            f"{'1' if one else each(r.get('worker_rss_ratio', []), '{:.2f}')} | "
            f"{r['cpu_us_per_event']:.1f} | {1.0 if one else r.get('cpu_ratio', 0):.2f} | "
            f"{r['net_cpu_us_per_event']:.1f} | {1.0 if one else r.get('net_cpu_ratio', 0):.2f} "
            f"| {r['releases']} |"
        )
    out.append(
        f"Machine: {m['cpus']} CPUs, {m['cpu']}; git {m['rev']}; {m['when']}; load "
        f"average (1, 5, 15 min) at start {m['load_start']}, at end {m['load_end']}."
    )
    return out


def count_windows(boot, tmp, n=200_000, size=20_000, rate=5_000, members=2) -> dict:
    """Count windows of ``size`` events cut by the leader, the stream at ``rate`` events/s:
    how many events each window holds (the cut's overshoot), no kills."""
    topic = _topic(boot)
    group = f"gb-{uuid.uuid4().hex[:6]}"
    procs = [_member(boot, topic, group, "m0", tmp, count=size)]
    time.sleep(4)
    procs += [_member(boot, topic, group, f"m{i}", tmp, count=size) for i in range(1, members)]
    time.sleep(4)
    try:
        _produce(boot, topic, n, rate=rate)
        # the last cut may be short of n by its overshoot: wait for all but one, then quiet
        deadline = time.monotonic() + 300
        while sum(r[1] for r in _released(boot, group)) < (n // size - 1) * size:
            if time.monotonic() > deadline:
                raise RuntimeError("the count windows were not all cut within 300 s")
            time.sleep(1)
        time.sleep(8)
    finally:
        _stop(procs)
    sizes = [k for _, k, _ in sorted(_released(boot, group))]
    over = np.array(sizes) / size - 1.0
    row = {
        "size": size,
        "rate": rate,
        "members": members,
        "windows": sizes,
        "overshoot_mean": float(over.mean()),
        "overshoot_max": float(over.max()),
        "overshoot_min": float(over.min()),
        "overshoot_max_s": float(over.max() * size / rate),
    }
    print(
        f"count windows of {size:,} at {rate:,} events/s, {members} members: "
        f"n/N - 1 mean {row['overshoot_mean']:+.3f}, min {row['overshoot_min']:+.3f}, "
        f"max {row['overshoot_max']:+.3f} "
        f"({row['overshoot_max_s']:.2f} s of the stream)",
        file=sys.stderr,
    )
    return row


def takeover(boot, tmp, window=5.0) -> dict:
    topic = _topic(boot)
    group = f"gb-{uuid.uuid4().hex[:6]}"
    procs = {"m0": _member(boot, topic, group, "m0", tmp, window)}
    time.sleep(4)
    procs["m1"] = _member(boot, topic, group, "m1", tmp, window)
    stop = threading.Event()

    def steady():
        while not stop.is_set():
            _produce(boot, topic, 2000, rate=None)
            time.sleep(1)

    th = threading.Thread(target=steady, daemon=True)
    th.start()
    try:
        time.sleep(20)  # the group settles, windows are being released
        from aggregator.service.group.status import collect_group_status

        st = collect_group_status(boot, group)
        victim = next(m["member"] for m in st["members"] if not m["leads"])
        killed = time.time()
        procs[victim].send_signal(signal.SIGKILL)
        w_open = int(killed // window)
        planned = (w_open + 1) * window + 1.0
        while True:
            done = {w: t for w, _, t in _released(boot, group)}
            if w_open in done:
                break
            if time.time() - killed > 180:
                raise RuntimeError("window not released within 180 s of the kill")
            time.sleep(0.5)
        row = {
            "kill_to_release_s": done[w_open] - killed,
            "delay_past_planned_s": done[w_open] - planned,
            "window_s": window,
            "session_timeout_s": 6.0,
        }
        print(
            f"kill -9 -> window {w_open} released after {row['kill_to_release_s']:.1f} s "
            f"({row['delay_past_planned_s']:.1f} s past its planned time; session timeout 6 s)",
            file=sys.stderr,
        )
        return row
    finally:
        stop.set()
        _stop(procs.values())


def broker_restarts(
    tmp, k: int, members: int = 3, window: float = 5.0, session_timeout_s: float | None = None
) -> dict:
    """Issue 46's resume time after broker outages (the module docstring, 4.);
    ``session_timeout_s`` None: the members' default ``source.session_timeout_s``."""
    state = tmp / "kafka-restarts"
    sh = str(ROOT / "deploy/kafka/kafka.sh")
    boot = (
        subprocess.run([sh, "start", str(state)], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
        .split("=", 1)[1]
    )
    topic = _topic(boot)
    group = f"gb-{uuid.uuid4().hex[:6]}"
    names = [f"m{i}" for i in range(members)]
    # releases without bootstrap error bars (as tests/integration/test_group_kafka.py's): a
    # leader that keeps up with the windows, so the figure is Kafka's recovery, not a backlog
    # of releases (a leader behind says so: /ready 503 and a WARNING, docs/operations.md)
    quick = ("--set", "release.error_bar_reps=0")
    procs = {
        names[0]: _member(
            boot,
            topic,
            group,
            names[0],
            tmp,
            window,
            domain=1_000,
            extra=quick,
            session_timeout_s=session_timeout_s,
        )
    }
    time.sleep(4)  # the first member makes the group; the others join it
    for name in names[1:]:
        procs[name] = _member(
            boot,
            topic,
            group,
            name,
            tmp,
            window,
            domain=1_000,
            extra=quick,
            session_timeout_s=session_timeout_s,
        )
    stop = threading.Event()

    def steady():  # about 2,000 events/s from one producer; a batch the broker misses is dropped
        import msgpack
        from kafka import KafkaProducer

        p = KafkaProducer(
            bootstrap_servers=boot,
            linger_ms=20,
            max_block_ms=2000,
            request_timeout_ms=5000,
            reconnect_backoff_max_ms=1000,
        )
        rng = np.random.default_rng()
        while not stop.is_set():
            try:
                for it in np.minimum(rng.zipf(1.3, 100), 999):
                    p.send(topic, value=msgpack.packb({"item": int(it)}))
            except Exception:
                pass
            time.sleep(0.05)
        try:
            p.flush(timeout=30)
        finally:
            p.close(timeout=5)

    producer = threading.Thread(target=steady, daemon=True)
    producer.start()
    rows = []
    measured = False
    try:
        _wait_released(boot, group, 0, procs, tmp, 180)
        for i in range(k):
            how = "kill -9" if i % 2 else "clean stop"
            time.sleep(10)
            if how == "kill -9":
                os.kill(int((state / "pid").read_text()), signal.SIGKILL)
                (state / "pid").unlink()
            else:
                subprocess.run([sh, "stop", str(state)], capture_output=True, check=True)
            time.sleep(8)
            subprocess.run([sh, "start", str(state)], capture_output=True, check=True)
            back = time.time()
            load = os.getloadavg()[0]
            _wait_released(
                boot, group, len(_released(boot, group, withheld=False)), procs, tmp, 300
            )
            rows.append(
                {"outage": how, "resumed_s": round(time.time() - back, 1), "load": round(load, 1)}
            )
            print(
                f"{how}: released again {rows[-1]['resumed_s']} s after the return "
                f"(load {load:.1f})",
                file=sys.stderr,
            )
        measured = True
    finally:
        stop.set()
        producer.join(timeout=60)  # its last batch flushed before the broker goes
        _stop(procs.values())
        if not measured:  # an error: the broker goes now, the error on its way
            subprocess.run([sh, "stop", str(state)], capture_output=True)
    try:
        entries = [e for e in _ledger(boot, group) if e["kind"] == "release"]
    finally:
        subprocess.run([sh, "stop", str(state)], capture_output=True)
    out: dict = {
        "session_timeout_s": session_timeout_s or "default",
        "rows": rows,
        "windows released": sum(not e.get("withheld") for e in entries),
        "windows withheld": sum(bool(e.get("withheld")) for e in entries),
    }
    import statistics

    for how in ("clean stop", "kill -9", None):
        got = [r["resumed_s"] for r in rows if how in (None, r["outage"])]
        if got:
            out[f"median_s {how or 'all'}"] = statistics.median(got)
    print("; ".join(f"{k}: {v}" for k, v in out.items() if k != "rows"), file=sys.stderr)
    return out


def _wait_released(boot, group, more_than: int, procs, tmp, timeout_s: float) -> None:
    """Until the group's ledger holds more than ``more_than`` releases."""
    t0 = time.time()
    while len(_released(boot, group, withheld=False)) <= more_than:
        gone = _exited(list(procs.values()), tmp, group)
        if gone:
            raise RuntimeError(gone)
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"no release within {timeout_s:g} s")
        time.sleep(0.25)


def main(argv=None) -> int:
    ap = parser(
        __doc__,
        "--accuracy: Zipf over D = 1000, n = 1000, 1 repetition; with "
        "--throughput too: 2000 events, 1 member",
    )
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--takeover", action="store_true")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="peak RSS (VmHWM) of one process and of each member (--members), D "
        "counters each (--domains), --events records each run",
    )
    ap.add_argument("--domains", default="1000,1000000", help="--memory: state.domain_size D")
    ap.add_argument(
        "--event-time",
        action="store_true",
        help="--throughput with event-time windows (2 s allowed lateness)",
    )
    ap.add_argument("--members", default="1,2,3", help="--throughput: member counts")
    ap.add_argument(
        "--count-windows",
        type=int,
        default=0,
        metavar="N",
        help="count windows of N events: what each window holds (the overshoot)",
    )
    ap.add_argument("--rate", type=int, default=5000, help="--count-windows: events/s")
    ap.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="K",
        help="K broker outages (clean stop, kill -9, ...) under a 3-member group",
    )
    ap.add_argument(
        "--session-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="--restarts: the members' source.session_timeout_s (default: the "
        "product's default; the other runs use 6 s)",
    )
    ap.add_argument("--all", action="store_true")
    ap.add_argument(
        "--exchange",
        choices=("views", "items"),
        default="views",
        help="scale.exchange of the time-window runs",
    )
    ap.add_argument(
        "--client",
        choices=("kafka-python", "confluent"),
        default="kafka-python",
        help="--throughput: source.client of every process",
    )
    ap.add_argument(
        "--no-one",
        action="store_true",
        help="--throughput: skip the one-process run (and the ratios to it)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--out", default="out/group_bench.json")
    args = ap.parse_args(argv)
    EXCHANGE[0] = args.exchange
    CLIENT[0] = args.client
    m = machine()
    res: dict = {}
    if args.smoke:
        res["accuracy"] = accuracy(["zipf"], D=1_000, n=1_000, eps=1.0, reps=1)
        args.events, args.members, args.domains = 2_000, "1", "1000"
    elif args.accuracy or args.all:
        res["accuracy"] = accuracy(
            ["zipf", "wf-en", "sc-es"], D=100_000, n=1_000_000, eps=1.0, reps=args.reps
        )
    if (
        args.throughput
        or args.takeover
        or args.count_windows
        or args.restarts
        or args.memory
        or args.all
    ):
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="group-bench-"))
        boot, state = _broker(tmp)
        try:
            if args.throughput or args.all:
                res["throughput"] = throughput(
                    boot,
                    tmp,
                    n=args.events,
                    event_time=args.event_time,
                    one=not args.no_one,
                    members=tuple(int(k) for k in args.members.split(",")),
                )
                m["load_end"] = [round(x, 2) for x in os.getloadavg()]
                res["machine"] = m
                print("\n".join(throughput_lines(res["throughput"], m)), file=sys.stderr)
            if args.memory:
                res["memory"] = memory(
                    boot,
                    tmp,
                    n=args.events,
                    domains=tuple(int(d) for d in args.domains.split(",")),
                    members=tuple(int(k) for k in args.members.split(",")),
                )
                m["load_end"] = [round(x, 2) for x in os.getloadavg()]
                res["machine"] = m
                print("\n".join(memory_lines(res["memory"], m)), file=sys.stderr)
            if args.takeover or args.all:
                res["takeover"] = takeover(boot, tmp)
            if args.count_windows:
                res["count_windows"] = count_windows(
                    boot, tmp, n=args.events, size=args.count_windows, rate=args.rate
                )
            if args.restarts:
                members = int(args.members.split(",")[-1])
                res["restarts"] = broker_restarts(
                    tmp, args.restarts, members=members, session_timeout_s=args.session_timeout_s
                )
        finally:
            if state is not None:
                subprocess.run([str(ROOT / "deploy/kafka/kafka.sh"), "stop", str(state)])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
