"""A user-level intruder audit of the running service (``state.privacy_unit = "user"``), exact.

The service under audit is the real :class:`aggregator.service.Aggregator`, in this process, on
a source of login records: its decoding, windows, fresh states (drawn ahead, beside the loop),
counting, checkpoints, close, ledger gate and release, as ``panagg run`` runs them. Nothing of
the density state is replaced. What is recorded is every random draw the service makes into a
density state, as it makes it: each ``bernoulli`` call inside :class:`PanPrivateDensity` (its
threshold and the cells it fills: the D0 draw of a fresh state, each D1 redraw of
``add_cells``) and each ``discrete_laplace`` of a release (its p). That trace, with the instants
an intruder looks, fixes the exact law of everything the intruder sees, so the loss is computed,
not sampled (as tests/test_density.py does on the core):

* a bit's law is a chain: each draw replaces it by a fresh Bernoulli(threshold / 2**64), so the
  bits a look sees are the last draws before it (a forward pass over the cell's draws and looks);
* the cells whose traces are the same in both neighbouring runs have the same law in both and
  are independent of the rest; they factor out of the intrusion's view. The release's count
  sums them too: the intruder is handed their sum (a worst case, as the core audit's shift),
  so only the differing cells and the release's DLap enter the ratio;
* distinct density states (windows) draw independently: their log-ratios add, and the maximum
  of a sum over independent coordinates is the sum of the maxima.

The intruder reads, at one instant between two batches: the state the service holds in memory
(``agg.task.state``: its bits) and every file under the state directory (checked to hold no
bits: a user-level checkpoint carries offsets and totals only, compared between the runs); and
the published release documents (compared between the runs but for the noisy count and what is
computed from it). Neighbours are the service's relation, ``replace-one`` (the event count is
public: offsets, ``n``): the victim's events, all of them, given to a stand-in user at the same
positions; the victim and the stand-in are otherwise absent. Other users may share their cells
before or after the intrusion (chosen with the window's key, which the intruder knows).

Uses test-only seeding (``testing.noise_seed``, ``PANAGG_TESTING=1``) so that both runs hash with
the same key; the exact law does not depend on the drawn values, only on the draws made.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

import aggregator.density as density_mod
from aggregator.density import PanPrivateDensity
from aggregator.noise import WORD, discrete_laplace_pmf
from tests.scripted_source import ScriptedSource

EPS = 1.0
EVENTS = (1, 10, 10_000)
BACKGROUND = 1500  # other users' events in the audited window (one each, distinct users)
EXPECTED_USERS = 2000  # state.expected_users: m = 5,019 cells at eps 1
ROLLUP_USERS = 3000  # state.rollup_expected_users of a span (a different m)


# ---------------------------------------------------------------------------------------------
# the trace of the service's draws
# ---------------------------------------------------------------------------------------------
@dataclass
class StateTrace:
    """One density state as the service drew it: per cell, its draws and looks in order."""

    cells: int
    key: bytes
    #: ("draw", threshold, cells array) / ("look", tag) / ("release", p), in order
    ops: list = field(default_factory=list)


class Trace:
    """Every density state the service creates while it is active, with its draws."""

    def __init__(self):
        self.states: list[StateTrace] = []
        self._by_id: dict[int, StateTrace] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def of(self, state: PanPrivateDensity) -> StateTrace:
        return self._by_id[id(state)]

    def look(self, state: PanPrivateDensity, tag: str) -> None:
        with self._lock:
            self.of(state).ops.append(("look", tag))

    @contextmanager
    def active(self, *, thresholds: Callable | None = None):
        """Record the draws of every :class:`PanPrivateDensity`; ``thresholds`` (a negative
        control) replaces :func:`aggregator.density.bit_thresholds` meanwhile."""
        D = PanPrivateDensity
        orig = {
            "init": D.__init__,
            "add": D.add_cells,
            "release": D.release,
            "bern": density_mod.bernoulli,
            "dlap": density_mod.discrete_laplace,
            "thr": density_mod.bit_thresholds,
        }
        local, trace = self._local, self

        def bernoulli(threshold, size, rng=None):
            local.draws.append(int(threshold))
            return orig["bern"](threshold, size, rng=rng)

        def discrete_laplace(p, size, rng=None):
            local.dlaps.append(float(p))
            return orig["dlap"](p, size, rng=rng)

        def init(self, *a, **kw):
            local.draws = []
            orig["init"](self, *a, **kw)
            (thr,) = local.draws  # one D0 draw of every cell
            st = StateTrace(
                self.cells, self.key, [("draw", thr, np.arange(self.cells, dtype=np.int64))]
            )
            with trace._lock:
                trace.states.append(st)
                trace._by_id[id(self)] = st

        def add_cells(self, cells, rng=None):
            local.draws = []
            orig["add"](self, cells, rng=rng)
            idx = np.unique(np.asarray(cells, dtype=np.int64))
            assert len(local.draws) <= 1
            if local.draws:
                with trace._lock:
                    trace.of(self).ops.append(("draw", local.draws[0], idx))

        def release(self, rng=None):
            local.dlaps = []
            out = orig["release"](self, rng=rng)
            (p,) = local.dlaps  # one DLap on the count of 1-bits
            with trace._lock:
                trace.of(self).ops.append(("release", p))
            return out

        D.__init__, D.add_cells, D.release = init, add_cells, release  # type: ignore[method-assign]
        density_mod.bernoulli, density_mod.discrete_laplace = bernoulli, discrete_laplace
        if thresholds is not None:
            density_mod.bit_thresholds = thresholds
        try:
            yield self
        finally:
            D.__init__, D.add_cells, D.release = orig["init"], orig["add"], orig["release"]  # type: ignore[method-assign]
            density_mod.bernoulli, density_mod.discrete_laplace = orig["bern"], orig["dlap"]
            density_mod.bit_thresholds = orig["thr"]


def cell_ops(st: StateTrace, cell: int) -> list[tuple]:
    """The ops one cell sees: its draws (threshold), every look, the release (p)."""
    out: list[tuple] = []
    for op in st.ops:
        if op[0] == "draw":
            if np.any(op[2] == cell):
                out.append(("draw", op[1]))
        else:
            out.append(op)
    return out


# ---------------------------------------------------------------------------------------------
# the exact law and the loss
# ---------------------------------------------------------------------------------------------
def _cell_law(ops) -> np.ndarray:
    """P[bits at each look] of one cell, an array over {0, 1}^looks (its release is its last
    look): a forward pass in which a draw replaces the bit and a look reads it."""
    looks = sum(1 for op in ops if op[0] == "look")
    law = np.zeros((2,) * looks + (2,))  # (the looks so far, the current bit)
    law[(0,) * looks + (0,)] = 1.0  # (the first op is the fresh state's D0 draw)
    seen = 0
    for op in ops:
        if op[0] == "draw":
            q = op[1] / WORD
            total = law.sum(axis=-1, keepdims=True)
            law = np.concatenate([total * (1 - q), total * q], axis=-1)
        else:  # the current bit is copied into look number ``seen``
            new = np.zeros_like(law)
            for bit in (0, 1):
                src = [slice(None)] * law.ndim
                src[seen], src[-1] = 0, bit
                dst = list(src)
                dst[seen] = bit
                new[tuple(dst)] += law[tuple(src)]
            law, seen = new, seen + 1
    return law.sum(axis=-1)


def _view_law(per_cell_ops, p: float | None, ys: np.ndarray) -> np.ndarray:
    """P[looks of the differing cells, y] with y = the sum of their released bits + DLap(p)
    (the other cells' sum handed to the intruder); without a release, the looks only."""
    laws = [_cell_law(ops) for ops in per_cell_ops]
    joint = laws[0]
    for law in laws[1:]:
        joint = np.multiply.outer(joint, law)
    if p is None:
        return joint
    dims = [law.ndim for law in laws]
    finals = set(np.cumsum(dims) - 1)  # the release is each cell's last look
    kept = [i for i in range(joint.ndim) if i not in finals]
    out = np.zeros(tuple(2 for _ in kept) + (len(ys),))
    for idx in itertools.product((0, 1), repeat=joint.ndim):
        final = sum(idx[i] for i in finals)
        out[tuple(idx[i] for i in kept)] += joint[idx] * discrete_laplace_pmf(p, ys - final)
    return out


def state_loss(a: StateTrace, b: StateTrace) -> tuple[float, float]:
    """(max, min) of ln P[view | a] / P[view | b] for one density state's views (its looks and
    its release) over the cells whose draws differ between the two runs."""
    if a.cells != b.cells or a.key != b.key:
        raise AssertionError("the two runs' states differ in cells or key: not comparable")
    skel = [op[0] for op in a.ops], [op[0] for op in b.ops]
    if skel[0] != skel[1]:
        raise AssertionError(f"the two runs look at and release the state differently: {skel}")
    differing = set()
    for oa, ob in zip(a.ops, b.ops):
        if oa[0] == "draw":
            if oa[1] != ob[1]:
                raise AssertionError("a draw's threshold differs between the runs")
            differing |= set(np.setxor1d(oa[2], ob[2]).tolist())
    if not differing:
        return 0.0, 0.0
    if len(differing) > 6:
        raise AssertionError(f"{len(differing)} cells differ: not one user's")
    cells = sorted(differing)
    looks_only = [op for op in a.ops if op[0] != "draw"]
    rel = [op for op in looks_only if op[0] == "release"]
    p = rel[0][1] if rel else None

    # each cell's ops, with its release turned into a look (its bit enters y)
    def per(st):
        return [[("look",) if op[0] == "release" else op for op in cell_ops(st, c)] for c in cells]

    ys = np.arange(-12, 12 + len(cells) + 1)
    x, y = _view_law(per(a), p, ys), _view_law(per(b), p, ys)
    if x.shape != y.shape:  # (a look pattern a cell never reaches in one run: pad)
        raise AssertionError("view spaces differ")
    both = (x > 0) | (y > 0)
    if np.any((x > 0) != (y > 0)):
        return math.inf, -math.inf
    r = np.log(x[both]) - np.log(y[both])
    return float(r.max()), float(r.min())


def run_loss(ta: Trace, tb: Trace) -> float:
    """The joint loss of every state's views: the sum of the per-state maxima (or minima)."""
    # (states are drawn ahead, beside the loop: matched by key and size, not order)
    keyed = {(s.key, s.cells): s for s in tb.states}
    if len(ta.states) != len(tb.states) or set(keyed) != {(s.key, s.cells) for s in ta.states}:
        raise AssertionError("the runs drew different density states")
    hi = lo = 0.0
    for a in ta.states:
        b = keyed[(a.key, a.cells)]
        h, low = state_loss(a, b)
        hi, lo = hi + h, lo + low
    return max(hi, -lo)


# ---------------------------------------------------------------------------------------------
# the service runs
# ---------------------------------------------------------------------------------------------
def _files(state_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(state_dir)): p.read_bytes()
        for p in sorted(state_dir.rglob("*"))
        if p.is_file()
    }


def _checkpoint_header(data: bytes) -> dict:
    hlen = int.from_bytes(data[:8], "little")
    return msgpack.unpackb(data[8 : 8 + hlen], raw=False, strict_map_key=False)


def _public(doc: dict) -> dict:
    """A release document without its noisy count and what is computed from it (and its
    wall-clock times)."""
    drop = {
        "created_unix",
        "headline",
        "distinct_users",
        "active_fraction",
        "expected_relative_error",
        "window_start",
        "window_end",
    }
    out = {k: v for k, v in doc.items() if k not in drop}
    out["window_info"] = {k: v for k, v in doc["window_info"].items() if not k.endswith("_unix")}
    out["density"] = {
        k: v for k, v in doc["density"].items() if k not in ("noisy_ones", "occupied_fraction")
    }
    return out


def _counted(header: dict) -> dict:
    """What a checkpoint says of the counting (not its random ids and wall-clock times)."""
    out = {
        k: header.get(k)
        for k in ("seq", "offsets", "start_offsets", "totals", "pending", "has_state")
    }
    out["window"] = {
        k: v for k, v in header["window"].items() if k not in ("uid", "started_unix", "lineage")
    }
    return out


@dataclass
class Scenario:
    """The victim's events and where the intruder looks.

    ``events``: the victim's events; ``split``: how many of them fall before the intrusion
    (the rest after); ``others``: other users in the victim's / stand-in's cell, each one of
    "", "before", "after", "both" (relative to the intrusion); ``windows``: the victim's events
    after the intrusion go to a second window (the stream is then two windows long, and the
    intruder looks inside each: :attr:`intrusions`).
    """

    events: int
    split: int
    others: tuple[str, str] = ("", "")
    windows: int = 1
    #: ``window.rollups = ["<k>x"]``: a span of k base windows beside them (0: none); the
    #: victim's events are in the first base window, so in the first span too
    rollup: int = 0

    @property
    def intrusions(self) -> tuple[int, ...]:
        """Before which segments the intruder looks (once per window)."""
        return (1,) if self.windows == 1 else (1, 3)


def _segments(sc: Scenario, who: str, key_cells: Callable | None) -> tuple[list, int]:
    """(segments, size of the window): segment 0 is before the intrusion, segment 1 after it,
    segment 2 closes the (last) window."""
    pack = msgpack.packb
    background = [f"bg-{i:05d}" for i in range(BACKGROUND)]
    before, after = background[: BACKGROUND // 2], background[BACKGROUND // 2 :]
    extra_before: list[str] = []
    extra_after: list[str] = []
    if key_cells is not None:  # other users that share the victim's / the stand-in's cell
        for target, where in zip(("victim", "standin"), sc.others):
            if not where:
                continue
            mates = key_cells(target)
            if where in ("before", "both"):
                extra_before.append(mates[0])
            if where in ("after", "both"):
                extra_after.append(mates[1])
    seg0 = before + extra_before + [who] * sc.split
    seg1 = after + extra_after + [who] * (sc.events - sc.split)
    rng = np.random.default_rng(3)
    rng.shuffle(seg0)
    rng.shuffle(seg1)
    size = len(seg0) + len(seg1) + 1
    segments = [seg0, seg1, ["closer"]]
    if sc.windows == 2:
        # the victim's events before the intrusion go to the first window, the rest to the
        # second, and the intruder looks inside each (before segments 1 and 3)
        first = [u for u in seg0 if u != who]
        second = [u for u in seg1 if u != who]
        h0, h1 = len(first) // 2, len(second) // 2
        size = max(len(seg0), len(seg1)) + 1
        segments = [
            first[:h0] + [who] * sc.split,
            first[h0:] + ["filler"] * (size - len(seg0)),
            second[:h1] + [who] * (sc.events - sc.split),
            second[h1:] + ["filler"] * (size - len(seg1)),
        ]
    if sc.rollup:  # the span's other base windows: other users only
        segments += [[f"fill-{j}-{i:05d}" for i in range(size)] for j in range(sc.rollup - 1)]
    return [[pack({"item": u}) for u in s] for s in segments], size


@dataclass
class RunViews:
    trace: Trace
    files: list[dict[str, bytes]]
    releases: list[dict]


def service_run(
    tmp: Path,
    sc: Scenario,
    who: str,
    *,
    workers: int = 1,
    seed: int = 5,
    key_cells: Callable | None = None,
    intrusions: tuple[int, ...] | None = None,
    thresholds: Callable | None = None,
    epsilon: float = EPS,
) -> RunViews:
    """One run of the service on the stream where ``who`` (the victim or the stand-in) holds
    the scenario's events; the intruder looks before each segment in ``intrusions``."""
    from aggregator.service import Aggregator
    from aggregator.service.config import load_config
    from aggregator.service.multi import MultiAggregator

    os.environ["PANAGG_TESTING"] = "1"  # (testing.noise_seed: both runs hash with one key)
    state_dir = tmp / f"state-{who}"
    shutil.rmtree(state_dir, ignore_errors=True)
    shutil.rmtree(tmp / f"releases-{who}", ignore_errors=True)
    segments, size = _segments(sc, who, key_cells)
    cfg = load_config(
        None,
        [
            f"checkpoint.dir={state_dir}",
            f"release.dir={tmp / f'releases-{who}'}",
            "source.kind=generator",
            "state.privacy_unit=user",
            f"state.expected_users={EXPECTED_USERS}",
            f"state.epsilon={epsilon}",
            "ledger.budget_per_user=100",
            "window.kind=count",
            f"window.size={size}",
            "metrics.port=-1",
            "release.on_exhausted=false",
            f"release.workers={workers}",
            f"testing.noise_seed={seed}",
            f"ledger.file_registry={tmp / f'registry-{who}.jsonl'}",
        ]
        + (
            [f"window.rollups={sc.rollup}x", f"state.rollup_expected_users={ROLLUP_USERS}"]
            if sc.rollup
            else []
        ),
        env={},
    )
    trace, files = Trace(), []

    def intrude(k):  # every state the service holds in memory (each level's, with rollups)
        for one in agg.aggs.values() if sc.rollup else [agg]:
            trace.look(one.task.live_state(), f"memory@{k}")
        files.append(_files(state_dir))

    at = {k: (lambda k=k: intrude(k)) for k in intrusions or sc.intrusions}
    with trace.active(thresholds=thresholds):
        source = ScriptedSource(segments, at, "logins:0")
        agg = (MultiAggregator if sc.rollup else Aggregator)(cfg, source)
        agg.run()
    docs = [json_load(f) for f in sorted((tmp / f"releases-{who}").rglob("release-*.json"))]
    return RunViews(trace, files, docs)


def json_load(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def compare_public(x: RunViews, y: RunViews) -> None:
    """The intruder's other reads are the same in both runs: the files at each intrusion hold
    no bits (a checkpoint's header says so; no serialized state anywhere) and the releases
    agree but for the noisy count."""
    assert len(x.files) == len(y.files)
    for fx, fy in zip(x.files, y.files):
        assert sorted(fx) == sorted(fy)
        for name, data in fx.items():
            assert b"panagg.state" not in data, name
            if "checkpoint" in name and len(data) >= 8:
                hx, hy = _checkpoint_header(data), _checkpoint_header(fy[name])
                assert not hx.get("has_state", False), name
                assert _counted(hx) == _counted(hy), name
    assert [_public(d) for d in x.releases] == [_public(d) for d in y.releases]


def key_cells_of(tmp: Path, sc: Scenario, **kw) -> Callable:
    """Learn the audited window's key (one run) and return ``mates(user)``: two other users
    hashed to ``user``'s cell."""
    probe = service_run(tmp / "probe", sc, "victim", **kw)
    st = probe.trace.states[0]
    pool = [f"mate-{i:06d}" for i in range(st.cells * 8)]
    cells = PanPrivateDensity.cell_of(_Keyed(st), pool)

    def mates(user: str) -> list[str]:
        c = int(PanPrivateDensity.cell_of(_Keyed(st), [user])[0])
        found = [u for u, x in zip(pool, cells) if x == c]
        assert len(found) >= 2
        return found[:2]

    return mates


class _Keyed:
    """Enough of a density state for :meth:`PanPrivateDensity.cell_of`."""

    def __init__(self, st: StateTrace):
        self._key, self._cells = st.key, st.cells


def user_level_loss(tmp: Path, sc: Scenario, **kw) -> float:
    """The exact loss of the intruder's views between the run with the victim's events and the
    run with them given to the stand-in (the other reads checked equal)."""
    key_cells = key_cells_of(tmp, sc, **kw) if any(sc.others) else None
    tmp.mkdir(parents=True, exist_ok=True)
    x = service_run(tmp, sc, "victim", key_cells=key_cells, **kw)
    y = service_run(tmp, sc, "standin", key_cells=key_cells, **kw)
    compare_public(x, y)
    return run_loss(x.trace, y.trace)


def doubled(epsilon_cell: float, calibration: str = "full"):
    """A negative control's thresholds: bits drawn for twice the state's share."""
    return _ORIG_THRESHOLDS(2 * epsilon_cell, calibration)


_ORIG_THRESHOLDS = density_mod.bit_thresholds


# the exact user-level loss of one intrusion and the release (tests/test_density.py checks it
# against the density state; tests/test_user_privacy_service.py against the service)
# ---------------------------------------------------------------------------------------------
# the exact audit
# ---------------------------------------------------------------------------------------------
def kernel(b: float, events: int) -> np.ndarray:
    """Transition of one bit over ``events`` arrivals: each redraws it from Bernoulli(b)."""
    redraw = np.array([[1 - b, b], [1 - b, b]])
    return np.linalg.matrix_power(redraw, events)


def cell_joint(a: float, b: float, before: int, after: int) -> np.ndarray:
    """P[bit at the intrusion = i, bit at the release = j] for a cell with ``before`` arrivals
    before the intrusion and ``after`` after it (all users of the cell counted)."""
    at_intrusion = np.array([1 - a, a]) @ kernel(b, before)
    return at_intrusion[:, None] * kernel(b, after)


def _joint_views(a, b, p, cells_before_after, ys):
    """P[intrusion bits, release y] over the user's cells (independent), y = sum of final bits
    + DLap(p). ``cells_before_after``: per cell (arrivals before, arrivals after)."""
    laws = [cell_joint(a, b, bf, af) for bf, af in cells_before_after]
    ncell = len(laws)
    out = np.zeros((2,) * ncell + (len(ys),))
    for finals in itertools.product((0, 1), repeat=ncell):
        noise = discrete_laplace_pmf(p, ys - sum(finals))
        for starts in itertools.product((0, 1), repeat=ncell):
            w = math.prod(law[s, f] for law, s, f in zip(laws, starts, finals))
            out[starts] += w * noise
    return out


def exact_user_loss(
    a: float, b: float, p: float, events: int, neighbor: str = "add-remove"
) -> float:
    """Max over intrusion time (every split of the user's events), collision patterns and views
    of |ln P[view | with the user] / P[view | without]|: the exact user-level loss of one
    intrusion + the release. Beyond |y| ~ 4 the DLap tails make the ratio constant, so the
    window of y is exact."""
    ys = np.arange(-8, 11)
    splits = sorted({0, 1, events // 2, events - 1, events} & set(range(events + 1)))
    others = [(0, 0), (1, 0), (0, 1), (1, 1)]  # other users of the cell: before / after
    worst = 0.0
    for g1 in splits:
        g2 = events - g1
        if neighbor == "add-remove":
            for ob, oa in others:
                x = _joint_views(a, b, p, [(ob + g1, oa + g2)], ys)
                y = _joint_views(a, b, p, [(ob, oa)], ys)
                worst = max(worst, float(np.max(np.abs(np.log(x) - np.log(y)))))
        else:  # the user's events go to cell u in one world, to another user's cell v in the other
            for (ob, oa), (vb, va) in itertools.product(others, repeat=2):
                x = _joint_views(a, b, p, [(ob + g1, oa + g2), (vb, va)], ys)
                y = _joint_views(a, b, p, [(ob, oa), (vb + g1, va + g2)], ys)
                worst = max(worst, float(np.max(np.abs(np.log(x) - np.log(y)))))
    return worst
