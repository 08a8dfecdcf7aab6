"""An audit family that sees composition of real releases: one or two real 2-layer releases
(``aggregator.release.make_release``, model ``"joint"``) of the same events, read by the
likelihood-ratio family of tests/lr_audit.py on millions of trials.

Why a separate family. The LR family already has the right statistic for two independent looks
(``sum L``: the sum of the looks' exact log-likelihood ratios, i.e. the exact privacy-loss random
variable of the composed mechanism, Neyman-Pearson optimal for every threshold). What it lacks on
2-layer releases is *sample*: the privacy loss of a 2-layer look (two DLap(p) layers) reaches
its bound eps only in far tails, so a pure-DP lower bound from N runs is capped well below the
truth. Exact figures from the privacy-loss distribution (expected Clopper-Pearson reading of the
best event {sum L >= t}, Bonferroni 1e-6, eps = 1):

===============  ==========  ========  ========  ========  ========
neighbours       releases    N = 2e5   N = 1e6   N = 1e7   N = 1e8
===============  ==========  ========  ========  ========  ========
replace-one      1           0.59      0.67      0.75      0.80
replace-one      2           1.07      1.22      1.36      1.46
add-remove       1           0.70      0.77      0.83      0.86
add-remove       2           1.33      1.45      1.56      1.64
===============  ==========  ========  ========  ========  ========

So no event-based pure-DP audit reads >= 1.5 on two replace-one 2-layer releases below ~3e8
runs per stream (expected 1.488 at 2e8, 1.511 at 4e8; the event {sum L >= 1.46} has ratio
e^1.5 at P_y = 3.5e-4; ratio e^1.6 needs P_y = 1.8e-5); with add-remove neighbours (one
counter, p = exp(-eps)) 1e7 runs suffice.

How the trials are drawn. A real state of T counters (direct mode) is T independent trials: the
counters' noise is independent (one DLap(p) draw per counter per layer, from the OS CSPRNG) and
an event moves only its own counter, so counter i of a state fed "one event in every counter"
has the law of that counter under the neighbour holding the event. Replace-one: 2T counters,
x has an event in counter 2i, y in counter 2i+1 (the same n); trial i is the pair
(2i, 2i + 1). Add-remove: T counters, x has one event in each, y none; trial i is counter i.
Each release is ``make_release(state, view=...)`` of its own state (the views the release was
computed from, with its fresh release layer: 2 layers); two releases of the same events are two
states fed the same events (a second deployment over the same records: issue 48's cases).
``same_state=True`` releases one state twice instead (shared state layer, fresh release layers).

The reading is :func:`tests.lr_audit.lr_epsilon` over the looks' model (true counters, 2 layers
each, not nested), so the events are {L_j >= t}, {L_j <= t}, {sum L >= t}, {sum L <= t} on the
fixed grid; a mechanism that is eps-DP reads > eps with probability at most 1e-6.
"""

from __future__ import annotations

import math
import time

import numpy as np

from aggregator.noise import p_from_epsilon
from aggregator.release import make_release
from aggregator.state import NEIGHBOR_RELATIONS, PanPrivateHistogram
from tests.lr_audit import Look, Result, lr_epsilon


def _events(neighbor: str, trials: int, which: str) -> np.ndarray:
    """The events of stream ``which`` (``"x"`` or ``"y"``) as counter indices."""
    if neighbor == "replace-one":
        return np.arange(trials, dtype=np.int64) * 2 + (0 if which == "x" else 1)
    if neighbor == "add-remove":
        return np.arange(trials, dtype=np.int64) if which == "x" else np.empty(0, np.int64)
    raise ValueError(f"unknown neighbour relation {neighbor!r}")


def _trial_view(counts: np.ndarray, neighbor: str, trials: int) -> np.ndarray:
    return np.asarray(counts, dtype=np.int64).reshape(trials, NEIGHBOR_RELATIONS[neighbor])


def release_views(
    neighbor: str,
    which: str,
    *,
    eps: float = 1.0,
    trials: int,
    releases: int = 1,
    same_state: bool = False,
) -> list[np.ndarray]:
    """``releases`` real release inputs of stream ``which``, one (trials, k) array each."""
    width = NEIGHBOR_RELATIONS[neighbor]
    events = _events(neighbor, trials, which)
    views, state = [], None
    for _ in range(releases):
        if state is None or not same_state:
            state = PanPrivateHistogram(eps, size=width * trials, neighbor=neighbor)
            state.add_indices(events)
        got: list = []
        make_release(state, model="joint", view=got, error_bar_reps=0)
        counts, layers = got[0]
        if layers != 2:
            raise AssertionError(f"a joint release of a fresh state carries 2 layers, got {layers}")
        views.append(_trial_view(counts, neighbor, trials))
        del got, counts
    return views


def scenario(
    neighbor: str = "replace-one",
    *,
    releases: int = 1,
    eps: float = 1.0,
    trials: int = 1_000_000,
    same_state: bool = False,
):
    """(views under x, views under y, the looks' model, the claimed p) for ``releases`` real
    2-layer releases of the same events."""
    vx = release_views(
        neighbor, "x", eps=eps, trials=trials, releases=releases, same_state=same_state
    )
    vy = release_views(
        neighbor, "y", eps=eps, trials=trials, releases=releases, same_state=same_state
    )
    if neighbor == "replace-one":
        look = Look.of([1, 0], [0, 1], 2)
    else:
        look = Look.of([1], [0], 2)
    return vx, vy, [look] * releases, p_from_epsilon(eps, NEIGHBOR_RELATIONS[neighbor])


def audit(
    neighbor: str = "replace-one",
    *,
    releases: int = 1,
    eps: float = 1.0,
    trials: int = 1_000_000,
    same_state: bool = False,
) -> Result:
    vx, vy, looks, p = scenario(
        neighbor, releases=releases, eps=eps, trials=trials, same_state=same_state
    )
    return lr_epsilon(vx, vy, looks, p)


def expected_reading(
    neighbor: str,
    releases: int,
    trials: int,
    eps: float = 1.0,
    alpha: float = 1e-6,
    events: int = 200,
) -> float:
    """The Clopper-Pearson reading the best threshold event {sum L >= t} gives in expectation
    (counts at their means), from the exact privacy-loss distribution of ``releases`` 2-layer
    looks; the table of the module docstring. A model figure, not an audit."""
    from scipy import stats

    from tests.lr_audit import log_pmf

    p = p_from_epsilon(eps, NEIGHBOR_RELATIONS[neighbor])
    k, lq = log_pmf(p, 2)
    q = np.exp(lq)
    loss = np.zeros(len(q))
    loss[1:] = lq[:-1] - lq[1:]  # log P_x / P_y of one counter moved by +1
    qy, qx = q, np.concatenate([[0.0], q[:-1]])
    h = 1e-3
    r = int(round(-math.log(p) / h)) + 2
    idx = np.round(loss / h).astype(int) + r
    one_x = np.bincount(idx, weights=qx, minlength=2 * r + 1)
    one_y = np.bincount(idx, weights=qy, minlength=2 * r + 1)
    px, py, off = one_x, one_y, r
    for _ in range(NEIGHBOR_RELATIONS[neighbor] * releases - 1):
        px, py, off = np.convolve(px, one_x), np.convolve(py, one_y), off + r
    cx, cy = np.cumsum(px[::-1])[::-1], np.cumsum(py[::-1])[::-1]
    a = alpha / (4 * events)
    best = -math.inf
    for i in range(0, len(cx), 5):
        kx, ky = cx[i] * trials, cy[i] * trials
        if kx < 5:
            continue
        lo = stats.beta.ppf(a, kx, trials - kx + 1)
        up = stats.beta.ppf(1 - a, ky + 1, trials - ky)
        best = max(best, math.log(lo / up))
    return best


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--trials",
        type=int,
        default=10_000_000,
        help="trials per neighbouring stream (add-remove rows)",
    )
    ap.add_argument(
        "--replace-trials",
        type=int,
        default=5_000_000,
        help="trials per neighbouring stream (replace-one rows; 2 counters each)",
    )
    args = ap.parse_args(argv)
    rows = [
        ("add-remove", 1, False, args.trials),
        ("add-remove", 2, False, args.trials),
        ("add-remove", 2, True, args.trials),
        ("replace-one", 1, False, args.replace_trials),
        ("replace-one", 2, False, args.replace_trials),
        ("replace-one", 2, True, args.replace_trials),
    ]
    print(
        "| neighbours | releases | trials per stream | reading (eps = 1) | model expectation |"
        " attained at | seconds |"
    )
    print("|---|---|---|---|---|---|---|")
    for neighbor, releases, same, trials in rows:
        t0 = time.perf_counter()
        r = audit(neighbor, releases=releases, trials=trials, same_state=same)
        dt = time.perf_counter() - t0
        what = f"{releases}" + (
            " (one state released twice)"
            if same
            else " (two states, same events)"
            if releases == 2
            else ""
        )
        model = "" if same else f"{expected_reading(neighbor, releases, trials):.3f}"
        print(
            f"| {neighbor} | {what} | {trials:,} | {r.eps:.3f} | {model} | {r.where} | {dt:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
