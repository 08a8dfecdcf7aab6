"""The privacy audits of tests/test_privacy*.py re-run with the likelihood-ratio family
(tests/lr_audit.py), which sees composition: thresholds on each look's exact log-likelihood
ratio, on each block between consecutive looks, and on their sums.

Each scenario below builds the same schedules, real states and real service runs that
tests/test_privacy.py and tests/test_privacy_service.py audit with ``empirical_epsilon``, plus
the model of their views (true counters under both neighbours, layers as designed); the scenario
functions are shared with ``python -m bench.service.privacy_audit``, which prints the table of
docs/privacy.md section 13. Negative controls: two independent eps-looks of one event (must read
about 2 eps; the older family reads about eps there), noise 25 % weaker than claimed, half the
noise, and the broken layerings. Production noise (OS entropy), no seeds; an eps-DP mechanism
reads > eps with probability at most 1e-6 per audit.
"""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.state import PanPrivateHistogram
from tests import test_privacy as tp
from tests.lr_audit import Look, lr_epsilon, schedule_model

N = 200_000  # runs per neighbouring stream (vectorized mechanisms)
N_REAL = 20_000  # runs of real PanPrivateHistogram objects
SERVICE_RUNS = 4  # service runs per neighbouring stream (x T = 40,000 trials each)


# ---------------------------------------------------------------------------------------------
# scenarios: (views under x, views under y, the model's looks, the claimed p)
# ---------------------------------------------------------------------------------------------
def schedules(sched_x, sched_y, eps=1.0, n=N, noise_eps=None, layer=None):
    """Views of two ``run_schedule`` schedules; ``noise_eps`` draws the noise for another eps
    than the one claimed (the model keeps the claimed eps and the designed layers)."""
    p = p_from_epsilon(eps, 2)
    q = p if noise_eps is None else p_from_epsilon(noise_eps, 2)
    vx = tp.run_schedule(sched_x, 3, q, n, layer)
    vy = tp.run_schedule(sched_y, 3, q, n, layer)
    return vx, vy, schedule_model(sched_x, sched_y, 3), p


def single_look(eps=1.0, n=N, noise_eps=None):
    return schedules([tp.X_REPLACE, "view"], [tp.Y_REPLACE, "view"], eps, n, noise_eps)


def unnoised_counter(eps=1.0, n=N):
    """Negative control: counter 1 (the replaced event's) carries no noise."""
    p = p_from_epsilon(eps, 2)

    def layer(shape):
        z = discrete_laplace(p, shape)
        z[:, 1] = 0
        return z

    return schedules([tp.X_REPLACE, "view"], [tp.Y_REPLACE, "view"], eps, n, layer=layer)


def two_independent_looks(eps=1.0, n=N):
    """Negative control: the same state published twice, each with fresh independent noise at
    eps (no layer nesting): basic composition, 2 eps."""
    a = single_look(eps, n)
    b = single_look(eps, n)
    return [a[0][0], b[0][0]], [a[1][0], b[1][0]], [a[2][0], b[2][0]], a[3]


def crash_replay(eps=1.0, n=N):
    """R3 (docs/privacy.md section 16): memory read after the replaced event in the first
    incarnation, then the window replayed under fresh noise and released (its own initial layer
    and release layer). The model is the design without the crash (memory, then the release one
    fresh layer later)."""
    p = p_from_epsilon(eps, 2)
    looks = schedule_model(
        [[0, 0, 1], "view", [0], "layer", "view"], [[0, 0, 2], "view", [0], "layer", "view"], 3
    )
    mem_x = tp.run_schedule([[0, 0, 1], "view"], 3, p, n)[0]
    mem_y = tp.run_schedule([[0, 0, 2], "view"], 3, p, n)[0]
    rel_x = tp.run_schedule([[0, 0, 1, 0], "layer", "view"], 3, p, n)[0]  # a new incarnation
    rel_y = tp.run_schedule([[0, 0, 2, 0], "layer", "view"], 3, p, n)[0]
    return [mem_x, rel_x], [mem_y, rel_y], looks, p


def joint(where, eps=1.0, n=N, fresh_layer=True):
    (px, sx), (py, sy) = tp.JOINT_PAIRS[where]
    sched_x = tp._joint_schedule(px, sx, fresh_layer)
    sched_y = tp._joint_schedule(py, sy, fresh_layer)
    vx, vy, _, p = schedules(sched_x, sched_y, eps, n)
    # the model is the design (a fresh layer before the release), whatever the mechanism did
    looks = schedule_model(tp._joint_schedule(px, sx), tp._joint_schedule(py, sy), 3)
    return vx, vy, looks, p


def exports(changed, intrusion, eps=1.0, n=100_000, before=True, after=True):
    sx = tp._export_schedule(tp.BASE_SEGMENTS, intrusion, before, after)
    sy = tp._export_schedule(tp._replaced(changed), intrusion, before, after)
    return schedules(sx, sy, eps, n)


def broken_exports(which, eps=1.0, n=100_000):
    """The two broken layerings of tests/test_privacy.py, audited against the correct design
    (the same views, with the missing layer counted as the design has it)."""
    if which == "after-only":  # intrusion just before an export without its 'before' layer
        sx = [[0, 1], "view", [1], "view", "layer", [2, 0], "layer", "view"]
        sy = [[0, 1], "view", [2], "view", "layer", [2, 0], "layer", "view"]
        designed = [1, 2, 4]
    else:  # intrusion just after an export without its 'after' layer
        sx = [[0, 1], "layer", "view", [1], "view", [2, 0], "layer", "view"]
        sy = [[0, 1], "layer", "view", [2], "view", [2, 0], "layer", "view"]
        designed = [2, 3, 4]
    vx, vy, _, p = schedules(sx, sy, eps, n)
    return vx, vy, schedule_model(sx, sy, 3, claimed_layers=designed), p


def real_states(eps=1.0, n=N_REAL):
    """One look at real PanPrivateHistogram objects (default noise source)."""
    views = []
    for stream in (tp.X_REPLACE, tp.Y_REPLACE):
        rows = np.empty((n, 3), dtype=np.int64)
        for r in range(n):
            s = PanPrivateHistogram(eps, size=3)
            s.update(stream)
            rows[r] = s.counts
        views.append([rows])
    looks = schedule_model([tp.X_REPLACE, "view"], [tp.Y_REPLACE, "view"], 3)
    return views[0], views[1], looks, p_from_epsilon(eps, 2)


def real_joint(eps=1.0, n=N_REAL // 2):
    """A real snapshot (serialize/deserialize) at t, then the release input after rerandomize()."""

    def release(s):
        s.rerandomize()
        return s.counts

    return _nested(
        tp.JOINT_PAIRS["after"],
        eps,
        n,
        release,
        first=lambda s: PanPrivateHistogram.deserialize(s.serialize()).counts,
    )


def _nested(pair, eps: float, n: int, second, first=lambda s: s.counts):
    """Two looks at real states of the joint ``pair`` ((prefix, suffix) per stream): ``first``
    of the state at t, then ``second`` of it after the suffix; the model is the joint one
    (memory, then one fresh layer later)."""
    (px, sx), (py, sy) = pair
    views = []
    for prefix, suffix in ((px, sx), (py, sy)):
        a = np.empty((n, 3), dtype=np.int64)
        b = np.empty((n, 3), dtype=np.int64)
        for r in range(n):
            s = PanPrivateHistogram(eps, size=3)
            s.update(prefix)
            a[r] = first(s)
            s.update(suffix)
            b[r] = second(s)
        views.append([a, b])
    looks = schedule_model(tp._joint_schedule(px, sx), tp._joint_schedule(py, sy), 3)
    return views[0], views[1], looks, p_from_epsilon(eps, 2)


def member_view(where, eps=1.0, n=N_REAL // 2, view_layer=True):
    """A group member of the views exchange (aggregator/service/group/views.py, docs/privacy.md
    section 20a): an intrusion reads the member's memory at t, then the member writes its view
    of the window with the real ``view_header`` (decoded as the leader decodes it). The model is
    the joint one: memory, then the view one fresh layer later. ``view_layer`` False: the
    member's counters written as they are (the design section 16 forbids: the negative
    control)."""
    from aggregator.service.group.view_format import decode_view, view_header

    info = {"kind": "time", "size": 1.0, "events": 0, "started_unix": 0.0, "ended_unix": 1.0}

    def view(s):
        if not view_layer:
            return s.counts
        return decode_view(view_header(s, window=0, covers=[0], partitions=1, window_info=info))

    return _nested(tp.JOINT_PAIRS[where], eps, n, view)


def add_remove(eps=1.0, n=N_REAL, merged=False):
    """Real add-remove snapshots (the counters; tests/test_privacy.py checks the n field is nil
    and every other field constant). Sensitivity 1: p = exp(-eps)."""
    vx, _ = tp.snapshot_view(tp.add_remove_snapshots(tp.X_ADD, eps, n, merged))
    vy, _ = tp.snapshot_view(tp.add_remove_snapshots(tp.Y_REMOVE, eps, n, merged))
    assert (vx[:, 3] == tp.NIL).all() and (vy[:, 3] == tp.NIL).all()
    looks = [Look.of([2, 0, 1], [2, 0, 0], 2 if merged else 1)]
    return [vx[:, :3]], [vy[:, :3]], looks, p_from_epsilon(eps, 1)


# the real service (tests/test_privacy_service.py): T trials of [0, 0, r] then [0] per run
_AFTER = {
    0: ((0, 0, 0), (0, 0, 0)),
    1: ((2, 0, 0), (2, 0, 0)),
    2: ((2, 1, 0), (2, 0, 1)),
    3: ((3, 1, 0), (3, 0, 1)),
}  # true counters after segment k - 1 (x, y)
NEXT_WINDOW = 4  # after the window closed, memory holds the next window (no events yet)


def _look(at, layers):
    mx, my = ((0, 0, 0), (0, 0, 0)) if at == NEXT_WINDOW else _AFTER[at]
    return Look.of(mx, my, layers)


def service_looks(gap, snapshots=0, backups=()):
    """The designed views of one service run (docs/privacy.md section 14): the window starts at
    one layer, each layered snapshot adds one layer before and one after it, the release adds W.
    Snapshots (snapshots_per_window = 2, window of 4T events) are taken after segments 0 and 1;
    the state directory holds the latest. ``gap`` 3 reads memory after the window closed."""
    release = _look(3, 1 + 2 * snapshots + 1)
    if backups:  # a copy of the directory at each instant (the latest snapshot in it)
        return [_look(b, 2 * b) for b in backups] + [release]
    if gap == 3:
        return [_look(NEXT_WINDOW, 1), release]
    if snapshots:  # the snapshot taken after segment gap - 1, then the memory one layer later
        return [_look(gap, 2 * gap), _look(gap, 2 * gap + 1), release]
    return [_look(gap, 1), release]


def service(tmp_path, gap, runs=SERVICE_RUNS, *, looks=None, **kw):
    """Views of real service runs (tests/test_privacy_service.py's ``_service_views``), stacked
    over ``runs`` runs per neighbouring stream."""
    from tests import test_privacy_service as ts

    views = {r: [ts._service_views(tmp_path, r, gap, **kw) for _ in range(runs)] for r in (1, 2)}
    stacked = {
        r: [np.concatenate([run[i] for run in rs]) for i in range(len(rs[0]))]
        for r, rs in views.items()
    }
    snaps = int(kw.get("checkpoint.snapshots_per_window", 0))
    looks = looks or service_looks(gap, snaps, kw.get("backups", ()))
    assert len(stacked[1]) == len(stacked[2]) == len(looks), (len(stacked[1]), looks)
    return stacked[1], stacked[2], looks, p_from_epsilon(1.0, 2)


def service_old_checkpoints(tmp_path, runs=SERVICE_RUNS):
    """The design before the rewrite: the checkpoint holds the live counters (live noise).
    Audited against the designed layers (snapshot between two fresh layers)."""
    from tests import test_privacy_service as ts

    looks = [_look(1, 2), _look(2, 3), _look(3, 4)]
    return service(
        tmp_path,
        2,
        runs,
        looks=looks,
        cls=ts._OldCheckpoints,
        **{"checkpoint.snapshots_per_window": 1},
    )


def audit(scenario) -> tuple:
    vx, vy, looks, p = scenario
    return lr_epsilon(vx, vy, looks, p)


# ---------------------------------------------------------------------------------------------
# negative controls: the family must see composition and weaker noise
# ---------------------------------------------------------------------------------------------
def test_two_independent_eps_looks_read_about_2_eps():
    r = audit(two_independent_looks(1.0))
    # {sum L >= 2 eps} has ratio e^(2 eps); at N = 2e5 the bound reads ~1.87 (the older family
    # of tests/test_privacy.py reads ~0.96 on the same views)
    assert r.eps > 1.5, r
    assert r.eps <= 2.0, r  # and no more than the truth


def test_noise_25_percent_weaker_is_flagged():
    r = audit(single_look(1.0, noise_eps=1.25))
    assert r.eps > 1.1, r  # true loss 1.25; measured ~1.20


@pytest.mark.parametrize("eps", tp.EPSILONS)
def test_half_noise_is_flagged(eps):
    r = audit(single_look(eps, noise_eps=2 * eps))
    assert r.eps > 1.5 * eps, r


def test_unnoised_counter_is_flagged():
    r = audit(unnoised_counter())
    assert r.eps > 5.0, r


def test_release_without_fresh_layer_is_flagged():
    r = audit(joint("after", fresh_layer=False))
    assert r.eps > 5.0, r


@pytest.mark.parametrize("which", ["after-only", "before-only"])
def test_exports_missing_a_layer_are_flagged(which):
    r = audit(broken_exports(which))
    assert r.eps > 5.0, r


def test_crash_replay_reads_above_eps_within_r3():
    """R3: a memory read before a crash plus the release of the replayed window cost up to
    2 eps for the events in between; the family sees more than eps (the older one does not)."""
    r = audit(crash_replay(1.0))
    assert 1.2 < r.eps <= 2.0, r


# ---------------------------------------------------------------------------------------------
# the mechanism audits of tests/test_privacy.py
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", tp.EPSILONS)
def test_single_look(eps):
    r = audit(single_look(eps))
    assert 0.8 * eps <= r.eps <= eps, r  # {L0 >= eps} has ratio exactly e^eps


@pytest.mark.parametrize("where", sorted(tp.JOINT_PAIRS))
@pytest.mark.parametrize("eps", tp.EPSILONS)
def test_joint_view(eps, where):
    r = audit(joint(where, eps))
    assert 0.8 * eps <= r.eps <= eps, r


@pytest.mark.parametrize("intrusion", [0, 1, 2])
@pytest.mark.parametrize("changed", [0, 1, 2])
def test_exports_intrusion_release(changed, intrusion):
    r = audit(exports(changed, intrusion))
    assert r.eps <= 1.0, r
    # one fresh layer protects the changed event when the intrusion closes its block
    assert r.eps >= (0.8 if changed == intrusion else 0.4), r


def test_real_states():
    r = audit(real_states())
    assert 0.5 <= r.eps <= 1.0, r


def test_real_states_joint_view():
    r = audit(real_joint())
    assert 0.4 <= r.eps <= 1.0, r


@pytest.mark.parametrize("where", sorted(tp.JOINT_PAIRS))
def test_a_group_members_memory_and_its_view(where):
    """The views exchange: one intrusion into a member plus the view it writes, with the
    member's real code, reads at or below eps."""
    r = audit(member_view(where))
    assert 0.4 <= r.eps <= 1.0, r


def test_a_member_view_without_its_layer_is_flagged():
    """The negative control: a view written without its layer reveals the increments."""
    r = audit(member_view("after", view_layer=False))
    assert r.eps > 5.0, r


def group_model(kind="own", gap=1, eps=1.0, n=N, view_layer=True):
    """The views exchange's design, vectorized (the model tests/group_audit.py audits the real
    group against): member A's memory (its state's layer), A's view (one more layer), member
    B's view (two layers of its own) and the release, their sum. ``view_layer`` False: A's view
    is its memory plus the increments, without its layer (the negative control)."""
    from tests.group_audit import _means, group_looks

    p = p_from_epsilon(eps, 2)
    views = []
    for r in (1, 2):
        m = {k: np.asarray(v) for k, v in _means(kind, gap, r).items()}
        state_a = discrete_laplace(p, (n, 3))
        view_a = m["view_a"] + state_a + (discrete_laplace(p, (n, 3)) if view_layer else 0)
        view_b = m["view_b"] + discrete_laplace(p, (n, 3)) + discrete_laplace(p, (n, 3))
        views.append([m["memory"] + state_a, view_a, view_b, view_a + view_b])
    return views[0], views[1], group_looks(kind, gap), p


def test_the_group_model_reads_its_chains_apart():
    """A derived look (the sum of the views) takes no block; each member's chain has its own
    blocks and a chain's first block is its first look."""
    from tests.lr_audit import statistics

    vx, _, looks, p = group_model("own", 1, n=10)
    names = [name for name, _, _ in statistics(vx, looks, p)]
    assert names == ["L1", "L3", "B1", "sum L"], names


@pytest.mark.parametrize("kind", ["own", "other"])
@pytest.mark.parametrize("gap", [1, 2])
def test_group_model(kind, gap):
    r = audit(group_model(kind, gap))
    assert r.eps <= 1.0, r
    if kind == "own":  # one layer protects the event in A's memory, or in A's last block
        assert r.eps >= 0.8, r


def test_group_model_without_the_view_layer_is_flagged():
    r = audit(group_model("own", 1, view_layer=False))
    assert r.eps > 5.0, r


@pytest.mark.parametrize("merged", [False, True])
def test_add_remove_snapshots(merged):
    r = audit(add_remove(1.0, merged=merged))
    assert r.eps <= 1.0, r
    assert r.eps >= (0.4 if merged else 0.7), r


# ---------------------------------------------------------------------------------------------
# the service audits of tests/test_privacy_service.py (real Aggregator, production noise)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gap", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1])  # the release in the loop / in the default worker
def test_service_memory_files_release(tmp_path, gap, workers):
    r = audit(service(tmp_path, gap, workers=workers))
    assert r.eps <= 1.0, r
    if gap < 3:
        assert r.eps >= 0.8, r


@pytest.mark.parametrize("gap", [1, 2, 3])
def test_service_with_layered_snapshots(tmp_path, gap):
    r = audit(service(tmp_path, gap, **{"checkpoint.snapshots_per_window": 2}))
    assert r.eps <= 1.0, r


def test_service_backups_and_release(tmp_path):
    r = audit(service(tmp_path, 0, backups=(1, 2), **{"checkpoint.snapshots_per_window": 2}))
    assert r.eps <= 1.0, r


def test_service_old_checkpoints_are_flagged(tmp_path):
    r = audit(service_old_checkpoints(tmp_path))
    assert r.eps > 3.0, r


def test_service_25_percent_weaker_noise_is_flagged(tmp_path):
    r = audit(service(tmp_path, 2, epsilon=1.25))
    assert r.eps > 1.1, r
