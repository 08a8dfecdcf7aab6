"""The intruder audit of a whole views group on a real broker (docs/privacy.md section 20a).

The mechanism audited is two real group members (:class:`aggregator.service.group.service.
GroupService`, ``scale.exchange = "views"``) on a real Kafka broker, with production noise (OS
entropy, no seed). They run in this process, one thread each: an intruder must read a member's
*memory* (its open window's state) at a chosen instant, and a thread's objects can be read
between two batches without a debugging hook into another process; the negative control switches
a member's view layer off the same way. Everything else is the production path: the members
consume their source partitions, count, write their views and offsets in Kafka transactions;
the leader (one of them) collects the views from ``<group>.panagg.summaries`` and releases them
through ``release.workers`` (1, the default: a spawned worker process; 0: in the loop).

Trials. As in the one-process service audit (tests/test_privacy_service.py), one window carries
T independent trials: trial j owns counters 3j, 3j + 1, 3j + 2 of a direct-mode domain of
D = 3T. The source topic has two partitions, one per member; A is the member the intruder reads
(the owner of partition 0), B the other. Each window:

* segment 0: events 3j, 3j on A's partition and 3j on B's, for every trial;
* segment 1: the replaced event 3j + r (r = 1 under the stream x, 2 under its neighbour y): on
  A's partition for the first half of the trials ("own"), on B's for the second ("other");
* then a forced release (``panagg release``'s request) closes the window at both members.

Each window is one run of the mechanism on its T trials (a new window draws new states), so a
group run gives many runs; windows alternate x and y. The intruder's looks, per window:

* A's memory (its state's counters) and every file under A's state directory, read after
  segment ``gap`` - 1 was counted by both members (gap 1: before the replaced event; gap 2: after
  it), while the window is open;
* every view of the window, read back from the summaries topic and decoded as the leader decodes
  them (:func:`aggregator.service.group.view_format.decode_view`);
* the release's input: the views the leader handed to its merge, summed by the leader's own
  function (:func:`~aggregator.service.group.view_format.sum_views`).

The model (tests/lr_audit.py, chains): A's memory 1 layer and A's view 2 layers nest (chain 0),
B's view 2 layers (chain 1, independent), the release their sum (derived, 4 layers).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

import msgpack
import numpy as np

from aggregator.noise import p_from_epsilon
from tests.lr_audit import Look

#: the two trial kinds: the replaced event on the intruded member's partition, or the other's
KINDS = ("own", "other")


def _means(kind: str, gap: int, r: int) -> dict[str, tuple]:
    """True counters (of one trial) of each look under replaced event ``3j + r``."""
    hit = (0, 1, 0) if r == 1 else (0, 0, 1)
    add = lambda a, b: tuple(x + y for x, y in zip(a, b))  # noqa: E731
    a_end = add((2, 0, 0), hit) if kind == "own" else (2, 0, 0)
    b_end = (1, 0, 0) if kind == "own" else add((1, 0, 0), hit)
    memory = a_end if gap == 2 else (2, 0, 0)
    return {"memory": memory, "view_a": a_end, "view_b": b_end, "release": add(a_end, b_end)}


def group_looks(kind: str, gap: int) -> list[Look]:
    """The designed looks of one trial: [A's memory, A's view, B's view, the release]."""
    mx, my = _means(kind, gap, 1), _means(kind, gap, 2)
    return [
        Look.of(mx["memory"], my["memory"], 1, chain=0),
        Look.of(mx["view_a"], my["view_a"], 2, chain=0),
        Look.of(mx["view_b"], my["view_b"], 2, chain=1),
        Look.of(mx["release"], my["release"], 4, derived=True),
    ]


@contextmanager
def _capture_merges(into: dict, workers: int):
    """While active, the views each window's merge is handed (the leader's summaries, with
    their chunks) are kept in ``into[window]``; the merge itself runs unchanged. ``workers``
    1: the merge runs in the release worker (``ReleaseWorker.call``); 0: in the loop
    (``view_format.merge_views``, looked up by the pipeline when the leader starts)."""
    from aggregator.service import release_worker
    from aggregator.service.group import view_format

    if workers:
        original = release_worker.ReleaseWorker.call

        def call(self, fn, *args, **kwargs):
            if fn is view_format.merge_views:
                into[int(args[0][0]["window"])] = list(args[0])
            return original(self, fn, *args, **kwargs)

        release_worker.ReleaseWorker.call = call
        try:
            yield
        finally:
            release_worker.ReleaseWorker.call = original
        return
    merge = view_format.merge_views

    def capture(summaries, **kwargs):
        into[int(summaries[0]["window"])] = list(summaries)
        return merge(summaries, **kwargs)

    view_format.merge_views = capture
    try:
        yield
    finally:
        view_format.merge_views = merge


@contextmanager
def _views_without_layer():
    """The negative control: the members write their views without the view's own layer (the
    design section 16 forbids: memory and view then differ by the exact increments)."""
    from aggregator.service.group import view_format

    original = view_format.discrete_laplace
    view_format.discrete_laplace = lambda p, size, rng=None: np.zeros(size, dtype=np.int64)
    try:
        yield
    finally:
        view_format.discrete_laplace = original


class _Summaries:
    """The summaries topic read as the leader reads it: chunks, then the header naming them."""

    def __init__(self, bootstrap: str, topic: str):
        from kafka import KafkaConsumer, TopicPartition

        self.c = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        self.tp = TopicPartition(topic, 0)
        self.c.assign([self.tp])
        self.c.seek_to_beginning(self.tp)
        self.chunks: dict[str, bytes] = {}
        self.heads: list[dict] = []

    def views_of(self, window: int, count: int, timeout_s: float = 60.0) -> list[dict]:
        """The ``count`` views of ``window`` (headers with their ``_chunks``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = [h for h in self.heads if h["window"] == window]
            if len(got) >= count:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{len(got)} views of window {window} in the summaries "
                    f"topic after {timeout_s:g} s, not {count}"
                )
            for recs in self.c.poll(timeout_ms=500).values():
                for rec in recs:
                    if rec.value is None:
                        continue
                    key = rec.key.decode()
                    if "/c" in key:
                        self.chunks[key] = rec.value
                        continue
                    head = json.loads(rec.value)
                    if head.get("format") != "panagg.view" or "refused" in head:
                        continue
                    head["_chunks"] = [
                        self.chunks.pop(f"{key}/c{k}") for k in range(head.get("chunks") or 0)
                    ]
                    self.heads.append(head)

    def close(self) -> None:
        self.c.close()


def _member_config(
    bootstrap: str,
    topic: str,
    group: str,
    name: str,
    tmp: Path,
    trials: int,
    epsilon: float,
    workers: int,
):
    from aggregator.service.config import load_config

    return load_config(
        None,
        [
            "source.kind=kafka",
            f"source.bootstrap={bootstrap}",
            f"source.topic={topic}",
            f"source.group={group}",
            f"source.instance_id={name}",
            f"checkpoint.dir={tmp / name / 'state'}",
            f"release.dir={tmp / name / 'releases'}",
            "metrics.port=-1",
            "scale.partitioned=true",
            "scale.store=kafka",
            "scale.exchange=views",
            "window.kind=time",
            "window.clock=process",
            # one window per forced release: the clock never closes one during a run
            "window.size=100000000",
            f"state.domain_size={3 * trials}",
            f"state.epsilon={epsilon}",
            "release.error_bar_reps=0",
            # the estimate is post-processing of the views the audit captures: the fast one
            "release.estimator=threshold",
            "release.plan_errors=false",
            f"release.workers={workers}",
            "ledger.registry_topic=",
            "source.session_timeout_s=20",
            "scale.close_grace_s=0.5",
        ],
        env={},
    )


def _events(trials: int, r: int) -> list[dict[int, np.ndarray]]:
    """Segments 0 and 1 of a window: {partition: items}."""
    base = 3 * np.arange(trials, dtype=np.int64)
    half = trials // 2
    return [{0: np.repeat(base, 2), 1: base}, {0: base[:half] + r, 1: base[half:] + r}]


def _produce(producer, topic: str, segment: dict[int, np.ndarray]) -> None:
    pack = msgpack.packb
    for part, items in segment.items():
        for i in items.tolist():
            producer.send(topic, value=pack({"item": i}), partition=part)
    producer.flush()


class Group:
    """Two members of a views group, in this process (one thread each)."""

    def __init__(
        self, bootstrap: str, tmp: Path, trials: int, *, epsilon: float = 1.0, workers: int = 1
    ):
        from kafka.admin import KafkaAdminClient, NewTopic

        from aggregator.service.group.service import GroupService
        from aggregator.service.group.topics import GroupTopics
        from aggregator.service.metrics import Metrics

        self.bootstrap, self.tmp, self.trials = bootstrap, Path(tmp), int(trials)
        self.topic = f"audit-{uuid.uuid4().hex[:10]}"
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(self.topic, num_partitions=2, replication_factor=1)])
        admin.close()
        self.group = f"g-{self.topic}"
        self.topics = GroupTopics(self.group)
        self.members = {}
        self.threads = {}
        self.errors: list[BaseException] = []
        for name in ("m1", "m2"):
            cfg = _member_config(
                bootstrap, self.topic, self.group, name, self.tmp, trials, epsilon, workers
            )
            self.members[name] = GroupService(cfg, Metrics())
        for name, svc in self.members.items():
            t = threading.Thread(target=self._run, args=(svc,), name=f"member-{name}", daemon=True)
            self.threads[name] = t
            t.start()

    def _run(self, svc) -> None:
        try:
            svc.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the audit
            self.errors.append(exc)

    def counter(self, name: str):
        pipe = self.members[name].pipelines[0]
        return getattr(pipe, "counter", None)

    def owner(self, partition: int) -> str | None:
        for name in self.members:
            c = self.counter(name)
            if c is not None and partition in dict(c.where):
                return name
        return None

    def wait_counting(self, timeout_s: float = 120.0) -> tuple[str, str]:
        """(A, B): the owners of partitions 0 and 1, once each member counts one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check()
            a, b = self.owner(0), self.owner(1)
            if a and b and a != b and any(self.counter(n).is_leader for n in self.members):
                return a, b
            time.sleep(0.5)
        raise AssertionError("the members did not each take one partition")

    def events_in(self, name: str, window: int) -> int:
        for _ in range(10):
            try:
                task = dict(self.counter(name).tasks).get(window)
                return 0 if task is None else int(task.events)
            except RuntimeError:  # the member's thread changed the dict meanwhile
                time.sleep(0.01)
        return 0

    def wait_events(self, window: int, want: dict[str, int], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            got = {n: self.events_in(n, window) for n in want}
            if got == want:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"window {window}: counted {got}, produced {want}")
            time.sleep(0.05)

    def check(self) -> None:
        if self.errors:
            raise AssertionError(f"a member stopped: {self.errors[0]!r}")

    def stop(self) -> None:
        for svc in self.members.values():
            svc.stop_event.set()
        for t in self.threads.values():
            t.join(60)


def counters_in_files(state_dir: Path) -> list[np.ndarray]:
    from tests.helpers.privacy import counters_in_files as found

    return found(state_dir) if state_dir.exists() else []


def run_windows(
    bootstrap: str,
    tmp: Path,
    trials: int,
    plan,
    *,
    epsilon: float = 1.0,
    workers: int = 1,
    unlayered: bool = False,
) -> list[dict]:
    """Run one group over the windows of ``plan`` (a list of (r, gap)); the intruder's looks of
    each window as (T, 3) arrays: {"r", "gap", "memory", "view_a", "view_b", "release"}.
    ``unlayered``: the members write their views without their layer (the negative control)."""
    from kafka import KafkaProducer

    from aggregator.service.group.forced import request_release
    from aggregator.service.group.view_format import decode_view, sum_views

    if trials % 2:
        raise ValueError("an even number of trials: half own, half other")
    merged: dict[int, list[dict]] = {}
    out = []
    with _capture_merges(merged, workers):
        group = Group(bootstrap, tmp, trials, epsilon=epsilon, workers=workers)
        producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1 << 18)
        summaries = None
        try:
            a, b = group.wait_counting()
            summaries = _Summaries(bootstrap, group.topics.summaries)
            state_a = group.members[a].cfg.checkpoint.dir
            for r, gap in plan:
                window = dict(group.counter(a).where)[0]
                assert dict(group.counter(b).where)[1] == window, "the members' windows differ"
                counted = {a: 0, b: 0}
                looks: dict = {"r": r, "gap": gap}
                for s, segment in enumerate(_events(trials, r)):
                    _produce(producer, group.topic, segment)
                    counted[a] += len(segment[0])
                    counted[b] += len(segment[1])
                    group.wait_events(window, counted)
                    if s + 1 == gap:  # an instant between two batches: both counted
                        memory = group.counter(a).tasks[window].state.counts.copy()
                        files = counters_in_files(Path(state_a))
                        assert not files, f"counters in {state_a}'s files: {len(files)}"
                        looks["memory"] = memory
                with _views_without_layer() if unlayered else nullcontext():
                    done = request_release(bootstrap, {}, group.topics, timeout_s=120)
                    assert done["window"] == window, (done, window)
                    views = summaries.views_of(window, 2)
                by = {h["member"]: h for h in views}
                assert sorted(by) == sorted((a, b)) and len(views) == 2, [
                    (h["member"], h["covers"]) for h in views
                ]
                assert by[a]["covers"] == [0] and by[b]["covers"] == [1]
                assert by[a]["n"] == counted[a] and by[b]["n"] == counted[b]
                looks["view_a"], looks["view_b"] = decode_view(by[a]), decode_view(by[b])
                deadline = time.monotonic() + 60
                while window not in merged:
                    assert time.monotonic() < deadline, f"no merge of window {window}"
                    time.sleep(0.05)
                handed = merged.pop(window)
                total, layers, n = sum_views(handed, 3 * trials)
                assert n == counted[a] + counted[b] and layers == 4, (n, layers)
                # the leader's input is the views the topic holds, nothing else
                assert sorted(h["uid"] for h in handed) == sorted(h["uid"] for h in views)
                looks["release"] = total
                if done["release"] is not None:
                    assert done["release"]["n"] == n, done["release"]["n"]
                out.append(looks)
        finally:
            if summaries is not None:
                summaries.close()
            producer.close()
            group.stop()
        group.check()
    return out


def scenario(windows: list[dict], kind: str, gap: int, epsilon: float = 1.0):
    """(views under x, views under y, looks, p) of the trials of ``kind`` in the windows read at
    ``gap``, stacked over windows; ``epsilon`` is the claimed one."""
    trials = len(windows[0]["view_a"]) // 3
    half = trials // 2
    cols = slice(0, half) if kind == "own" else slice(half, trials)
    names = ("memory", "view_a", "view_b", "release")
    stacked = {}
    for r in (1, 2):
        runs = [w for w in windows if w["r"] == r and w["gap"] == gap]
        if not runs:
            raise ValueError(f"no window of stream {r} read at gap {gap}")
        stacked[r] = [
            np.concatenate([w[nm].reshape(trials, 3)[cols] for w in runs]) for nm in names
        ]
    return stacked[1], stacked[2], group_looks(kind, gap), p_from_epsilon(epsilon, 2)


def window_plan(cycles: int, gaps=(1, 2)) -> list[tuple[int, int]]:
    """``cycles`` windows of each (stream, gap), interleaved: x then y at each gap in turn."""
    return [(r, gap) for _ in range(cycles) for gap in gaps for r in (1, 2)]


def group_scenarios(
    bootstrap: str, tmp: Path, trials: int, cycles: int, gaps=(1, 2), *, claimed: float = 1.0, **kw
) -> dict[tuple[str, int], tuple]:
    """One group run over ``window_plan(cycles, gaps)``; its scenarios by (kind, gap): the
    trials of each kind, ``cycles`` x T / 2 runs per neighbouring stream."""
    windows = run_windows(bootstrap, tmp, trials, window_plan(cycles, gaps), **kw)
    return {(kind, gap): scenario(windows, kind, gap, claimed) for kind in KINDS for gap in gaps}
