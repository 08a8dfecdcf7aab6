"""Scale-out under load: N partitioned aggregators on a real broker, and what partitioning costs
in accuracy.

Run from the repository root::

    .venv/bin/python -m bench.scaleout                    # 3 min load test + accuracy sweep
    .venv/bin/python -m bench.scaleout --quick            # 1 min, small sweep, writes under out/
    .venv/bin/python -m bench.scaleout --rate 20000 --minutes 3 --processes 3 --partitions 6
    .venv/bin/python -m bench.scaleout --skip-load        # accuracy part only (no Kafka)
    .venv/bin/python -m bench.scaleout --load-from out/scaleout_results.json
                                        # new accuracy part, load test reused from a saved run
    .venv/bin/python -m bench.scaleout --replot out/scaleout_results.json   # report only

Writes docs/scaleout_load.md and docs/img/scaleout_{lag,throughput,latency,accuracy}.png (with
--quick: out/scaleout_load.md and out/img/..., so a smoke run never overwrites the committed
results); the raw samples go to out/scaleout_results.json. Progress lines go to stderr.

1. Load test (real Apache Kafka on loopback, ``deploy/kafka/kafka.sh``; or $PANAGG_KAFKA_BOOTSTRAP):
   a fresh topic with ``--partitions`` partitions; ``--processes`` ``panagg run`` processes
   (``scale.partitioned=true``, one consumer group, distinct ``source.instance_id``, one shared
   ``--state-dir``, direct mode D = 100,000, epoch-aligned time windows of ``--window`` seconds,
   metrics on a free port each); once the group has spread the partitions over all of them, a
   producer process sends msgpack ``{"item": k}`` records keyed by ``str(k)``, k ~ Zipf(1.1) over
   [0, D), at a fixed target rate (paced by the wall clock in 20 ms ticks, catching up at most a
   quarter of a second at a time) for ``--minutes``. The record's partition is computed as
   Kafka's default partitioner does (murmur2 of the key), once per item, and passed explicitly:
   the same placement at about 1.6x the producer throughput of kafka-python's per-record
   partitioner. Every ~2 s the bench samples the end offsets (broker), the group's committed
   offsets (broker), and each process's /metrics (events counted, consumer lag, partitions
   owned, releases, release latency), plus CPU seconds of every process from /proc.
   ``scale.keep_windows`` is ``--keep-windows`` (default 3, the service default), so merges clean
   up old window directories of the shared state during the run; the bench records how many are
   left at the end.
   After production stops it waits until the group's committed offsets reach the end offsets
   and the processes' ``panagg_events_total`` add up to the records on the broker, then until the
   window open at that moment is released, and checks that the released windows' ``n`` add up
   to the same number (nothing lost, nothing counted twice). No process is restarted (a
   restarted process's counter would start again from 0).
2. Accuracy of the merged release against the number of partitions P (offline, no Kafka): one
   true histogram per repetition (n = 1e6 events, Zipf(1.1) over D = 1e5), split over P states
   by murmur2(str(k)) mod P (a topic keyed by item), each state a ``PanPrivateHistogram`` with
   seeded noise, summarized with ``aggregator.service.partitioned.partition_summary`` and merged with
   ``merge_summaries``; l1 distance to the true anonymized histogram. Direct mode: every
   partition keeps all D counters (P * D in the release). Hashed mode: B =
   ``choose_buckets(n, eps)``, ceil(B / P) buckets per partition. Both for the joint model
   (2 layers) and state-only (1 layer). Plus an unkeyed topic at P = 6: the events (in random
   order) go round-robin to the partitions, so each item is split into pieces.

Benchmark noise is seeded (reproducible, not private); the load test's processes use the
production noise (OS CSPRNG).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from ._data import cpu_model, fmt, git_rev, mean_se, ratio_se, true_counts, versions

ROOT = Path(__file__).resolve().parent.parent
KAFKA_SH = ROOT / "deploy" / "kafka" / "kafka.sh"
SEED = 20260314
D = 100_000
ZIPF_S = 1.1
MAX_RATE = 200_000
MAX_MINUTES = 30
MAX_PROCESSES = 8
MAX_PARTITIONS = 24
SAMPLE_S = 2.0
# scale.keep_windows for the aggregators: the service default, so that window directories are
# cleaned up during the run (after releasing window w, a merge removes the published windows
# <= w - keep_windows) while the other processes' merge scans run. (Before commit 6d8b628 a scan
# that reached a directory removed after it listed it stopped the process; the bench then
# defaulted to 100,000.)
KEEP_WINDOWS = 3
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


class Interrupted(KeyboardInterrupt):
    pass


def _on_sigterm(*_):
    raise Interrupted("SIGTERM")


# ==============================================================================================
# part 1: load test
# ==============================================================================================
def zipf_cdf(domain: int, s: float = ZIPF_S) -> np.ndarray:
    w = 1.0 / np.arange(1, domain + 1, dtype=np.float64) ** s
    cdf = np.cumsum(w / w.sum())
    cdf[-1] = 1.0
    return cdf


def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (Java client and kafka-python) picks for ``key``."""
    from kafka.partitioner import murmur2
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def _producer_main(bootstrap, topic, partitions, rate, seconds, seed, sent, t_first, t_last,
                   done, stop):
    """Producer process: paced sends of Zipf items, keyed by str(item), until ``seconds``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (``stop``)
    import msgpack
    from kafka import KafkaProducer

    cdf = zipf_cdf(D)
    rng = np.random.default_rng(seed)
    values = [msgpack.packb({"item": k}) for k in range(D)]
    keys = [str(k).encode() for k in range(D)]
    parts = [kafka_partition(k, partitions) for k in keys]
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=256 * 1024,
                             acks=1)
    total = int(rate * seconds)
    burst = max(1, int(rate * 0.25))
    n = 0
    t0 = time.monotonic()
    t_first.value = time.time()
    try:
        while n < total and not stop.is_set():
            now = time.monotonic() - t0
            due = min(total, int(rate * now))
            if due <= n:
                time.sleep(min(0.02, max(0.0, (n + 1) / rate - now)))
                continue
            k = min(due - n, burst)
            ids = np.searchsorted(cdf, rng.random(k), side="right")
            send = producer.send
            for i in ids.tolist():
                send(topic, value=values[i], key=keys[i], partition=parts[i])
            n += k
            sent.value = n
        producer.flush(timeout=120)
    finally:
        t_last.value = time.time()
        producer.close(timeout=30)
        done.value = 1


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _all_cpu() -> dict[int, tuple[float, str]]:
    """CPU seconds and command line of every process (to see what else shares the machine)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        cpu = _cpu_seconds(int(d.name))
        if cpu is None:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(d.name)] = (cpu, cmd.strip()[:110])
    return out


def _others(before: dict, after: dict, seconds: float, ours: set[int]) -> list[tuple]:
    """Processes not started by this bench, by CPU (cores) between two ``_all_cpu`` snapshots
    (a process started in between counts from 0; one that ended in between is not seen)."""
    rows = []
    for pid, (cpu1, cmd) in after.items():
        if pid in ours or not cmd:
            continue
        cores = (cpu1 - before.get(pid, (0.0, ""))[0]) / max(seconds, 1e-9)
        if cores >= 0.03:
            rows.append((round(cores, 2), pid, cmd))
    return sorted(rows, reverse=True)[:8]


def _machine_busy() -> float | None:
    """CPU seconds the whole machine spent busy since boot (all cores; /proc/stat)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


# sample name -> key of scrape()'s result; labelled series -> (key, label)
_SCALARS = {
    "panagg_events_total": "events", "panagg_partitions_owned": "owned",
    "panagg_releases_total": "releases", "panagg_release_latency_seconds_sum": "lat_sum",
    "panagg_release_latency_seconds_count": "lat_count", "panagg_windows_waiting": "waiting",
    "panagg_key_checks_total": "key_checks", "panagg_partition_summaries_total": "summaries",
    "panagg_checkpoint_duration_seconds_sum": "ckpt_sum",
    "panagg_checkpoint_duration_seconds_count": "ckpt_count",
}
_LABELLED = {
    "panagg_consumer_lag_records": ("lag", "partition"),
    "panagg_release_latency_seconds_bucket": ("lat_buckets", "le"),
    "panagg_partition_handovers_total": ("handovers", "event"),
}


def scrape(port: int) -> dict | None:
    """The panagg metrics this bench reads from one process's /metrics (None if unreachable)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
    except OSError:
        return None
    out = {key: 0.0 for key in _SCALARS.values()}
    out.update(unkeyed=0.0, lag={}, lat_buckets={}, handovers={})
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in _SCALARS:
                out[_SCALARS[s.name]] = s.value
            elif s.name in _LABELLED:
                key, label = _LABELLED[s.name]
                out[key][s.labels[label]] = s.value
            elif s.name == "panagg_unkeyed_records_total":  # summed over partitions
                out["unkeyed"] += s.value
    return out


class Broker:
    """A broker from $PANAGG_KAFKA_BOOTSTRAP, or one started with deploy/kafka/kafka.sh."""

    def __init__(self, tmp: Path):
        self.state: Path | None = None
        self.bootstrap = os.environ.get("PANAGG_KAFKA_BOOTSTRAP", "")
        self.external = bool(self.bootstrap)
        self.tmp = tmp

    def start(self) -> str:
        if self.external:
            return self.bootstrap
        self.state = self.tmp / "kafka"
        res = subprocess.run([str(KAFKA_SH), "start", str(self.state)], capture_output=True,
                             text=True, timeout=180)
        if res.returncode != 0:
            raise RuntimeError(f"kafka.sh start failed: {res.stderr.strip()[-2000:]}")
        self.bootstrap = res.stdout.strip().splitlines()[-1].split("=", 1)[1]
        return self.bootstrap

    @property
    def pid(self) -> int | None:
        try:
            return int((self.state / "pid").read_text()) if self.state else None
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        if self.state is not None and not self.external:
            subprocess.run([str(KAFKA_SH), "stop", str(self.state)], capture_output=True,
                           timeout=120)


class KafkaView:
    """End offsets and the group's committed offsets, from the broker (no group membership)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, group: str):
        from kafka import KafkaConsumer, TopicPartition
        from kafka.admin import KafkaAdminClient
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.group = group
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap)

    def end_offsets(self) -> list[int] | None:
        try:
            ends = self.consumer.end_offsets(self.tps)
            return [int(ends[tp]) for tp in self.tps]
        except Exception as exc:  # noqa: BLE001 - a missed sample, not a failure
            log(f"end offsets: {type(exc).__name__}: {exc}")
            return None

    def committed(self) -> list[int] | None:
        """Committed offset per partition (0 where the group has committed nothing yet)."""
        try:
            got = self.admin.list_group_offsets({self.group: None}).get(self.group, {})
        except Exception:  # noqa: BLE001 - before the first commit the group may not exist
            return None
        out = []
        for tp in self.tps:
            om = got.get(tp)
            off = getattr(om, "offset", None) if om is not None else None
            out.append(int(off) if off is not None and off >= 0 else 0)
        return out

    def close(self) -> None:
        for c in (self.consumer, self.admin):
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass


def member_args(bootstrap, topic, state, releases, group, instance, window_s, mode,
                keep_windows=None):
    args = ["run", "--bootstrap", bootstrap, "--topic", topic, "--state-dir", str(state),
            "--release-dir", str(releases), "--metrics-port", "0",
            "--set", f"source.group={group}", "--set", "scale.partitioned=true", "--set", "scale.store=directory",
            "--set", f"source.instance_id={instance}", "--set", "window.kind=time",
            "--set", f"window.size={window_s}", "--set", f"state.mode={mode}"]
    if mode == "direct":
        args += ["--set", f"state.domain_size={D}"]
    if keep_windows is not None:
        args += ["--set", f"scale.keep_windows={keep_windows}"]
    return args


def _metrics_port(log_path: Path) -> int | None:
    try:
        m = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", log_path.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def read_releases(rel_dir: Path) -> list[dict]:
    out = []
    for path in sorted(rel_dir.glob("release-*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written (the write is atomic; a partial read means a rename race)
        wi = doc.get("window_info", {})
        out.append({"window": int(doc["window"]), "n": int(doc["n"]),
                    "events": int(wi.get("events", -1)), "size": wi.get("size"),
                    "started_unix": wi.get("started_unix"), "ended_unix": wi.get("ended_unix"),
                    "published_unix": path.stat().st_mtime,
                    "png_unix": (path.with_suffix(".png").stat().st_mtime
                                 if path.with_suffix(".png").exists() else None),
                    "created_unix": doc.get("created_unix"),
                    "merge_s": doc.get("release_seconds"),
                    "partitions": doc.get("domain", {}).get("partitions"),
                    "counters": doc.get("domain", {}).get("counters")})
    return sorted(out, key=lambda r: r["window"])


def run_load(args, tmp: Path) -> dict:
    rate, seconds = args.rate, args.minutes * 60.0
    broker = Broker(tmp)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    view = None
    producer = None
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    sent, done = ctx.Value("q", 0), ctx.Value("i", 0)
    t_first, t_last = ctx.Value("d", 0.0), ctx.Value("d", 0.0)
    res: dict = {"rate": rate, "seconds": seconds, "processes": args.processes,
                 "keep_windows": args.keep_windows,
                 "partitions": args.partitions, "window_s": args.window, "mode": args.mode,
                 "samples": [], "load_start": _loadavg()}
    try:
        log("starting the broker ...")
        bootstrap = broker.start()
        res["broker"] = "external ($PANAGG_KAFKA_BOOTSTRAP)" if broker.external else "kafka.sh"
        topic = f"scaleout-{uuid.uuid4().hex[:8]}"
        group = f"g-{topic}"
        res["topic"], res["group"] = topic, group
        from kafka.admin import KafkaAdminClient
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics({topic: {"num_partitions": args.partitions, "replication_factor": 1}},
                            wait_for_metadata=True)
        admin.close()
        log(f"broker {bootstrap}, topic {topic} ({args.partitions} partitions)")
        state, rel = tmp / "state", tmp / "releases"
        env = dict(os.environ)
        env.pop("PANAGG_TESTING", None)  # production noise
        for k in range(1, args.processes + 1):
            name = f"m{k}"
            logs[name] = tmp / f"{name}.log"
            fh = open(logs[name], "w")
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "aggregator.service.cli",
                 *member_args(bootstrap, topic, state, rel, group, name, args.window, args.mode,
                              args.keep_windows)],
                cwd=ROOT, env=env, stdout=fh, stderr=fh, start_new_session=True)
            fh.close()
        ports: dict[str, int] = {}
        deadline = time.monotonic() + 120
        while len(ports) < len(procs):
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) at start-up:\n"
                                       f"{logs[name].read_text()[-3000:]}")
                if name not in ports and (port := _metrics_port(logs[name])):
                    ports[name] = port
            if time.monotonic() > deadline:
                raise RuntimeError("processes did not report their metrics port within 120 s")
            time.sleep(0.3)
        log("processes up: " + ", ".join(f"{n} pid {p.pid} metrics :{ports[n]}"
                                         for n, p in procs.items()))
        deadline = time.monotonic() + 180
        while True:  # the group has spread the partitions over every process
            owned = {n: (scrape(p) or {}).get("owned", 0) for n, p in ports.items()}
            if sum(owned.values()) == args.partitions and all(v >= 1 for v in owned.values()):
                break
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n"
                                       f"{logs[name].read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the group did not settle within 180 s: owned {owned}")
            time.sleep(1.0)
        log(f"group settled: partitions owned {owned}")
        res["owned_at_start"] = owned
        view = KafkaView(bootstrap, topic, args.partitions, group)
        producer = ctx.Process(target=_producer_main, name="producer", daemon=True,
                               args=(bootstrap, topic, args.partitions, rate, seconds,
                                     SEED, sent, t_first, t_last, done, stop))
        producer.start()
        pids = {**{n: p.pid for n, p in procs.items()}, "producer": producer.pid,
                "broker": broker.pid, "bench": os.getpid()}
        res["pids"] = pids
        t_start = time.time()
        cpu_before, cpu_before_t, busy_before = _all_cpu(), time.monotonic(), _machine_busy()
        log(f"producing at {rate:,.0f} events/s for {seconds:.0f} s "
            f"({int(rate * seconds):,} events) ...")

        phase = "produce"
        last_print = 0.0
        drained_at = None
        final_window = None
        drain_deadline = final_deadline = None
        produced_total = None
        while True:
            t_tick = time.time()
            ends = view.end_offsets()
            committed = view.committed()
            metrics = {n: scrape(p) for n, p in ports.items()}
            cpu = {n: _cpu_seconds(pid) for n, pid in pids.items() if n != "bench"}
            t_cpu = os.times()
            cpu["bench"] = t_cpu.user + t_cpu.system
            sample = {"t": t_tick - t_start, "phase": phase, "ends": ends,
                      "committed": committed, "sent": sent.value, "cpu": cpu,
                      "load1": _loadavg()[0],
                      "metrics": {n: (None if m is None else
                                      {k: m[k] for k in ("events", "lag", "owned", "releases",
                                                         "lat_sum", "lat_count", "waiting",
                                                         "unkeyed", "key_checks", "handovers",
                                                         "summaries", "ckpt_sum", "ckpt_count",
                                                         "lat_buckets")})
                                  for n, m in metrics.items()}}
            res["samples"].append(sample)
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead:  # a finding, not a bench error: record it and stop (no restarts here)
                name, rc = next(iter(dead.items()))
                res["failure"] = {"member": name, "rc": rc, "t": sample["t"],
                                  "log_tail": logs[name].read_text()[-2000:]}
                log(f"{name} exited ({rc}) during the run, t = {sample['t']:.0f} s; stopping. "
                    f"Its log ends:\n{res['failure']['log_tail'][-600:]}")
                stop.set()
                producer.join(timeout=60)
                res["production"] = {"t_first": t_first.value, "t_last": t_last.value,
                                     "sent": sent.value, "t_end_rel": t_last.value - t_start}
                break
            counted = sum(m["events"] for m in metrics.values() if m)
            produced = sum(ends) if ends else None
            comm_lag = ([e - c for e, c in zip(ends, committed)] if ends and committed else None)
            if t_tick - last_print >= 10:
                last_print = t_tick
                prev = res["samples"][-6] if len(res["samples"]) >= 6 else res["samples"][0]
                dt = max(sample["t"] - prev["t"], 1e-9)
                prate = ((produced - sum(prev["ends"])) / dt
                         if produced is not None and prev["ends"] else float("nan"))
                per = []
                for n in procs:
                    a, b = prev["metrics"].get(n), metrics.get(n)
                    per.append(f"{n} {(b['events'] - a['events']) / dt:,.0f}"
                               if a and b and sample is not prev else f"{n} -")
                pos = max((max(m["lag"].values(), default=0) for m in metrics.values() if m),
                          default=0)
                log(f"{phase:7s} t={sample['t']:6.0f}s produced {produced or 0:,} "
                    f"({prate:,.0f}/s) counted {counted:,.0f} [{', '.join(per)} ev/s] "
                    f"lag committed max {max(comm_lag) if comm_lag else '-'} position max "
                    f"{pos:,.0f} releases {len(list(rel.glob('release-*.json')))} "
                    f"load {sample['load1']:.2f}")
            if phase == "produce" and done.value:
                ours = set(pids.values()) | {os.getpid()}
                ours |= {c.pid for c in mp.active_children()}
                span = time.monotonic() - cpu_before_t
                res["other_processes"] = _others(cpu_before, _all_cpu(), span, ours)
                busy = _machine_busy()
                if busy is not None and busy_before is not None:
                    res["machine_busy_cores"] = (busy - busy_before) / span
                phase = "drain"
                produced_total = produced
                res["production"] = {"t_first": t_first.value, "t_last": t_last.value,
                                     "sent": sent.value, "t_end_rel": t_last.value - t_start}
                drain_deadline = time.monotonic() + max(180.0, 2 * seconds)
                log(f"production done: {sent.value:,} sent in "
                    f"{t_last.value - t_first.value:.1f} s; draining ...")
            elif phase == "drain":
                ends_now = sum(ends) if ends else None
                if (ends_now is not None and comm_lag is not None and max(comm_lag) == 0
                        and all(m is not None for m in metrics.values())
                        and counted == ends_now):
                    drained_at = time.time()
                    produced_total = ends_now
                    final_window = int(drained_at // args.window)
                    res["drained_after_s"] = drained_at - t_last.value
                    phase = "final"
                    final_deadline = time.monotonic() + args.window + 120
                    log(f"drained {res['drained_after_s']:.1f} s after production ended: "
                        f"committed == end offsets, counted {counted:,.0f} == produced "
                        f"{ends_now:,}; waiting for window {final_window}'s release ...")
                elif time.monotonic() > drain_deadline:
                    log("drain timeout: the group did not catch up")
                    res["drain_timeout"] = True
                    break
            elif phase == "final":
                rels = read_releases(rel)
                if any(r["window"] >= final_window for r in rels):
                    break
                if time.monotonic() > final_deadline:
                    log("timeout waiting for the last window's release")
                    res["final_timeout"] = True
                    break
            time.sleep(max(0.0, SAMPLE_S - (time.time() - t_tick)))
        if res.get("failure"):
            ends_now = view.end_offsets()
            produced_total = sum(ends_now) if ends_now else None
        res["produced"] = produced_total
        res["final_window"] = final_window
        res["t_start"] = t_start
        # the merging process observes the release metrics after the release file is written
        # and the window marked published: give it a moment before the last scrape
        deadline = time.monotonic() + 30
        while True:
            res["final_metrics"] = {n: scrape(p) for n, p in ports.items()}
            published = sum(m["releases"] for m in res["final_metrics"].values() if m)
            if (published >= len(read_releases(rel)) or time.monotonic() > deadline
                    or res.get("failure")):
                break
            time.sleep(1.0)
        # graceful stop: each process checkpoints and hands its partitions back
        log("stopping the aggregators (SIGTERM) ...")
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        rcs = {}
        for name, proc in procs.items():
            try:
                rcs[name] = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                rcs[name] = f"killed after 90 s ({proc.wait()})"
        res["exit_codes"] = rcs
        res["releases"] = read_releases(rel)
        res["ledger_entries"] = (len((state / "ledger.jsonl").read_text().splitlines())
                                 if (state / "ledger.jsonl").exists() else 0)
        # window directories left in the shared state (scale.keep_windows cleans up the others)
        wins = state / "windows"
        res["window_dirs_left"] = (sorted(int(d.name) for d in wins.iterdir()
                                          if d.is_dir() and d.name.isdigit())
                                   if wins.is_dir() else [])
        res["log_stats"] = {}
        for name, path in logs.items():
            text = path.read_text()
            res["log_stats"][name] = {
                "warnings": text.count(" WARNING "), "errors": text.count(" ERROR "),
                "tracebacks": text.count("Traceback"), "took": text.count("took partition"),
                "handed": text.count("handed over partition"),
                "published": text.count("published merged release")}
            warn = [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln]
            res["log_stats"][name]["first_warnings"] = warn[:5]
        res["load_end"] = _loadavg()
        return res
    finally:
        stop.set()
        if producer is not None:
            producer.join(timeout=30)
            if producer.is_alive():
                producer.terminate()
                producer.join(timeout=10)
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if view is not None:
            view.close()
        log("stopping the broker ...")
        broker.stop()


# -- load-test analysis ------------------------------------------------------------------------
def _p95(xs) -> float:
    return float(np.percentile(xs, 95)) if len(xs) else float("nan")


def analyze_load(res: dict) -> dict:
    S = res["samples"]
    names = [n for n in res["pids"] if n.startswith("m")]
    P = res["partitions"]
    t_end = res.get("production", {}).get("t_end_rel", S[-1]["t"])
    out: dict = {"names": names}
    # throughput per process: deltas of events_total between consecutive samples
    per: dict[str, list] = {n: [] for n in names}
    ts, prod_rate, total_rate = [], [], []
    for a, b in zip(S, S[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        ts.append(b["t"])
        for n in names:
            ma, mb = a["metrics"].get(n), b["metrics"].get(n)
            per[n].append((mb["events"] - ma["events"]) / dt if ma and mb else float("nan"))
        prod_rate.append((sum(b["ends"]) - sum(a["ends"])) / dt
                         if a["ends"] and b["ends"] else float("nan"))
        total_rate.append(np.nansum([per[n][-1] for n in names]))
    ts = np.asarray(ts)
    during = (ts > 0) & (ts <= t_end)
    out["t"], out["per"], out["prod_rate"], out["total_rate"] = ts, per, np.asarray(prod_rate), \
        np.asarray(total_rate)
    out["per_stats"] = {}
    for n in names:
        x = np.asarray(per[n])[during]
        x = x[np.isfinite(x)]
        out["per_stats"][n] = (float(x.mean()) if len(x) else float("nan"), _p95(x),
                               float(x.max()) if len(x) else float("nan"))
    tot = np.asarray(total_rate)[during]
    out["total_stats"] = (float(tot.mean()) if len(tot) else float("nan"), _p95(tot))
    prod = res.get("production", {})
    produced = res.get("produced")
    dur = prod.get("t_last", 0) - prod.get("t_first", 0)
    out["achieved_rate"] = produced / dur if produced and dur > 0 else float("nan")
    pr = np.asarray(prod_rate)[during]
    pr = pr[np.isfinite(pr)]
    out["prod_rate_p5_p95"] = ((float(np.percentile(pr, 5)), float(np.percentile(pr, 95)))
                               if len(pr) else (float("nan"), float("nan")))
    # lag per partition: committed (broker) and position (the owner's gauge). Max over processes:
    # before commit 6d8b628 a process kept reporting the last lag of a partition it had handed
    # over; now it removes that gauge, so only the owner reports a partition (two owners at most
    # for the moment of a handover, both with a fresh value) and the max is just the owner's.
    tl, comm, pos = [], [], []
    for s in S:
        tl.append(s["t"])
        comm.append([e - c for e, c in zip(s["ends"], s["committed"])]
                    if s["ends"] and s["committed"] else [np.nan] * P)
        row = []
        for p in range(P):
            vals = [m["lag"].get(f"{res.get('topic', '')}:{p}") for m in s["metrics"].values()
                    if m] if res.get("topic") else []
            if not vals or all(v is None for v in vals):  # topic name unknown: match the suffix
                vals = [v for m in s["metrics"].values() if m
                        for k, v in m["lag"].items() if k.rsplit(":", 1)[1] == str(p)]
            vals = [v for v in vals if v is not None]
            row.append(max(vals) if vals else np.nan)
        pos.append(row)
    tl, comm, pos = np.asarray(tl), np.asarray(comm, dtype=float), np.asarray(pos, dtype=float)
    out["lag_t"], out["lag_comm"], out["lag_pos"] = tl, comm, pos
    prod_mask = (tl >= 0) & (tl <= t_end)
    at_end = int(np.argmin(np.abs(tl - t_end)))
    out["lag_table"] = []
    for p in range(P):
        out["lag_table"].append({
            "partition": p,
            "comm_max": np.nanmax(comm[prod_mask, p]) if prod_mask.any() else np.nan,
            "comm_mean": np.nanmean(comm[prod_mask, p]) if prod_mask.any() else np.nan,
            "comm_end": comm[at_end, p], "comm_final": comm[-1, p],
            "pos_max": np.nanmax(pos[prod_mask, p]) if prod_mask.any() else np.nan,
            "pos_mean": np.nanmean(pos[prod_mask, p]) if prod_mask.any() else np.nan,
            "pos_final": pos[-1, p]})
    # CPU share over the production phase
    i0 = int(np.argmax(tl >= 0))
    i1 = int(np.argmin(np.abs(tl - t_end)))
    out["cpu"] = {}
    if i1 > i0:
        dt = S[i1]["t"] - S[i0]["t"]
        for n in S[i0]["cpu"]:
            a, b = S[i0]["cpu"].get(n), S[i1]["cpu"].get(n)
            out["cpu"][n] = (b - a) / dt if a is not None and b is not None else float("nan")
    out["load_mean"] = float(np.mean([s["load1"] for s in S])) if S else float("nan")
    # releases and their latency
    rels = res.get("releases", [])
    W = res["window_s"]
    out["releases"] = []
    for r in rels:
        nominal_end = (r["window"] + 1) * W
        out["releases"].append(dict(r, nominal_end=nominal_end,
                                    lat_nominal=r["published_unix"] - nominal_end,
                                    lat_closed=r["published_unix"] - r["ended_unix"],
                                    lat_png=(r["png_unix"] - r["ended_unix"]
                                             if r.get("png_unix") else float("nan"))))
    fm = res.get("final_metrics") or {}
    out["lat_metric"] = (sum(m["lat_sum"] for m in fm.values() if m),
                         sum(m["lat_count"] for m in fm.values() if m))
    # exactly once
    counted_final = sum(m["events"] for m in fm.values() if m)
    released_n = sum(r["n"] for r in rels)
    released_events = sum(r["events"] for r in rels)
    out["exactly_once"] = {"produced": produced, "sent": prod.get("sent"),
                           "counted": counted_final, "released_n": released_n,
                           "released_events": released_events,
                           "ok": (produced is not None and produced == counted_final == released_n
                                  and released_n == released_events
                                  and not res.get("drain_timeout")
                                  and not res.get("final_timeout"))}
    return out


# ==============================================================================================
# part 2: accuracy against P
# ==============================================================================================
def _hist_of(release: dict) -> np.ndarray:
    pairs = release["histogram"]["pairs"]
    if not pairs:
        return np.zeros(0, dtype=np.int64)
    return np.repeat([r for r, _ in pairs], [c for _, c in pairs]).astype(np.int64)


def _merge_without_removal(summaries: list[dict]) -> dict:
    """``merge_summaries`` as before commit 05fa407: direct mode without removing the expected
    noise value counts of the (P - 1) * D counters a keyed topic leaves empty (the bench's
    before/after column; the merge is deterministic, so this is a paired comparison on the same
    summaries)."""
    import aggregator.service.partitioned as so
    keep = so.remove_empty_counters
    so.remove_empty_counters = lambda vc, empty, p, layers: vc
    try:
        return so.merge_summaries(summaries)
    finally:
        so.remove_empty_counters = keep


def _release(mode: str, model: str, parts: list[np.ndarray], pieces: list[np.ndarray],
             eps: float, B: int, rng) -> tuple[dict, float, dict | None]:
    """Merged release of P partition states; ``parts[p]`` are the items (indices) of partition p
    and ``pieces[p]`` their event counts there. Returns the release, the seconds it took, and in
    direct mode with P > 1 the release merged without the empty-counter removal (else None)."""
    from aggregator.service.partitioned import merge_summaries, partition_summary
    from aggregator.state import PanPrivateHistogram
    P = len(parts)
    info = {"kind": "count", "size": 0, "events": 0, "started_unix": 0.0, "ended_unix": 0.0}
    t0 = time.perf_counter()
    summaries = []
    for p in range(P):
        if mode == "direct":
            st = PanPrivateHistogram(eps, size=D, rng=rng)
            idx = parts[p]
        else:
            st = PanPrivateHistogram(eps, buckets=math.ceil(B / P), key=rng.bytes(16), rng=rng)
            idx = st.index_of(parts[p]) if len(parts[p]) else np.zeros(0, dtype=np.int64)
        st.add_indices(np.repeat(idx, pieces[p]))
        summaries.append(partition_summary(st, model=model, window=0, partition=p, partitions=P,
                                           window_info=dict(info, events=int(pieces[p].sum())),
                                           rng=rng))
    rel = merge_summaries(summaries)
    sec = time.perf_counter() - t0
    before = _merge_without_removal(summaries) if mode == "direct" and P > 1 else None
    return rel, sec, before


def run_accuracy(args) -> dict:
    from aggregator.estimate import l1_distance
    from aggregator.largedomain import choose_buckets
    n, eps = args.acc_n, 1.0
    Ps = (1, 6) if args.quick else (1, 2, 3, 6, 12)
    reps = args.reps
    B = choose_buckets(n, eps)
    keys = [str(k).encode() for k in range(D)]
    from kafka.partitioner import murmur2
    h32 = np.array([murmur2(k) & 0x7FFFFFFF for k in keys], dtype=np.int64)
    cells: dict[str, dict] = {}
    t_all = time.perf_counter()
    for rep in range(reps):
        rng_data = np.random.default_rng([SEED, 7, rep])
        h = true_counts(rng_data, "zipf", D, n)
        true = np.sort(h[h > 0])[::-1]
        for mode in ("direct", "hashed"):
            for model in ("joint", "state-only"):
                for P in Ps:
                    part = h32 % P
                    parts = [np.flatnonzero(part == p) for p in range(P)]
                    pieces = [h[ix] for ix in parts]
                    rng = np.random.default_rng([SEED, rep, P, mode == "hashed",
                                                 model == "joint"])
                    rel, sec, rel0 = _release(mode, model, parts, pieces, eps, B, rng)
                    c = cells.setdefault(f"{mode}|{model}|keyed|{P}",
                                         {"mode": mode, "model": model, "topic": "keyed",
                                          "P": P, "l1": [], "sec": [], "counters": None,
                                          "l1_no_removal": [], "empty_removed": None})
                    c["l1"].append(int(l1_distance(true, _hist_of(rel))))
                    if rel0 is not None:
                        c["l1_no_removal"].append(int(l1_distance(true, _hist_of(rel0))))
                    c["sec"].append(sec)
                    c["counters"] = rel["domain"]["counters"]
                    c["empty_removed"] = rel["domain"].get("empty_counters_removed")
                # unkeyed: the events in random order, round-robin over P_UNKEYED partitions
                Pu = 6
                events = rng_data.permutation(np.repeat(np.arange(D), h))
                split = np.stack([np.bincount(events[p::Pu], minlength=D) for p in range(Pu)])
                parts = [np.flatnonzero(split[p]) for p in range(Pu)]
                pieces = [split[p][ix] for p, ix in enumerate(parts)]
                piece_hist = np.sort(split[split > 0])[::-1]
                rng = np.random.default_rng([SEED, rep, 100 + Pu, mode == "hashed",
                                             model == "joint"])
                rel, sec, rel0 = _release(mode, model, parts, pieces, eps, B, rng)
                c = cells.setdefault(f"{mode}|{model}|unkeyed|{Pu}",
                                     {"mode": mode, "model": model, "topic": "unkeyed",
                                      "P": Pu, "l1": [], "sec": [], "l1_pieces": [],
                                      "counters": None, "distinct": [], "pieces": [],
                                      "l1_no_removal": [], "l1_pieces_no_removal": [],
                                      "empty_removed": None, "empty_true": []})
                est = _hist_of(rel)
                c["l1"].append(int(l1_distance(true, est)))
                c["l1_pieces"].append(int(l1_distance(piece_hist, est)))
                if rel0 is not None:
                    est0 = _hist_of(rel0)
                    c["l1_no_removal"].append(int(l1_distance(true, est0)))
                    c["l1_pieces_no_removal"].append(int(l1_distance(piece_hist, est0)))
                c["empty_removed"] = rel["domain"].get("empty_counters_removed")
                # counters that really hold no event: direct mode P * D minus the pieces
                c["empty_true"].append(Pu * D - len(piece_hist) if mode == "direct" else None)
                c["distinct"].append(len(true))
                c["pieces"].append(len(piece_hist))
                c["sec"].append(sec)
                c["counters"] = rel["domain"]["counters"]
        log(f"accuracy: repetition {rep + 1}/{reps} done "
            f"({time.perf_counter() - t_all:.0f} s so far; distinct items {len(true):,})")
    return {"n": n, "eps": eps, "D": D, "B": B, "Ps": list(Ps), "reps": reps, "cells": cells,
            "elapsed": time.perf_counter() - t_all}


# ==============================================================================================
# report
# ==============================================================================================
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_lag(a: dict, res: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    t_end = res.get("production", {}).get("t_end_rel")
    for p in range(res["partitions"]):
        axes[0].plot(a["lag_t"], a["lag_comm"][:, p], lw=1.2, label=f"partition {p}")
        axes[1].plot(a["lag_t"], a["lag_pos"][:, p], lw=1.2, label=f"partition {p}")
    axes[0].set_ylabel("records")
    axes[0].set_title("lag, committed offsets (broker: end offset - group's committed offset;\n"
                      "commits follow each partition's checkpoint, every 10 s by default)",
                      fontsize=9)
    axes[1].set_ylabel("records")
    axes[1].set_title("lag, consumer position (panagg_consumer_lag_records of the owning process, "
                      "refreshed every 5 s)", fontsize=9)
    for ax in axes:
        if t_end:
            ax.axvline(t_end, color="k", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=3)
    axes[1].set_xlabel("seconds since production started (dotted: production ended)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(a: dict, res: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for n in a["names"]:
        ax.plot(a["t"], a["per"][n], lw=1.1, label=f"process {n} (counted)")
    ax.plot(a["t"], a["total_rate"], lw=1.6, color="k", label="all processes (counted)")
    ax.plot(a["t"], a["prod_rate"], lw=1.0, color="grey", ls="--",
            label="produced (broker end offsets)")
    ax.axhline(res["rate"], color="r", ls=":", lw=1, label=f"target {res['rate']:,.0f}/s")
    t_end = res.get("production", {}).get("t_end_rel")
    if t_end:
        ax.axvline(t_end, color="k", ls=":", lw=1)
    ax.set_xlabel("seconds since production started (dotted: production ended)")
    ax.set_ylabel("events / s (per ~2 s sample)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency(a: dict, res: dict, path: Path) -> None:
    plt = _plt()
    rels = a["releases"]
    fig, ax = plt.subplots(figsize=(9, 4))
    if rels:
        x = np.arange(len(rels))
        ax.bar(x - 0.27, [r["lat_nominal"] for r in rels], 0.27,
               label="nominal window end -> release JSON")
        ax.bar(x, [r["lat_closed"] for r in rels], 0.27,
               label="last partition's close -> release JSON")
        ax.bar(x + 0.27, [r["lat_png"] for r in rels], 0.27,
               label="last partition's close -> release PNG (worker thread, after publishing)")
        ax.set_xticks(x, [f"w{i}\nn={r['n']:,}" for i, r in enumerate(rels)], fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title(f"release latency per {res['window_s']} s window (w0 = first window)",
                 fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if rels:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_accuracy(acc: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11.5, 4.8))
    styles = {("direct", "joint"): ("C0", "-o"), ("direct", "state-only"): ("C0", "--s"),
              ("hashed", "joint"): ("C1", "-o"), ("hashed", "state-only"): ("C1", "--s")}
    for (mode, model), (color, st) in styles.items():
        cs = sorted((c for c in acc["cells"].values()
                     if c["mode"] == mode and c["model"] == model and c["topic"] == "keyed"),
                    key=lambda c: c["P"])
        ms = [mean_se(c["l1"]) for c in cs]
        ax.errorbar([c["P"] for c in cs], [m for m, _ in ms],
                    yerr=[0 if math.isnan(s) else s for _, s in ms], fmt=st, color=color,
                    capsize=3, label=f"{mode}, {model} (keyed topic)")
        old = [c for c in cs if c.get("l1_no_removal")]
        if old:
            base = [c for c in cs if c["P"] == 1]
            xs = [c["P"] for c in base + old]
            ys = [mean_se(c["l1"])[0] for c in base] + [mean_se(c["l1_no_removal"])[0]
                                                        for c in old]
            ax.plot(xs, ys, ":", marker="o" if model == "joint" else "s", mfc="none",
                    color=color, alpha=0.5,
                    label=f"{mode}, {model}: without the empty-counter removal (before 05fa407)")
        u = [c for c in acc["cells"].values()
             if c["mode"] == mode and c["model"] == model and c["topic"] == "unkeyed"]
        if u:
            m, _ = mean_se(u[0]["l1"])
            ax.plot([u[0]["P"] * 1.06], [m], "x" if model == "joint" else "+", color=color,
                    ms=10, mew=2, label=f"{mode}, {model}, UNKEYED topic (round-robin)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(acc["Ps"], [str(p) for p in acc["Ps"]])
    ax.set_xlabel("partitions P")
    ax.set_ylabel("l1 error of the merged release")
    ax.set_title(f"n = {acc['n']:.0e} Zipf(1.1) over D = {acc['D']:.0e}, eps = {acc['eps']:g}; "
                 f"mean ± se of {acc['reps']} repetitions", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _n(v, digits=0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def write_report(results: dict, outdir: Path) -> Path:
    meta, res, acc = results["meta"], results.get("load"), results.get("accuracy")
    img = outdir / "img"
    img.mkdir(parents=True, exist_ok=True)
    rel_img = "img"
    L = ["# Scale-out under load, and what partitioning costs in accuracy", "",
         f"Command: `{meta['cmd']}`  ",
         f"Date: {meta['date']}; commit {meta['rev']}  ",
         f"Machine: {meta['cpu']}, {meta['cores']} cores (shared: the broker, the producer, the "
         f"aggregators and the bench all run on it); {meta['versions']}; {meta['java']}  ",
         f"Load average (1/5/15 min) at the start: {meta['load_start']}; at the end: "
         f"{meta['load_end']}"
         + (f"; mean of the 1-min load average over the load test's samples: "
            f"{meta['load_mean']:.2f}" if meta.get("load_mean") is not None else "") + "  ",
         f"Total run time: {meta['elapsed'] / 60:.1f} min.", ""]
    am = results.get("accuracy_meta")
    if am is not None:
        L[-2] = (f"Total run time: {meta['elapsed'] / 60:.1f} min (that run's accuracy part is "
                 "replaced by the re-run below).  ")
        L += [f"Part 2 (accuracy) re-run on its own, reusing part 1 from the saved results: "
              f"command `{am['cmd']}`; date {am['date']}; commit {am['rev']}; {am['cpu']}, "
              f"{am['cores']} cores; {am['versions']}; load average at the start "
              f"{am['load_start']}, at the end {am['load_end']}; "
              f"{am['elapsed'] / 60:.1f} min. The lines above are the load test's run.", ""]
    L += ["Generated by `bench/scaleout.py` (its docstring describes the method in full). "
          "Re-render from the saved samples with `--replot out/scaleout_results.json`.", ""]
    if res is not None:
        a = analyze_load(res)
        eo = a["exactly_once"]
        prod = res.get("production", {})
        L += ["## 1. Load test: "
              f"{res['processes']} processes, {res['partitions']} partitions, real broker", "",
              f"Setup: one Apache Kafka broker ({res.get('broker', 'kafka.sh')}, KRaft, loopback), "
              f"a fresh {res['partitions']}-partition topic; {res['processes']} `panagg run` "
              f"processes (`scale.partitioned=true`, one group, instance ids m1..m"
              f"{res['processes']}, one shared `--state-dir`), {res['mode']} mode"
              + (f" with D = {D:,}" if res["mode"] == "direct" else "")
              + f", `window.kind=time`, `window.size={res['window_s']}` (s), other settings "
              "default (checkpoint every 10 s or 200k events per partition, joint model, "
              f"eps = 1). Producer: one process, msgpack `{{\"item\": k}}` keyed by `str(k)`, "
              f"k ~ Zipf(1.1) over [0, {D:,}), target {res['rate']:,.0f} events/s for "
              f"{res['seconds']:.0f} s, started once the group had given every process "
              f"partitions ({', '.join(f'{k}: {int(v)}' for k, v in res.get('owned_at_start', {}).items())}). "
              f"Samples every {SAMPLE_S:.0f} s.", "",
              f"`scale.keep_windows={res.get('keep_windows')}`"
              + (" (the service default: after releasing window w, the merging process removes "
                 "the published window directories <= w - 3 from the shared state, so cleanup "
                 "runs during the load test)" if res.get("keep_windows", 3) == 3
                 else " (not the service default 3)")
              + (f"; window directories left in the state at the end: "
                 f"{len(res['window_dirs_left'])} of {len(res.get('releases', []))} released "
                 f"windows" if res.get("window_dirs_left") is not None else "") + ".", ""]
        if res.get("failure"):
            f = res["failure"]
            L += [f"**RUN FAILED: aggregator {f['member']} exited with status {f['rc']} at "
                  f"t = {f['t']:.0f} s; the bench stopped there (no restarts). Its log ends:**",
                  "", "```", *f["log_tail"].strip().splitlines()[-6:], "```", ""]
        L += ["### Summary", "",
              "| measured | value |", "|---|---|",
              f"| target rate | {res['rate']:,.0f} events/s for {res['seconds']:.0f} s "
              f"({int(res['rate'] * res['seconds']):,} events) |",
              f"| achieved producer rate | {_n(a['achieved_rate'])} events/s "
              f"({_n(eo['produced'])} records on the broker in "
              f"{prod.get('t_last', 0) - prod.get('t_first', 0):.1f} s; per-sample 5th..95th "
              f"percentile {_n(a['prod_rate_p5_p95'][0])}..{_n(a['prod_rate_p5_p95'][1])}/s) |",
              f"| counted, all processes (mean / p95 over samples while producing) | "
              f"{_n(a['total_stats'][0])} / {_n(a['total_stats'][1])} events/s |"]
        for n in a["names"]:
            m, p95, mx = a["per_stats"][n]
            L.append(f"| counted by {n} (mean / p95 / max over samples) | {_n(m)} / {_n(p95)} / "
                     f"{_n(mx)} events/s |")
        comm_max = np.nanmax([r["comm_max"] for r in a["lag_table"]])
        pos_max = np.nanmax([r["pos_max"] for r in a["lag_table"]])
        L += [f"| max lag over partitions while producing: committed / position | "
              f"{_n(comm_max)} / {_n(pos_max)} records |",
              "| drained (committed == end offsets, counted == produced) | "
              + (f"{res['drained_after_s']:.1f} s after the last record was produced |"
                 if "drained_after_s" in res else "**not within the timeout** |"),
              f"| releases (merged windows published) | {len(a['releases'])} "
              f"(ledger entries: {res.get('ledger_entries')}) |"]
        lats = [r["lat_nominal"] for r in a["releases"]]
        latc = [r["lat_closed"] for r in a["releases"]]
        if lats:
            L.append(f"| release latency, nominal window end -> file (median / max) | "
                     f"{np.median(lats):.2f} / {max(lats):.2f} s |")
            L.append(f"| release latency, last partition's close -> file (median / max) | "
                     f"{np.median(latc):.2f} / {max(latc):.2f} s |")
            latp = [r["lat_png"] for r in a["releases"] if not math.isnan(r["lat_png"])]
            if latp:
                L.append(f"| release PNG plot written (worker thread, after publishing), "
                         f"last partition's close -> PNG (median / max) | "
                         f"{np.median(latp):.2f} / {max(latp):.2f} s |")
        s, c = a["lat_metric"]
        if c:
            L.append(f"| `panagg_release_latency_seconds` (sum / count over processes) | "
                     f"mean {s / c:.2f} s over {int(c)} releases |")
        verdict = ("not checked: a process exited mid-run" if res.get("failure")
                   else "equal" if eo["ok"] else "NOT EQUAL")
        L += [f"| exactly once: records on the broker / events counted (sum of "
              f"`panagg_events_total`) / sum of released `n` | {_n(eo['produced'])} / "
              f"{_n(eo['counted'])} / {_n(eo['released_n'])} -> **{verdict}** |",
              f"| aggregator exit codes after SIGTERM | "
              f"{', '.join(f'{k}: {v}' for k, v in res.get('exit_codes', {}).items())} |"]
        ls = res.get("log_stats", {})
        L.append("| aggregator logs: warnings / errors / tracebacks | "
                 + ", ".join(f"{k}: {v['warnings']} / {v['errors']} / {v['tracebacks']}"
                             for k, v in ls.items()) + " |")
        if a["cpu"]:
            L.append("| CPU while producing (cores; 2.00 = the whole machine) | "
                     + ", ".join(f"{k} {v:.2f}" for k, v in a["cpu"].items())
                     + f"; sum {sum(v for v in a['cpu'].values() if not math.isnan(v)):.2f} |")
        if res.get("machine_busy_cores") is not None:
            ours = sum(v for v in a["cpu"].values() if not math.isnan(v))
            L.append(f"| whole machine busy while producing (/proc/stat) | "
                     f"{res['machine_busy_cores']:.2f} cores, of which this bench's processes "
                     f"{ours:.2f} and others {res['machine_busy_cores'] - ours:.2f} |")
        if res.get("other_processes"):
            L.append("| other processes seen using CPU while producing (cores) | "
                     + "; ".join(f"{c:.2f} `{cmd[:70]}`" for c, _pid, cmd in
                                 res["other_processes"][:5]) + " |")
        L += ["", "### Lag per partition", "",
              "Committed lag = end offset (broker) - the group's committed offset (broker). The "
              "service commits a partition's offset only after that partition's checkpoint "
              "(every 10 s or 200k events by default), so this lag includes up to one checkpoint "
              "interval of counted-but-not-yet-committed records: a sawtooth even when the "
              "processes keep up. Position lag = `panagg_consumer_lag_records` (end offset - "
              "the consumer's fetch position), which each process refreshes every 5 s for its "
              "partitions.", "",
              "| partition | committed: max / mean while producing | at production end | "
              "final | position: max / mean while producing | final |",
              "|---|---|---|---|---|---|"]
        for r in a["lag_table"]:
            L.append(f"| {r['partition']} | {_n(r['comm_max'])} / {_n(r['comm_mean'])} | "
                     f"{_n(r['comm_end'])} | {_n(r['comm_final'])} | {_n(r['pos_max'])} / "
                     f"{_n(r['pos_mean'])} | {_n(r['pos_final'])} |")
        L += ["", f"![lag]({rel_img}/scaleout_lag.png)", "",
              "### Throughput per process", "",
              f"![throughput]({rel_img}/scaleout_throughput.png)", "",
              "### Releases", "",
              "Latency from the window's nominal end ((w + 1) x size in Unix time) and from the "
              "last partition's close (`window_info.ended_unix`, what "
              "`panagg_release_latency_seconds` measures) to the release file's mtime. Windows "
              "are processing-time windows: a partition closes window w when its owner's loop "
              "sees the clock pass the boundary, so events still in the lag at that moment "
              "count in window w + 1. Windows that started before production are partial (or "
              "empty, n = 0, and released all the same), the last ones after it.", "",
              "The merging process writes the release JSON, sends it to `release.topic` (when "
              "one is set; not here), writes the window's `published` marker and observes "
              "`panagg_release_latency_seconds` (now - last close), and only then hands the PNG "
              "plot to a worker thread (since commit 6d8b628; before, the plot was rendered "
              "in the consume loop before publishing). So the metric sees about the JSON "
              "column; the last column is the PNG's mtime, off the release path.", "",
              "| window | n | events (sum of partitions) | nominal end -> JSON s | last close "
              "-> JSON s | merge s | last close -> PNG s |", "|---|---|---|---|---|---|---|"]
        for i, r in enumerate(a["releases"]):
            L.append(f"| w{i} ({r['window']}) | {r['n']:,} | {r['events']:,} | "
                     f"{r['lat_nominal']:.2f} | {r['lat_closed']:.2f} | "
                     f"{(r['merge_s'] or 0):.3f} | {r['lat_png']:.2f} |")
        L += ["", f"![release latency]({rel_img}/scaleout_latency.png)", ""]
        plot_lag(a, res, img / "scaleout_lag.png")
        plot_throughput(a, res, img / "scaleout_throughput.png")
        plot_latency(a, res, img / "scaleout_latency.png")
        results["load_summary"] = {
            "achieved_rate": a["achieved_rate"], "per_stats": a["per_stats"],
            "total_stats": a["total_stats"], "lag_table": a["lag_table"],
            "exactly_once": eo, "releases": len(a["releases"]), "cpu": a["cpu"],
            "lat_nominal": lats, "lat_closed": latc}
    if acc is not None:
        L += _accuracy_section(acc, rel_img)
        plot_accuracy(acc, img / "scaleout_accuracy.png")
    notes = _carried_notes(outdir / "scaleout_load.md")
    L += notes or ["## Notes (hand-written; kept when the report is regenerated)", "",
                   "(to be written after reading the numbers)", ""]
    path = outdir / "scaleout_load.md"
    path.write_text("\n".join(L).rstrip() + "\n")
    return path


def _accuracy_section(acc: dict, rel_img: str) -> list[str]:
    L = ["## 2. Accuracy of the merged release against the number of partitions (offline)", "",
         f"n = {acc['n']:,} events, Zipf(1.1) over D = {acc['D']:,} (fresh histogram per "
         f"repetition), eps = {acc['eps']:g}, {acc['reps']} repetitions per cell (mean ± se of "
         "the l1 distance between the merged release and the true anonymized histogram). Items "
         "go to partition murmur2(str(k)) mod P, as Kafka's default partitioner places a topic "
         "keyed by item. Each partition is a `PanPrivateHistogram` (seeded noise); "
         "`partition_summary` adds the release layer in the joint model; `merge_summaries` "
         f"gives the release. Hashed mode: B = choose_buckets(n, eps) = {acc['B']:,} in total, "
         "ceil(B / P) per partition. Direct mode: D counters per partition, so P x D in the "
         "release; with P > 1 the merge subtracts the expected noise value counts of the "
         "(P - 1) x D counters a keyed topic leaves empty before estimating "
         "(`remove_empty_counters`, since commit 05fa407; the release's "
         "`domain.empty_counters_removed`). The column \"without the removal\" merges the same "
         "summaries as before that commit (the merge is deterministic, so the two columns are "
         "paired: same data, same noise). Ratio = error at P / error at P = 1 (delta-method "
         "se).", "",
         "| mode | model | P | counters in the release | empty counters removed | l1 error | "
         "ratio to P = 1 | l1 without the removal (before 05fa407) | ratio to P = 1 without "
         "the removal | merge s (mean) |", "|---|---|---|---|---|---|---|---|---|---|"]
    cells = acc["cells"]

    def _dash(v):
        return "-" if v is None else f"{v:,}"

    for mode in ("direct", "hashed"):
        for model in ("joint", "state-only"):
            base = cells.get(f"{mode}|{model}|keyed|1")
            for P in acc["Ps"]:
                c = cells[f"{mode}|{model}|keyed|{P}"]
                m, se = mean_se(c["l1"])
                r, rse = ratio_se(c["l1"], base["l1"]) if base else (float("nan"),) * 2
                old, old_r = "-", "-"
                if c.get("l1_no_removal"):
                    old = fmt(*mean_se(c["l1_no_removal"]))
                    if base:
                        old_r = fmt(*ratio_se(c["l1_no_removal"], base["l1"]))
                L.append(f"| {mode} | {model} | {P} | {c['counters']:,} | "
                         f"{_dash(c.get('empty_removed'))} | {fmt(m, se)} | {fmt(r, rse)} | "
                         f"{old} | {old_r} | {np.mean(c['sec']):.2f} |")
    L += ["", "Unkeyed topic (records without the item as key; the events, in random order, go "
          "round-robin to P = 6 partitions, so each item with c events becomes up to 6 pieces "
          "of about c / 6). The release then estimates the histogram of the pieces; error "
          "against the true item histogram, and against the pieces' histogram (what the "
          "release actually estimates):", "",
          "The direct-mode merge cannot tell an unkeyed topic from a keyed one: it removes "
          "(P - 1) x D empty counters all the same, while P x D minus the pieces are really "
          "empty: too many removed whenever the pieces outnumber D (column \"empty counters: "
          "removed / really empty\").", "",
          "| mode | model | P | distinct items / pieces (mean) | empty counters: removed / "
          "really empty (mean) | l1 vs items | ratio to the keyed topic at the same P | "
          "l1 vs pieces | without the removal: l1 vs items / vs pieces |",
          "|---|---|---|---|---|---|---|---|---|"]
    for c in cells.values():
        if c["topic"] != "unkeyed":
            continue
        keyed = cells.get(f"{c['mode']}|{c['model']}|keyed|{c['P']}")
        m, se = mean_se(c["l1"])
        r, rse = ratio_se(c["l1"], keyed["l1"]) if keyed else (float("nan"),) * 2
        mp_, sp = mean_se(c["l1_pieces"])
        et = [e for e in c.get("empty_true", []) if e is not None]
        empty = (f"{_dash(c.get('empty_removed'))} / {np.mean(et):,.0f}" if et
                 else _dash(c.get("empty_removed")))
        old = "-"
        if c.get("l1_no_removal"):
            old = (f"{fmt(*mean_se(c['l1_no_removal']))} / "
                   f"{fmt(*mean_se(c['l1_pieces_no_removal']))}")
        L.append(f"| {c['mode']} | {c['model']} | {c['P']} | {np.mean(c['distinct']):,.0f} / "
                 f"{np.mean(c['pieces']):,.0f} | {empty} | {fmt(m, se)} | {fmt(r, rse)} | "
                 f"{fmt(mp_, sp)} | {old} |")
    L += ["", f"![accuracy vs P]({rel_img}/scaleout_accuracy.png)", "",
          f"Accuracy part: {acc['elapsed']:.0f} s.", ""]
    return L


def _carried_notes(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    text = path.read_text()
    i = text.find("## Notes (hand-written")
    if i < 0:
        return None
    return text[i:].rstrip("\n").split("\n") + [""]


# ==============================================================================================
def _java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30)
        return (out.stderr or out.stdout).splitlines()[0].strip()
    except Exception:  # noqa: BLE001
        return "java: unknown"


def _json_default(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=20_000, help="target events/s (<= 200,000)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="production time (default 3, or 1 with --quick; <= 30)")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--window", type=int, default=30, help="time window, seconds")
    ap.add_argument("--mode", choices=("direct", "hashed"), default="direct")
    ap.add_argument("--keep-windows", type=int, default=KEEP_WINDOWS,
                    help=f"scale.keep_windows of the aggregators (default {KEEP_WINDOWS}, the "
                         "service default: merges clean up old window directories during the "
                         "run; a large value keeps them all)")
    ap.add_argument("--reps", type=int, default=None,
                    help="accuracy repetitions (default 5, or 2 with --quick)")
    ap.add_argument("--acc-n", type=int, default=1_000_000, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="1 min load test, accuracy at P in {1, 6}, 2 reps; writes under out/")
    ap.add_argument("--skip-load", action="store_true",
                    help="no load test (the results JSON and the report then have no part 1; "
                         "to keep a saved one, use --load-from)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--load-from", metavar="RESULTS_JSON", default=None,
                    help="no load test: reuse part 1 (its samples and its run's header: "
                         "command, date, commit, machine, load averages) from a saved results "
                         "JSON, run part 2 now, and write the report and the results JSON with "
                         "both (the header says which run each part comes from)")
    ap.add_argument("--outdir", default=None, help="default docs/ (out/ with --quick)")
    ap.add_argument("--replot", metavar="RESULTS_JSON", default=None)
    args = ap.parse_args(argv)
    if args.minutes is None:
        args.minutes = 1.0 if args.quick else 3.0
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if not 0 < args.rate <= MAX_RATE:
        ap.error(f"--rate must be in (0, {MAX_RATE:,}] events/s")
    if not 0 < args.minutes <= MAX_MINUTES:
        ap.error(f"--minutes must be in (0, {MAX_MINUTES}]")
    if not 1 <= args.processes <= MAX_PROCESSES:
        ap.error(f"--processes must be in [1, {MAX_PROCESSES}]")
    if not 1 <= args.partitions <= MAX_PARTITIONS:
        ap.error(f"--partitions must be in [1, {MAX_PARTITIONS}]")
    if args.processes > args.partitions:
        ap.error("--processes must not exceed --partitions (an idle member owns nothing)")
    if not 5 <= args.window <= 3600:
        ap.error("--window must be in [5, 3600] seconds")
    if not 1 <= args.reps <= 50 or not 10_000 <= args.acc_n <= 10_000_000:
        ap.error("--reps must be in [1, 50]")
    outdir = Path(args.outdir) if args.outdir else ROOT / ("out" if args.quick else "docs")
    raw = ROOT / "out" / ("scaleout_results_quick.json" if args.quick else "scaleout_results.json")

    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        path = write_report(results, outdir)
        print(f"wrote {path}", flush=True)
        return 0
    saved = None
    if args.load_from:
        saved = json.loads(Path(args.load_from).read_text())
        if "load" not in saved:
            ap.error(f"--load-from: {args.load_from} has no load test results")
        args.skip_load = True

    signal.signal(signal.SIGTERM, _on_sigterm)
    cmd = " ".join([".venv/bin/python -m bench.scaleout", *(argv if argv is not None
                                                             else sys.argv[1:])])
    meta = {"cmd": cmd, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "rev": git_rev(["aggregator", "consumers", "state_store", "bench/scaleout.py"]),
            "cpu": cpu_model(), "cores": os.cpu_count(),
            "versions": versions(("numpy", "kafka-python", "prometheus-client", "msgpack")),
            "java": _java_version(),
            "load_start": " / ".join(f"{x:.2f}" for x in _loadavg())}
    results: dict = {"meta": meta}
    if saved is not None:
        # part 1 and the header from the saved run; this run's metadata goes with part 2
        results = {"meta": saved["meta"], "load": saved["load"], "accuracy_meta": meta}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="panagg-scaleout-") as t:
        if not args.skip_load:
            res = run_load(args, Path(t))
            results["load"] = res
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps(results, default=_json_default))
    if not args.skip_accuracy:
        log(f"accuracy sweep: n = {args.acc_n:,}, {args.reps} repetitions ...")
        results["accuracy"] = run_accuracy(args)
    meta["elapsed"] = time.perf_counter() - t0
    meta["load_end"] = " / ".join(f"{x:.2f}" for x in _loadavg())
    if "load" in results and saved is None:
        S = results["load"]["samples"]
        meta["load_mean"] = float(np.mean([s["load1"] for s in S])) if S else None
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(results, default=_json_default))
    path = write_report(results, outdir)
    ls = results.get("load_summary")
    if ls:
        eo = ls["exactly_once"]
        log(f"achieved {ls['achieved_rate']:,.0f} events/s; per process (mean events/s): "
            + ", ".join(f"{k} {v[0]:,.0f}" for k, v in ls["per_stats"].items())
            + f"; releases {ls['releases']}; exactly once: produced {eo['produced']} counted "
              f"{eo['counted']} released {eo['released_n']} -> "
              + ("not checked (a process exited mid-run)" if results["load"].get("failure")
                 else "OK" if eo["ok"] else "MISMATCH"))
    print(f"wrote {path} and {outdir}/img/scaleout_*.png (raw samples: {raw})", flush=True)
    return 1 if results.get("load", {}).get("failure") else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; processes and broker stopped", file=sys.stderr)
        sys.exit(130)
