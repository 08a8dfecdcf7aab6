"""Privacy audits of the pan-private state (docs/privacy.md is the argument these tests check).

The audits are *statistical lower bounds* on the privacy loss: for neighbouring streams x, x' we
draw many outputs of the mechanism M, estimate P[M(x) in S] and P[M(x') in S] for a large family
of events S fixed in advance, and report

    eps_hat = max over S and both directions of
              log( lower_CI P[M(x) in S] / upper_CI P[M(x') in S] )

with one-sided Clopper-Pearson intervals, Bonferroni-corrected over every interval computed. If M
is eps-DP then, with probability at least 1 - ALPHA, every such ratio is <= e^eps (because
lower <= P[M(x) in S] <= e^eps P[M(x') in S] <= e^eps upper), so ``eps_hat <= eps`` can fail for a
correct mechanism with probability at most ALPHA = 1e-6 per audit.

An audit that cannot fail proves nothing, so every test also checks that
* the audit of the correct mechanism comes close to eps (for a replace-one pair, with a and b the
  counters of the replaced and the replacing event, {c_a >= h_a(x), c_b <= h_b(x)} has likelihood
  ratio exactly p^-2 = e^eps), and
* deliberately broken mechanisms (half the noise scale; a counter without noise; a release that
  reuses the snapshot's noise; an audit export without the "before" or the "after" layer; an
  add-remove snapshot that carries the exact event count) are flagged by the very same audit.

Noise comes from the default OS-entropy source (the production path), so these tests are not
seeded; the false-failure probability is bounded by ALPHA per audit instead.

This event family certifies single-look claims (and catches looks that share noise): it cannot see
composition, e.g. two independent eps-looks of one event read about eps, not 2 eps. The same
audits re-run with likelihood-ratio events over the joint view (tests/lr_audit.py), which see it,
are in tests/test_privacy_lr.py (docs/privacy.md section 13).
"""

from __future__ import annotations

import gc
import hashlib
import math
import random
import struct

import msgpack
import numpy as np
import pytest
from scipy import stats

from aggregator import noise as noise_mod
from aggregator.noise import OSEntropy, discrete_laplace, discrete_laplace_pmf, p_from_epsilon
from aggregator.state import SNAPSHOT_FIELDS, PanPrivateHistogram
from tests.helpers.privacy import empirical_epsilon

N_DRAWS = 200_000


# ---------------------------------------------------------------------------------------------
# the audit
# ---------------------------------------------------------------------------------------------


# one-sided Clopper-Pearson bounds: the audit module's (tests/lr_audit.py)


# ---------------------------------------------------------------------------------------------
# mechanisms, vectorized over N independent runs (same law as N PanPrivateHistogram objects)
# ---------------------------------------------------------------------------------------------
def run_schedule(schedule, size: int, p: float, n: int, layer=None) -> list[np.ndarray]:
    """N independent runs of the state over a schedule of operations.

    ``schedule`` items: a list of items (events to count), ``"layer"`` (a fresh DLap(p) layer on
    every counter, i.e. ``rerandomize()``), or ``"view"`` (record the state as someone sees it).
    The state starts at one DLap(p) layer, as ``PanPrivateHistogram`` does; ``layer`` can replace
    the noise generator (for broken-mechanism controls).
    """
    draw = layer or (lambda shape: discrete_laplace(p, shape))
    state = draw((n, size))
    views = []
    for op in schedule:
        if isinstance(op, str) and op == "layer":
            state = state + draw((n, size))
        elif isinstance(op, str) and op == "view":
            views.append(state.copy())
        else:
            state = state + np.bincount(np.asarray(op, dtype=np.int64), minlength=size)
    return views


def _audit(schedule_x, schedule_y, size, p, n=N_DRAWS, layer=None):
    vx = run_schedule(schedule_x, size, p, n, layer)
    vy = run_schedule(schedule_y, size, p, n, layer)
    return empirical_epsilon(vx, vy)


EPSILONS = (0.5, 1.0, 2.0)
# A replace-one pair on D = 3: the third event is 1 in x and 2 in x' (counts (2,1,0) vs (2,0,1)).
X_REPLACE, Y_REPLACE = [0, 0, 1], [0, 0, 2]


# ---------------------------------------------------------------------------------------------
# the state (state-only model): one snapshot, Fact 8
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", EPSILONS)
def test_snapshot_audit_replace_one(eps):
    p = p_from_epsilon(eps, 2)
    got, where = _audit([X_REPLACE, "view"], [Y_REPLACE, "view"], 3, p)
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"
    # not vacuous: the quadrant {c1 >= 1, c2 <= 0} has ratio exactly p**-2 = e^eps
    assert got >= 0.8 * eps, f"audit too weak: {got:.3f} for eps={eps} ({where})"


# ---------------------------------------------------------------------------------------------
# add-remove: the whole serialized snapshot, the event count field included
# ---------------------------------------------------------------------------------------------
# Neighbours on D = 3: x' is x with its last event (item 2) removed, so n is 3 vs 2.
X_ADD, Y_REMOVE = [0, 0, 2], [0, 0]
NIL = -1  # audit value of a nil n (real event counts are >= 0)


def add_remove_snapshots(stream, eps: float, n: int, merged: bool = False) -> list[bytes]:
    """``n`` serialized snapshots of real add-remove states that counted ``stream`` (``merged``:
    the stream is split between two states, merged before the snapshot)."""
    blobs = []
    for _ in range(n):
        s = PanPrivateHistogram(eps, size=3, neighbor="add-remove")
        if merged:
            t = PanPrivateHistogram(eps, size=3, neighbor="add-remove")
            s.update(stream[:1])
            t.update(stream[1:])
            s.merge(t)
        else:
            s.update(stream)
        blobs.append(s.serialize())
    return blobs


def with_exact_n(blob: bytes, n: int) -> bytes:
    """The snapshot as the old code wrote it: the same counters, and the exact event count in
    ``n`` (the checksum recomputed, so that it is a valid snapshot of the old format)."""
    body = msgpack.unpackb(blob, raw=False)
    counts, _ = body.pop("counts"), body.pop("checksum")
    body["n"] = n  # keeps its place in the header, so the header packs as serialize() packs it
    digest = hashlib.sha256(msgpack.packb(body, use_bin_type=True))
    digest.update(counts)
    return msgpack.packb(dict(body, counts=counts, checksum=digest.digest()), use_bin_type=True)


def snapshot_view(blobs: list[bytes]) -> tuple[np.ndarray, set[bytes]]:
    """A sample of snapshots as one (N, D + 1) view: the counters, then the ``n`` field (NIL for
    nil), plus the distinct values of every other field except the checksum (a function of the
    rest), so that the caller can check they do not vary."""
    rows, rest = [], set()
    for blob in blobs:
        body = msgpack.unpackb(blob, raw=False)
        assert set(body) == SNAPSHOT_FIELDS
        counts = np.frombuffer(body.pop("counts"), dtype="<i8")
        body.pop("checksum")
        n = body.pop("n")
        rows.append(np.append(counts, NIL if n is None else n))
        rest.add(msgpack.packb(body, use_bin_type=True))
    return np.array(rows, dtype=np.int64), rest


def _audit_snapshots(blobs_x, blobs_y):
    (vx, rest_x), (vy, rest_y) = snapshot_view(blobs_x), snapshot_view(blobs_y)
    # every field but the counters and n is one constant over both samples (direct mode: no key),
    # so it cannot tell the neighbours apart; the audit covers the counters and n
    assert len(rest_x | rest_y) == 1
    return empirical_epsilon([vx], [vy]), vx, vy


N_REAL = 20_000


@pytest.mark.parametrize("eps", EPSILONS)
def test_snapshot_audit_add_remove(eps):
    """The whole snapshot of real add-remove states (counters and the n field) is eps-DP."""
    bx = add_remove_snapshots(X_ADD, eps, N_REAL)
    by = add_remove_snapshots(Y_REMOVE, eps, N_REAL)
    (got, where), vx, vy = _audit_snapshots(bx, by)
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"
    assert (vx[:, 3] == NIL).all() and (vy[:, 3] == NIL).all()  # n is nil, not merely noisy
    # not vacuous: {c_2 >= 1} has ratio exactly 1/p = e^eps (measured ~0.82-0.94 eps)
    assert got >= 0.7 * eps, f"audit too weak: {got:.3f} for eps={eps} ({where})"


def test_snapshot_audit_add_remove_merged():
    """The same for the snapshot of two merged add-remove states (two layers, no n)."""
    eps = 1.0
    bx = add_remove_snapshots(X_ADD, eps, N_REAL, merged=True)
    by = add_remove_snapshots(Y_REMOVE, eps, N_REAL, merged=True)
    (got, where), _, _ = _audit_snapshots(bx, by)
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"
    # two layers: a shift of 1 reaches ratio e^eps only far in the tails (measured ~0.56)
    assert got >= 0.4 * eps, f"audit too weak: {got:.3f} ({where})"


def test_audit_flags_add_remove_snapshot_with_exact_n():
    """Negative control: the old add-remove snapshot, which carried the exact n, is flagged by
    the same audit, while its counters alone pass: the leak is the n field, which the old
    counters-only audit could not see."""
    eps = 1.0
    bx = [with_exact_n(b, len(X_ADD)) for b in add_remove_snapshots(X_ADD, eps, N_REAL)]
    by = [with_exact_n(b, len(Y_REMOVE)) for b in add_remove_snapshots(Y_REMOVE, eps, N_REAL)]
    (got, where), vx, vy = _audit_snapshots(bx, by)
    assert got > 5.0, f"exact n under add-remove not flagged: {got:.3f} ({where})"
    assert "[3]" in where, f"flagged, but not at the n field: {where}"
    counters_only, where = empirical_epsilon([vx[:, :3]], [vy[:, :3]])
    assert counters_only <= eps, f"{counters_only:.3f} at {where}"


@pytest.mark.parametrize("eps", EPSILONS)
def test_audit_flags_half_noise(eps):
    """Negative control: p = exp(-eps) (the add-remove parameter) on replace-one neighbours."""
    p_broken = math.exp(-eps)  # true privacy loss 2 eps
    got, where = _audit([X_REPLACE, "view"], [Y_REPLACE, "view"], 3, p_broken)
    assert got > 1.5 * eps, f"broken mechanism not flagged: {got:.3f} ({where})"


def test_audit_flags_unnoised_counter():
    """Negative control: counter 1 carries no noise, so it reveals the replaced event."""
    p = p_from_epsilon(1.0, 2)

    def layer(shape):
        z = discrete_laplace(p, shape)
        z[:, 1] = 0
        return z

    got, where = _audit([X_REPLACE, "view"], [Y_REPLACE, "view"], 3, p, layer=layer)
    assert got > 5.0, f"unnoised counter not flagged: {got:.3f} ({where})"


def test_real_states_audit_and_counter_law():
    """The same audit on counts taken from real PanPrivateHistogram objects (default source)."""
    eps, n = 1.0, 20_000
    runs = {}
    for stream in (X_REPLACE, Y_REPLACE):
        rows = np.empty((n, 3), dtype=np.int64)
        for r in range(n):
            s = PanPrivateHistogram(eps, size=3)
            s.update(stream)
            rows[r] = s.counts
        runs[tuple(stream)] = rows
        assert s.p == p_from_epsilon(eps, 2) and s.layers == 1 and s.n == 3
    vx, vy = runs[tuple(X_REPLACE)], runs[tuple(Y_REPLACE)]
    got, where = empirical_epsilon([vx], [vy])
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"
    assert got >= 0.5 * eps, f"audit too weak: {got:.3f} ({where})"
    # each counter minus its true count is DLap(p): chi-square with pooled tails
    p = p_from_epsilon(eps, 2)
    noise = np.concatenate([(vx - [2, 1, 0]).ravel(), (vy - [2, 0, 1]).ravel()])
    kmax = 8
    obs = np.bincount(np.clip(noise, -kmax - 1, kmax + 1) + kmax + 1, minlength=2 * kmax + 3)
    exp = discrete_laplace_pmf(p, np.arange(-kmax - 1, kmax + 2))
    exp[0] = exp[-1] = p ** (kmax + 1) / (1 + p)  # P[X < -kmax] = P[X > kmax]
    assert abs(exp.sum() - 1) < 1e-12
    assert stats.chisquare(obs, exp * len(noise)).pvalue > 1e-6


# ---------------------------------------------------------------------------------------------
# joint model: (snapshot at t, release after a fresh layer)
# ---------------------------------------------------------------------------------------------
def _joint_schedule(prefix, suffix, fresh_layer=True):
    return [prefix, "view", suffix] + (["layer"] if fresh_layer else []) + ["view"]


JOINT_PAIRS = {
    # replaced event before the intrusion time t
    "before": (([0, 0, 1], [2, 0]), ([0, 0, 2], [2, 0])),
    # replaced event after t
    "after": (([0, 2], [0, 1, 0]), ([0, 2], [0, 2, 0])),
}


@pytest.mark.parametrize("where", sorted(JOINT_PAIRS))
@pytest.mark.parametrize("eps", EPSILONS)
def test_joint_view_audit(eps, where):
    (px, sx), (py, sy) = JOINT_PAIRS[where]
    p = p_from_epsilon(eps, 2)
    got, event = _audit(_joint_schedule(px, sx), _joint_schedule(py, sy), 3, p)
    assert got <= eps, f"joint view: empirical eps {got:.3f} > {eps} at {event}"
    assert got >= 0.8 * eps, f"audit too weak: {got:.3f} ({event})"


def test_joint_view_without_fresh_layer_is_flagged():
    """Negative control: the release reuses the snapshot's noise, so B - A = c_T - c_t exactly."""
    (px, sx), (py, sy) = JOINT_PAIRS["after"]
    p = p_from_epsilon(1.0, 2)
    got, event = _audit(_joint_schedule(px, sx, False), _joint_schedule(py, sy, False), 3, p)
    assert got > 5.0, f"shared-noise release not flagged: {got:.3f} ({event})"
    # and each look alone is fine: the leak is in the pair, not in either view
    vx = run_schedule(_joint_schedule(px, sx, False), 3, p, N_DRAWS)
    vy = run_schedule(_joint_schedule(py, sy, False), 3, p, N_DRAWS)
    assert empirical_epsilon([vx[1]], [vy[1]])[0] <= 1.0


def test_real_states_joint_view():
    """Intrusion = a real snapshot (serialize/deserialize) at t; release after rerandomize()."""
    eps, n = 1.0, 10_000
    (px, sx), (py, sy) = JOINT_PAIRS["after"]
    views = []
    for prefix, suffix in ((px, sx), (py, sy)):
        a = np.empty((n, 3), dtype=np.int64)
        b = np.empty((n, 3), dtype=np.int64)
        for r in range(n):
            s = PanPrivateHistogram(eps, size=3)
            s.update(prefix)
            a[r] = PanPrivateHistogram.deserialize(s.serialize()).counts
            s.update(suffix)
            s.rerandomize()
            b[r] = s.counts
        assert s.layers == 2
        views.append([a, b])
    got, event = empirical_epsilon(*views)
    assert got <= eps, f"joint view of real states: {got:.3f} > {eps} at {event}"
    assert got >= 0.4 * eps, f"audit too weak: {got:.3f} ({event})"


# ---------------------------------------------------------------------------------------------
# announced audit exports: a fresh layer just before and just after each export
# ---------------------------------------------------------------------------------------------
def _export_schedule(segments, intrusion_after_segment, before=True, after=True):
    """Events in ``segments[0]``, export 1, ``segments[1]``, export 2, ``segments[2]``, release.

    The unannounced intrusion ("view") is taken right after ``segments[intrusion_after_segment]``
    (so just before the following export, or just before the release). Views come out in time order.
    """
    sched = []
    for i, seg in enumerate(segments):
        sched.append(seg)
        if i == intrusion_after_segment:
            sched.append("view")  # the intrusion
        if i < len(segments) - 1:  # an announced export
            sched += (["layer"] if before else []) + ["view"] + (["layer"] if after else [])
    return sched + ["layer", "view"]  # the release: fresh layer, then the final view


BASE_SEGMENTS = [[0, 1], [2, 0], [1, 2]]


def _replaced(segment_index, pos=0):
    """Neighbour of BASE_SEGMENTS: one event of one segment replaced by another item."""
    segs = [list(s) for s in BASE_SEGMENTS]
    segs[segment_index][pos] = (segs[segment_index][pos] + 1) % 3
    return segs


@pytest.mark.parametrize("intrusion", [0, 1, 2])
@pytest.mark.parametrize("changed", [0, 1, 2])
def test_exports_intrusion_release_jointly_private(changed, intrusion):
    """Two announced exports + one intrusion (before, between, after them) + the release."""
    eps = 1.0
    p = p_from_epsilon(eps, 2)
    sx = _export_schedule(BASE_SEGMENTS, intrusion)
    sy = _export_schedule(_replaced(changed), intrusion)
    got, event = _audit(sx, sy, 3, p, n=100_000)
    assert got <= eps, f"exports+intrusion+release: {got:.3f} > {eps} at {event}"
    # Not vacuous. The changed event sits in one difference of consecutive views; that
    # difference carries one fresh layer when the intrusion closes it (ratio e^eps reachable,
    # measured ~0.92) and two layers otherwise (after + before, or after + release), where a
    # shift of 1 has likelihood ratio < 1/p except far in the tails (measured ~0.53).
    single_layer = changed == intrusion
    assert got >= (0.8 if single_layer else 0.4) * eps, f"audit too weak: {got:.3f} ({event})"


def test_export_with_after_layer_only_is_flagged():
    """Intrusion just before an export that has no 'before' layer: they differ by exact
    increments."""
    p = p_from_epsilon(1.0, 2)
    # events [0, 1]; intrusion; the replaced event (1 in x, 2 in x'); export; layer; [2, 0]; release
    sched_x = [[0, 1], "view", [1], "view", "layer", [2, 0], "layer", "view"]
    sched_y = [[0, 1], "view", [2], "view", "layer", [2, 0], "layer", "view"]
    got, event = _audit(sched_x, sched_y, 3, p, n=100_000)
    assert got > 5.0, f"after-only layering not flagged: {got:.3f} ({event})"
    # the same neighbours with the 'before' layer in place are fine
    fixed_x = [[0, 1], "view", [1], "layer", "view", "layer", [2, 0], "layer", "view"]
    fixed_y = [[0, 1], "view", [2], "layer", "view", "layer", [2, 0], "layer", "view"]
    got, event = _audit(fixed_x, fixed_y, 3, p, n=100_000)
    assert got <= 1.0, f"{got:.3f} at {event}"


def test_export_with_before_layer_only_is_flagged():
    """Intrusion just after an export that has no 'after' layer: they differ by exact increments."""
    p = p_from_epsilon(1.0, 2)
    sched_x = [[0, 1], "layer", "view", [1], "view", [2, 0], "layer", "view"]
    sched_y = [[0, 1], "layer", "view", [2], "view", [2, 0], "layer", "view"]
    got, event = _audit(sched_x, sched_y, 3, p, n=100_000)
    assert got > 5.0, f"before-only layering not flagged: {got:.3f} ({event})"


# ---------------------------------------------------------------------------------------------
# snapshots hold no seed or RNG material
# ---------------------------------------------------------------------------------------------
_RNG_TYPES = (
    np.random.Generator,
    np.random.BitGenerator,
    np.random.SeedSequence,
    np.random.RandomState,
    OSEntropy,
    random.Random,
)


def _walk(obj, seen=None, path="state"):
    """Yield (path, value) for everything reachable through vars() and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, seen, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield from _walk(v, seen, f"{path}[{i}]")
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            yield from _walk(v, seen, f"{path}.{k}")


def _int_encodings(v: int) -> list[bytes]:
    v = int(v)
    out = [str(v).encode()]
    nbytes = max(8, (v.bit_length() + 7) // 8)
    out += [v.to_bytes(nbytes, "little"), v.to_bytes(nbytes, "big")]
    if v.bit_length() > 64:  # 128-bit PCG64 words: also their 64-bit halves
        for half in (v & (2**64 - 1), v >> 64):
            out += [half.to_bytes(8, "little"), half.to_bytes(8, "big")]
    return out


@pytest.mark.parametrize("mode", ["direct", "hashed"])
def test_snapshot_has_no_rng_material(mode):
    seed = 12345
    rng = np.random.default_rng(seed)
    state_start = rng.bit_generator.state
    pool = rng.bit_generator.seed_seq.pool.tobytes()
    kw = {"size": 64} if mode == "direct" else {"buckets": 64}
    s = PanPrivateHistogram(1.0, rng=rng, **kw)
    s.update([1, 2, 3, 3] if mode == "direct" else ["a", "b", "c", "c"])
    s.rerandomize(rng=rng)
    state_end = rng.bit_generator.state
    data = s.serialize()

    body = msgpack.unpackb(data, raw=False)
    assert set(body) == set(SNAPSHOT_FIELDS)

    forbidden = {
        "seed LE": struct.pack("<q", seed),
        "seed BE": struct.pack(">q", seed),
        "seed decimal": str(seed).encode(),
        "seed msgpack": msgpack.packb(seed),
        "seed-sequence pool": pool,
    }
    for label, st in (("start", state_start), ("end", state_end)):
        for field in ("state", "inc"):
            for j, enc in enumerate(_int_encodings(st["state"][field])):
                forbidden[f"PCG64 {field} at {label} #{j}"] = enc
    for label, needle in forbidden.items():
        assert needle not in data, f"snapshot contains the {label}"

    # no object reachable from the live or the restored state is (or wraps) a noise source
    restored = PanPrivateHistogram.deserialize(data)
    for obj in (s, restored):
        for path, value in _walk(obj):
            assert not isinstance(value, _RNG_TYPES), f"{path} is a {type(value).__name__}"
    assert not any(r is s or r is vars(s) for r in gc.get_referrers(rng))
    assert np.array_equal(restored.counts, s.counts) and restored.layers == 2

    # nothing in the snapshot lets two restorations rebuild the same noise
    t1 = PanPrivateHistogram.deserialize(data)
    t2 = PanPrivateHistogram.deserialize(data)
    t1.rerandomize()
    t2.rerandomize()
    assert not np.array_equal(t1.counts, t2.counts)
    assert not np.array_equal(t1.counts, s.counts)
    assert t1.layers == t2.layers == 3


def test_default_noise_source_is_os_entropy():
    assert isinstance(noise_mod._DEFAULT_SOURCE, OSEntropy)
    # two unseeded states of the same stream get different noise
    a = PanPrivateHistogram(1.0, size=64)
    b = PanPrivateHistogram(1.0, size=64)
    assert not np.array_equal(a.counts, b.counts)
