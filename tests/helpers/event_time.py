"""Event-time windows as the tests drive them: an in-memory stand-in for Kafka partitions whose
poll order (the interleaving of partitions) a test chooses, so cross-partition order is exact;
the settings and releases of a service over it; and each record's window as the definitions of
allowed lateness give it (:func:`reference`, one partition at a time, windows of :data:`SIZE`)."""

from __future__ import annotations

import json

import numpy as np

from aggregator.service.config import load_config
from consumers.base import Segment, Source


class ListSource(Source):
    """Partitions of (timestamp s or None, item) records, read ``chunk`` records a poll from the
    partitions in ``order`` (round robin), with Kafka's pause / resume / seek."""

    def __init__(self, parts: dict[str, list], order=None, chunk=2):
        self.parts, self.chunk = parts, chunk
        self.order = list(order or parts)
        self.assigned = set(parts)
        self.pos = {p: 0 for p in parts}
        self.paused: set[str] = set()
        self.turn = 0

    def seek(self, offsets):
        for p, o in offsets.items():
            self.pos[p] = o

    def seek_partition(self, p, offset):
        self.pos[p] = offset

    def pause(self, keys):
        self.paused |= set(keys)

    def resume(self, keys):
        self.paused -= set(keys)

    def caught_up(self, keys):
        return all(self.pos[p] >= len(self.parts[p]) for p in keys)

    def poll(self, timeout_s=1.0):
        for k in range(len(self.order)):
            p = self.order[(self.turn + k) % len(self.order)]
            lo = self.pos[p]
            recs = self.parts[p][lo : lo + self.chunk]
            if p in self.paused or not recs:
                continue
            self.turn = (self.turn + k + 1) % len(self.order)
            self.pos[p] = lo + len(recs)
            return [
                Segment(
                    p,
                    range(lo, lo + len(recs)),
                    [json.dumps({"item": item}).encode() for _, item in recs],
                    timestamps=[-1 if t is None else int(t * 1000) for t, _ in recs],
                )
            ]
        self.exhausted = not self.paused and self.caught_up(self.parts)
        return []


def cfg_for(tmp_path, *sets):
    return load_config(
        None,
        [
            "source.kind=kafka",
            "source.topic=t",
            "source.format=json",
            "state.domain_size=100",
            "window.kind=event_time",
            "window.size=10",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.error_bar_reps=0",
            "release.estimator=threshold",
            "window.idle_partition_timeout_s=0.05",
            *sets,
        ],
        env={},
    )


def releases(tmp_path):
    docs = [json.loads(p.read_text()) for p in sorted((tmp_path / "releases").glob("*.json"))]
    return sorted(
        (
            {
                k: d["window_info"][k]
                for k in ("event_start_unix", "event_end_unix", "events", "late")
            }
            for d in docs
        ),
        key=lambda w: w["event_start_unix"],
    )


def released_windows(tmp_path):
    """:func:`releases` with each window's ``n``."""
    docs = [json.loads(p.read_text()) for p in (tmp_path / "releases").glob("*.json")]
    return sorted(
        (
            {
                k: d["window_info"][k]
                for k in ("event_start_unix", "event_end_unix", "events", "late")
            }
            | {"n": d["n"]}
            for d in docs
        ),
        key=lambda w: w["event_start_unix"],
    )


SIZE = 10


def reference(parts: dict, lateness: float, late: str):
    """Each record's window (its item -> window index, or "dead" for a late dead letter) and
    each window's [events, late], from the definitions (aggregator/service/event_time.py):
    window a closes at each partition's first record stamped at or after its end + lateness (a
    partition read to its end does not hold it); records before that point go to the window
    their timestamp says, late ones to a (or dead letters); the next window is a + 1 if that
    got records, else the earliest window of the records the partitions stopped at."""
    pos = dict.fromkeys(parts, 0)
    where, windows = {}, {}
    a = min(int(recs[0][0] // SIZE) for recs in parts.values() if recs)
    while True:
        stopped = {}
        for p, recs in parts.items():
            i = pos[p]
            while i < len(recs) and recs[i][0] < (a + 1) * SIZE + lateness:
                t, item = recs[i]
                k = int(t // SIZE)
                if k < a:
                    windows.setdefault(a, [0, 0])[1] += 1
                    k = a if late == "next" else "dead"
                if k != "dead":
                    windows.setdefault(k, [0, 0])[0] += 1
                where[item] = k
                i += 1
            pos[p] = i
            if i < len(recs):
                stopped[p] = int(recs[i][0] // SIZE)
        if not stopped:  # every partition read to its end: the input's end releases the rest
            return where, windows
        a = a + 1 if windows.get(a + 1, [0])[0] else min(stopped.values())


def contiguous_stream(rng, parts=3, windows=6, per_window=12, lateness=4, size=10):
    """Per partition, timestamps (s) window after window, shuffled within the window and its
    lateness, plus a few late ones; every window has records on every partition."""
    out = {}
    for p in range(parts):
        ts = []
        for k in range(windows):
            ts += [k * size + rng.uniform(0, size + lateness * 0.9) for _ in range(per_window)]
        ts.sort()
        # out-of-order within the lateness: swap neighbours; late: pull some far back
        for i in range(0, len(ts) - 1, 3):
            ts[i], ts[i + 1] = ts[i + 1], ts[i]
        for i in rng.choice(np.arange(per_window * 2, len(ts)), size=4, replace=False):
            ts[i] = max(0.0, ts[i] - 2 * size)
        out[p] = [int(t * 1000) for t in ts]
    return out
