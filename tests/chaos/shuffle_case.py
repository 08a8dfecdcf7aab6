"""The shuffle analyzer under the harness's faults (issue 46; docs/chaos.md, "The shuffle
analyzer").

Three processes, as docs/shuffle.md deploys them: the harness plays the clients (each event
randomized and sealed to the analyzer's key by :class:`~aggregator.service.shuffle_client.
ShuffleClient`, one record keyed by its event id on a 3-partition client topic), ``panagg
shuffle`` turns them into permuted windows on the analyzer topic, and the analyzer (``panagg
run`` with ``state.model = shuffle``) releases each window at its end marker.

What a user can read does not tie an event to a window: the shuffler strips every client
position on purpose (no offset, partition or event boundary passes to the analyzer topic), and
the analyzer's ledger names analyzer-topic positions only (``end_offsets``). So the check is
:func:`check_shuffle`: windows decided once and consecutive, each release's ``n`` equal to its
end marker's ``events``, each marker's ``messages`` equal to the boxes of its window, every
marker decided, each release published once with the ledger's ``n``, and the events conserved
in total (the markers' events plus the shuffler's open window equal the distinct event ids on
the client topic). A lost event and a doubled one in the same run would cancel there.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["check_shuffle", "run_shuffle_case"]


def check_shuffle(
    entries: list[dict],
    docs: dict[int, list[dict]],
    analyzer: list[tuple[int, dict]],
    client_events: int,
    open_events: int,
    n: int,
):
    """The invariant the shuffle analyzer's outputs allow (module docstring) over its ledger
    ``entries``, its release documents ``docs``, the analyzer topic's committed records
    ``analyzer`` (``(offset, parsed record)``), the distinct event ids on the client topic and
    the events the shuffler's open window holds; ``n`` is the randomizer outputs per window.

    >>> mk = lambda w, e: {"v": 2, "window": w, "end": True, "events": e, "topped_up": 0,
    ...                    "messages": 3}
    >>> topic = [(0, {"window": 0, "boxes": [b"", b"", b""]}), (1, mk(0, 10)),
    ...          (2, {"window": 1, "boxes": [b"", b"", b""]}), (3, mk(1, 10))]
    >>> rel = lambda w, e: {"kind": "release", "window": w, "end_offsets": {"a:0": e},
    ...                     "document": json.dumps({"window": w, "n": 10})}
    >>> docs = {0: [{"window": 0, "n": 10}], 1: [{"window": 1, "n": 10}]}
    >>> check_shuffle([rel(0, 2), rel(1, 4)], docs, topic, 24, 4, 10).violations
    []
    >>> # a window released twice, and an event lost (the totals do not meet)
    >>> check_shuffle([rel(0, 2), rel(1, 4), rel(1, 4)], docs, topic, 25, 4, 10).violations
    ['windows decided twice in the ledger: [1]', \
'events: the markers hold 20 and the open window 4, the client topic 25 distinct events']
    >>> # a window the analyzer never decided, and one whose release says another n
    >>> bad = rel(0, 2)
    >>> bad["document"] = json.dumps({"window": 0, "n": 9})
    >>> check_shuffle([bad], {0: [{"window": 0, "n": 9}]}, topic, 24, 4, 10).violations
    ['window 0: n 9 but its end marker says 10 events', \
'window 1: its end marker (offset 3) is on the analyzer topic but the ledger has no entry of it']
    """
    from .invariant import Coverage, _content

    cov = Coverage()
    bad = cov.violations.append
    boxes: dict[int, int] = {}
    markers: dict[int, list[tuple[int, dict]]] = {}
    for off, rec in analyzer:
        if rec.get("end") is True:
            markers.setdefault(rec["window"], []).append((off, rec))
        else:
            boxes[rec["window"]] = boxes.get(rec["window"], 0) + len(rec.get("boxes") or ())
    twice = sorted(w for w, ms in markers.items() if len(ms) > 1)
    if twice:
        bad(f"windows written twice on the analyzer topic: {twice}")
    for w, ms in sorted(markers.items()):
        mk = ms[0][1]
        if mk["messages"] != boxes.get(w, 0):
            bad(
                f"window {w}: its end marker counts {mk['messages']} messages, its chunks hold "
                f"{boxes.get(w, 0)}"
            )
        if mk["events"] + mk["topped_up"] != n:
            bad(f"window {w}: {mk['events']} events + {mk['topped_up']} top-ups, not n = {n}")
    decided = [e for e in entries if e.get("kind") in ("release", "refused")]
    ids = [e["window"] for e in decided]
    if len(ids) != len(set(ids)):
        bad(f"windows decided twice in the ledger: {sorted({w for w in ids if ids.count(w) > 1})}")
    if ids:
        missing = sorted(set(range(min(ids), max(ids) + 1)) - set(ids))
        if missing:
            bad(f"windows missing between {min(ids)} and {max(ids)}: {missing}")
    for e in sorted(decided, key=lambda e: e["window"]):
        w = e["window"]
        if not markers.get(w):
            bad(f"window {w}: decided in the ledger but no end marker of it is on the topic")
            continue
        off, mk = markers[w][0]
        if e["kind"] == "refused":
            cov.refused.append(w)
            continue
        cov.windows.append(w)
        n_w = int(json.loads(e["document"])["n"])
        cov.released_events += n_w
        if n_w != mk["events"]:
            bad(f"window {w}: n {n_w} but its end marker says {mk['events']} events")
        if list((e.get("end_offsets") or {}).values()) != [off + 1]:
            bad(f"window {w}: ledgered end {e.get('end_offsets')}, its marker is at {off}")
        published = docs.get(w, [])
        if not published:
            bad(f"window {w}: released in the ledger but no release document")
        for doc in published:
            if doc.get("n") != n_w:
                bad(f"window {w}: a published document says n={doc.get('n')}, the ledger {n_w}")
        if len({_content(d) for d in published}) > 1:
            bad(f"window {w}: published with {len({_content(d) for d in published})} contents")
    for w in sorted(set(markers) - set(ids)):
        bad(
            f"window {w}: its end marker (offset {markers[w][0][0]}) is on the analyzer topic "
            "but the ledger has no entry of it"
        )
    for w in sorted(docs):
        if w not in cov.windows:
            bad(f"window {w}: a document is published but the ledger has no release of it")
    held = sum(ms[0][1]["events"] for ms in markers.values())
    if held + open_events != client_events:
        bad(
            f"events: the markers hold {held} and the open window {open_events}, the client "
            f"topic {client_events} distinct events"
        )
    return cov


class _ClientProducer(threading.Thread):
    """Clients at a steady rate: each event randomized and sealed, one record keyed by its
    event id (a retried send may write a record twice: the shuffler drops the redelivery)."""

    def __init__(
        self, bootstrap: str, topic: str, rate: int, seed: int, sets: list[str], domain: int
    ):
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.rate, self.domain = bootstrap, topic, rate, domain
        self.rng = random.Random(seed)
        self.sets = sets
        self.stop = threading.Event()

    def run(self) -> None:
        from kafka import KafkaProducer

        from aggregator.service.config import load_config
        from aggregator.service.shuffle_client import ShuffleClient

        client = ShuffleClient.from_config(load_config(None, self.sets))
        producer = None
        i, t0 = 0, time.monotonic()
        batch = max(1, self.rate // 20)
        while not self.stop.is_set():
            items = [min(int(self.rng.paretovariate(1.2)), self.domain - 1) for _ in range(batch)]
            records = client.records(items)
            while not self.stop.is_set():
                try:
                    if producer is None:
                        producer = KafkaProducer(
                            bootstrap_servers=self.bootstrap,
                            linger_ms=5,
                            acks="all",
                            retries=5,
                            reconnect_backoff_max_ms=500,
                        )
                    for key, value in records:
                        producer.send(self.topic, key=key, value=value)
                    break
                except Exception:  # the broker is away: try again in a moment
                    time.sleep(0.5)
            i += batch
            time.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
        if producer is not None:
            try:
                producer.flush(timeout=30)
                producer.close(timeout=10)
            except Exception:
                pass


def run_shuffle_case(
    broker,
    mode: str,
    fault: str,
    seed: int,
    workdir: Path,
    *,
    seconds: float,
    settle: float,
    faults: int,
):
    """One run of the shuffle mode under ``fault`` (kill9: the shuffler or the analyzer,
    drawn; broker_kill, broker_restart, start_broker_away as for the other modes)."""
    from kafka.admin import NewTopic

    from aggregator.service.shuffle_wire import (
        new_keypair,
        parse_analyzer_record,
        public_key_hex,
        save_private_key,
    )

    from .harness import (
        MODES,
        SHUFFLE_B,
        SHUFFLE_N,
        SHUFFLE_RATE,
        Result,
        _admin,
        _make_topic,
        _read_topic,
        _Service,
    )
    from .invariant import read_ledger, read_releases

    rng = random.Random(seed)
    spec = MODES[mode]
    res = Result(mode, fault, seed)
    t_start = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    if not broker.running():
        broker.start()
    bootstrap = broker.bootstrap
    clients = _make_topic(bootstrap)
    analyzer, dlq = f"{clients}-shuffled", f"{clients}-dlq"
    admin = _admin(bootstrap)
    admin.create_topics([NewTopic(analyzer, 1, 1), NewTopic(dlq, 1, 1)])
    admin.close()
    key = new_keypair()
    save_private_key(key, str(workdir / "analyzer.key"))
    sets = [
        *spec.sets,
        f"source.bootstrap={bootstrap}",
        f"source.topic={analyzer}",
        f"shuffle.public_key={public_key_hex(key)}",
        f"shuffle.client_topic={clients}",
        f"shuffle.group=sh-{clients}",
        f"shuffle.shuffler_dir={workdir / 'shuffler-state'}",
        f"shuffle.key_file={workdir / 'analyzer.key'}",
        f"source.dead_letter_topic={dlq}",
        f"source.group=an-{clients}",
        f"checkpoint.dir={workdir / 'state'}",
        f"release.dir={workdir / 'releases'}",
        "release.error_bar_reps=0",
        "source.connect_timeout_s=60",
        "metrics.port=-1",
    ]
    setargs = [x for s in sets for x in ("--set", s)]
    roles = {
        "shuffler": ["shuffle", "--config", os.devnull, *setargs],
        "analyzer": ["run", "--config", os.devnull, *setargs],
    }
    for name in roles:
        (workdir / name).mkdir(exist_ok=True)
    services = {name: _Service(args, workdir / name) for name, args in roles.items()}
    producer = _ClientProducer(
        bootstrap,
        clients,
        SHUFFLE_RATE,
        seed,
        [s for s in sets if not s.startswith("shuffle.key_file")],
        SHUFFLE_B,
    )
    producer.start()
    returns: list[float] = []
    if fault == "start_broker_away":
        time.sleep(rng.uniform(1, 3))
        broker.stop()
        for svc in services.values():
            svc.start()
        time.sleep(rng.uniform(2, 6))
        broker.start()
        returns.append(time.time())
        res.faults += 1
    else:
        time.sleep(rng.uniform(0.5, 2))
        for svc in services.values():
            svc.start()
    t0 = time.monotonic()
    planned = sorted(rng.uniform(2, seconds - 2) for _ in range(faults))
    while time.monotonic() < t0 + seconds:
        for svc in services.values():
            svc.check_alive()
        if (
            planned
            and time.monotonic() >= t0 + planned[0]
            and fault in ("kill9", "broker_kill", "broker_restart")
        ):
            planned.pop(0)
            res.faults += 1
            if fault == "kill9":
                name = rng.choice(sorted(services))
                res.notes.append(f"kill -9 of the {name}")
                services[name].kill9()
                time.sleep(rng.uniform(0, 1.5))
                services[name].start()
            else:
                broker.kill() if fault == "broker_kill" else broker.stop()
                time.sleep(rng.uniform(1, 5))
                broker.start()
                returns.append(time.time())
        time.sleep(0.2)
    producer.stop.set()
    producer.join(60)
    time.sleep(settle + 10)
    for svc in services.values():
        svc.check_alive()
    # both stop on SIGTERM with exit status 0 (the shuffler since this harness found it did not)
    for svc in services.values():
        svc.stop()
    # drain: the shuffler reads the client topic to its end (the open window stays open), then
    # the analyzer reads the analyzer topic to its end
    env = dict(os.environ, PANAGG_TESTING="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    drains = {}
    for name, idle in (("shuffler", "6"), ("analyzer", "4")):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                *roles[name],
                "--exit-when-idle",
                idle,
            ],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        (workdir / f"{name}-drain.log").write_text(done.stderr + done.stdout)
        drains[name] = done
        if done.returncode != 0:
            res.violations.append(
                f"the {name}'s draining start exited {done.returncode}: {done.stderr[-1500:]}"
            )
    for name, svc in services.items():
        res.violations += [f"[{name}] {p}" for p in svc.problems]
    m = re.search(r"stopping with (\d+) event\(s\) in the open window", drains["shuffler"].stderr)
    if m is None:
        res.violations.append("the shuffler's drain did not say its open window's events")
        open_events = 0
    else:
        open_events = int(m.group(1))
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
    tps = [TopicPartition(clients, p) for p in sorted(c.partitions_for_topic(clients) or ())]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    end = c.end_offsets(tps)
    records, ids = 0, set[bytes]()
    deadline = time.monotonic() + 120
    while any(c.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=500).values():
            records += len(recs)
            ids.update(r.key for r in recs)
    c.close()
    res.produced = len(ids)
    if records != len(ids):
        res.notes.append(f"{records - len(ids)} client records written twice (retried sends)")
    topic = [
        (off, parse_analyzer_record(v))
        for recs in _read_topic(bootstrap, analyzer).values()
        for off, v in recs
    ]
    state = workdir / "state"
    entries = read_ledger(state / "ledger.jsonl") if (state / "ledger.jsonl").exists() else []
    if not entries:
        res.violations.append("the analyzer has no ledger")
    docs = read_releases(workdir / "releases") if (workdir / "releases").exists() else {}
    cov = check_shuffle(entries, docs, topic, len(ids), open_events, SHUFFLE_N)
    res.violations += [f"[shuffle] {v}" for v in cov.violations]
    res.released["shuffle"] = cov.released_events
    res.unreleased["shuffle"] = open_events
    if cov.refused:
        res.notes.append(f"windows refused: {cov.refused}")
    if open_events > spec.window_events:
        res.violations.append(
            f"[shuffle] {open_events} events in the open window: more than "
            f"a window holds ({spec.window_events})"
        )
    published = [p.stat().st_mtime for p in (workdir / "releases").rglob("release-*.json")]
    for back in returns:
        later = [t - back for t in published if t > back]
        res.resume_s.append(round(min(later), 2) if later else None)
        res.resume_censored.append(False)
    res.seconds = time.monotonic() - t_start
    return res
