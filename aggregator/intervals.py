"""How far a release can be trusted: the noise floor ("signal below noise") and error bars.

Noise floor
-----------
Every counter carries k layers of DLap(p) noise Z, pmf q. Take a state with no events and ask how
well ANY estimator can count the items seen once: a counter holding one event has noisy value
1 + Z, an empty one Z, and the number of one-event items among C mostly empty counters is a
mixture weight. Its Fisher information per counter is the chi-square divergence

    chi2_k = sum_v (q(v - 1) - q(v))^2 / q(v),

so by the Cramer-Rao bound no unbiased estimate of the number of items has a standard error below
sigma = sqrt(C / chi2_k) (:func:`noise_floor`). For one layer chi2_1 = (1 - p)^2 / p exactly, the
1/x of seed 001 Lemma 10, and sigma = sqrt(C x); each further layer widens q and lowers chi2_k.
The signal is the n events (the l1 norm of the true cumulative prevalence), so the release's
relative l1 error cannot be much below sigma / n: :func:`signal_to_noise` is n / sigma, computed
from public quantities only (n, the number of counters, p, k), so it can be checked before any
data arrives. Below :data:`SNR_MIN` = 2 the release is flagged (:func:`signal_below_noise`): over
the accuracy grid (bench/grid.py, 468 cells and layer counts), the best estimator's relative l1
error reached 1/2 only at SNR <= 1.6 (docs/accuracy_grid.md, "Signal below noise").

Error bars
----------
:func:`error_bars` is a parametric bootstrap. A stand-in truth is fitted to the counters, the state
is simulated from it (same counters, mode, p, layers; hashed mode re-hashes the items uniformly
into the B buckets), the release's estimator runs on each simulated state, and the deviations of
the re-estimates from the stand-in give the intervals around the release (basic bootstrap: the
release minus the quantiles of the deviations, which also carries the estimator's bias). The
stand-in is the converged NPMLE's histogram (``model="mle"``), the maximum-likelihood description
of the counters, not the release itself: an estimator that smooths (the early-stopped EM) shows
less bias when re-run on its own, already smooth output, and the bounds came out too short
(measured in docs/accuracy_grid.md, "Error bars", with the coverage of each quantity). The bootstrap
randomness touches only released values, never the state: it is post-processing, and a seeded
generator is fine here.

>>> round(noise_floor(10**6, 0.6065306597126334, 1))   # sqrt(1e6 x), x = p/(1-p)^2 = 3.918
1979
>>> signal_below_noise(1000, 10**6, 0.6065306597126334, 1)
True
"""

from __future__ import annotations

import math

import numpy as np

from .estimate import (
    NoisyValueCounts, anonymized_histogram, cumulative_from_counts, noise_pmf, noisy_value_counts,
)
from .properties import entropy

__all__ = ["chi2_shift", "noise_floor", "signal_to_noise", "SNR_MIN", "signal_below_noise",
           "simulate_counts", "error_bars"]

SNR_MIN = 2.0  # relative error >= 1/2 for the best estimator only below SNR 1.6 (accuracy grid)


def chi2_shift(p: float, layers: int = 1) -> float:
    """chi2_k = sum_v (q(v-1) - q(v))^2 / q(v) for q the pmf of ``layers`` DLap(p) draws.

    >>> p = 0.5
    >>> round(chi2_shift(p), 6) == round((1 - p) ** 2 / p, 6)
    True
    """
    _, q = noise_pmf(p, layers)
    shifted = np.concatenate([[0.0], q[:-1]])  # q(v - 1)
    return float(np.sum((shifted - q) ** 2 / q))


def noise_floor(counters: int, p: float, layers: int = 1) -> float:
    """sqrt(counters / chi2_k): the Cramer-Rao standard error for the number of items."""
    if counters < 1:
        raise ValueError(f"counters must be >= 1, got {counters}")
    return math.sqrt(counters / chi2_shift(p, layers))


def signal_to_noise(n: int, counters: int, p: float, layers: int = 1) -> float:
    """n / noise_floor: events against the smallest achievable error on the number of items."""
    return float(n) / noise_floor(counters, p, layers)


def signal_below_noise(n: int, counters: int, p: float, layers: int = 1) -> bool:
    """True when signal_to_noise < :data:`SNR_MIN`: the release is mostly noise."""
    return signal_to_noise(n, counters, p, layers) < SNR_MIN


def simulate_counts(rng: np.random.Generator, values, counters: int, p: float,
                    layers: int) -> NoisyValueCounts:
    """Noisy-value counts of ``values`` plus counters - len(values) zero counters.

    Each counter gets ``layers`` DLap(p) draws (differences of geometric variables); the zero
    counters are exchangeable, so their noisy values are one multinomial draw over the exact pmf.
    For the bootstrap only (seeded, not private): the state's noise comes from aggregator.noise.
    """
    values = np.asarray(values, dtype=np.int64)
    if len(values) > counters:
        raise ValueError("more non-zero values than counters")
    noise = np.zeros(len(values), dtype=np.int64)
    for _ in range(layers):
        noise += rng.geometric(1.0 - p, len(values)) - rng.geometric(1.0 - p, len(values))
    vc = noisy_value_counts(values + noise) if len(values) else None
    zeros = counters - len(values)
    if zeros:
        K, q = noise_pmf(p, layers)
        empty = NoisyValueCounts(-K, rng.multinomial(zeros, q).astype(np.int64))
        vc = empty if vc is None else vc.merge(empty)
    return vc


def _simulated_state(rng, counts, counters, p, layers, hashed):
    if hashed:  # a fresh uniform hash of the items into the buckets
        red = np.bincount(rng.integers(0, counters, len(counts)), weights=counts,
                          minlength=counters).astype(np.int64)
        counts = red[red > 0]
    return simulate_counts(rng, counts[:counters], counters, p, layers)


def error_bars(noisy_counts, p, *, layers=1, n=None, buckets=None, method=None, cap=None,
               reps=30, level=0.9, rng=None, model="mle") -> dict:
    """The release and parametric-bootstrap error bars for it.

    Arguments as for :func:`aggregator.estimate.anonymized_histogram` (the estimate is exactly
    the release's), plus ``reps`` bootstrap repetitions, the two-sided ``level``, ``rng`` (a
    numpy Generator or seed for the bootstrap, not for privacy noise) and ``model``, the
    estimator whose histogram stands in for the truth (None: the release itself). Returns:

    * ``histogram``: the release (counts, decreasing).
    * ``l1_bound``: the ``level`` quantile of the l1 distance between the re-estimates and the
      stand-in truth: an estimate of the ``level`` quantile of the release's l1 error.
    * ``phi_lower``, ``phi_upper``: basic bootstrap interval for phi_{>=r}, r = 1..len (index 0
      is r = 1), clipped to [0, n].
    * ``distinct``: (lower, upper) for the number of items (phi_{>=1}).
    * ``entropy_nats``: (lower, upper) for the plug-in entropy.
    * ``signal_to_noise``, ``signal_below_noise``: :func:`signal_to_noise` and its flag (with
      ``n``), and ``relative_l1_bound`` = l1_bound / n.

    >>> from aggregator.noise import discrete_laplace
    >>> g = np.random.default_rng(0)
    >>> h = np.concatenate([g.integers(1, 60, 200), np.zeros(800, np.int64)])
    >>> eb = error_bars(h + discrete_laplace(0.3, 1000, rng=g), 0.3, n=int(h.sum()), reps=20,
    ...                 rng=1)
    >>> lo, hi = eb["distinct"]
    >>> bool(lo <= len(eb["histogram"]) <= hi) and eb["l1_bound"] > 0
    True
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if int(reps) < 2:
        raise ValueError("reps must be >= 2")
    rng = np.random.default_rng(rng)
    vc = noisy_value_counts(noisy_counts)
    counters = vc.total
    kw = dict(layers=layers, n=n, buckets=buckets, method=method, cap=cap)
    est = anonymized_histogram(vc, p, **kw)
    y = cumulative_from_counts(est)
    truth = est if model is None else anonymized_histogram(vc, p, **(kw | {"method": model}))
    y_t = cumulative_from_counts(truth)
    boot_y, boot_l1, boot_h = [], [], []
    for _ in range(int(reps)):
        sim = _simulated_state(rng, truth, counters, p, layers, buckets is not None)
        e = anonymized_histogram(sim, p, **kw)
        ys = cumulative_from_counts(e)
        m = max(len(ys), len(y_t))
        boot_y.append(np.pad(ys, (0, m - len(ys))))
        boot_l1.append(float(np.abs(np.pad(ys, (0, m - len(ys))) - np.pad(y_t, (0, m - len(y_t))))
                             .sum()))
        boot_h.append(entropy(e) - entropy(truth))
    R = max(len(y), len(y_t), max(len(b) for b in boot_y))
    Y = np.stack([np.pad(b, (0, R - len(b))) for b in boot_y]).astype(np.float64)
    y_full = np.pad(y, (0, R - len(y))).astype(np.float64)
    a = (1.0 - level) / 2.0
    q_lo, q_hi = np.quantile(Y - np.pad(y_t, (0, R - len(y_t))), [a, 1.0 - a], axis=0)
    top = float(n) if n is not None else math.inf
    lower = np.clip(y_full - q_hi, 0.0, top)
    upper = np.clip(y_full - q_lo, 0.0, top)
    h_hat = entropy(est)
    h_lo, h_hi = np.quantile(np.asarray(boot_h), [a, 1.0 - a])
    out = {
        "histogram": est,
        "level": level,
        "reps": int(reps),
        "l1_bound": float(np.quantile(boot_l1, level)),
        "phi_lower": lower,
        "phi_upper": upper,
        "distinct": (float(lower[0]) if R else 0.0, float(upper[0]) if R else 0.0),
        "entropy_nats": (max(h_hat - h_hi, 0.0), h_hat - h_lo),
    }
    if n is not None:
        out["relative_l1_bound"] = out["l1_bound"] / max(int(n), 1)
        out["signal_to_noise"] = signal_to_noise(int(n), counters, p, layers)
        out["signal_below_noise"] = out["signal_to_noise"] < SNR_MIN
    return out
