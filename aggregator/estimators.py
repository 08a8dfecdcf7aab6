"""The estimators of phi_{>=r} by name, and the one a release uses when none is named.

The estimators (:data:`METHODS`):

* ``"threshold"``, ``"deconvolution"``, ``"mle"``: need nothing but the counters
  (:func:`aggregator.estimate.basic_prevalence`: the unbiased threshold estimate, the
  early-stopped EM, the converged NPMLE);
* ``"xfit"``: the EM stopped by cross-fitting, with n
  (:func:`aggregator.estimate.crossfit_prevalence`);
* ``"wupagh"``: Wu and Pagh's inverse-filter profile (:mod:`aggregator.wupagh`);
* ``"auto"``: one of the basic ones with a cap rule, chosen from the counters by minimax
  bootstrap regret (:mod:`aggregator.selection`).

The default per (mode, layers) is :data:`DEFAULTS` (:func:`default_method`, :func:`default_cap`),
chosen on the accuracy grid and checked held out (docs/accuracy_grid.md). This module sits above
the estimators it names and below the modules that release with them
(:mod:`aggregator.largedomain`, :mod:`aggregator.anonymize`): the estimator core imports none
of them.

>>> default_method("direct", 2), default_cap("hashed", 1)
('auto', 'items')
>>> import numpy as np
>>> from aggregator.estimate import project_l1
>>> counters = np.array([3, 0, 1, 0, 0])   # noisy counters; p = 0.1 is little noise
>>> phi_estimate(counters, 0.1, method="threshold").round(2).tolist()   # unbiased, not monotone
[1.75, 0.88, 1.12, -0.12]
>>> project_l1(phi_estimate(counters, 0.1, method="threshold")).tolist()  # phi_{>=1..3}
[2, 1, 1, 0]
"""

from __future__ import annotations

import numpy as np

from . import counter_model
from .estimate import (
    BASIC_METHODS, _BUCKET_COUNTERS, _check_layers, basic_prevalence, bucket_counters,
    crossfit_prevalence, threshold_usable,
)
from .selection import selected_prevalence
from .wupagh import wupagh_prevalence

__all__ = ["METHODS", "MODES", "DEFAULTS", "DEFAULT_METHODS", "DEFAULT_RULES", "default_method",
           "default_cap", "phi_estimate"]


METHODS = ("threshold", "deconvolution", "mle", "wupagh", "xfit", "auto")
MODES = ("direct", "hashed")


# (mode, layers) -> (method, cap rule); a layer count without a key uses the largest key below it.
# Chosen by the lowest worst-case regret over the accuracy grid, every candidate on the same noisy
# counters (docs/accuracy_grid.md; bench/accuracy/accuracy_grid.py writes the choice to
# bench/accuracy/grid_defaults.json, and tests/test_grid_defaults.py checks this table against it).
DEFAULTS = {
    ("direct", 1): ("auto", "items"),
    ("direct", 2): ("auto", "items"),
    ("direct", 3): ("auto", "items"),
    ("direct", 6): ("auto", "items"),
    ("hashed", 1): ("auto", "items"),
    ("hashed", 2): ("auto", "items"),
    ("hashed", 3): ("auto", "items"),
    ("hashed", 6): ("auto", "items"),
}
DEFAULT_METHODS = {key: method for key, (method, _) in DEFAULTS.items()}


# (mode, layers) -> (snr cut, (method, cap) below it, (method, cap) at or above it): a rule on the
# public signal-to-noise ratio (counter_model.signal_to_noise(n, counters, p, layers)) that replaces
# the fixed DEFAULTS entry when n is known. Chosen on the accuracy grid like DEFAULTS (lowest
# worst-case regret; bench/accuracy/grid_defaults.json "rules"); layers above the largest key:
# its entry.
DEFAULT_RULES: dict = {}


def _key(table: dict, mode: str, layers: int):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    k = _check_layers(layers)
    keys = [kk for m, kk in table if m == mode and kk <= k]
    return (mode, max(keys)) if keys else None


def _default(mode: str, layers: int, n=None, counters=None, p=None) -> tuple[str, str]:
    key = _key(DEFAULT_RULES, mode, layers)
    if key is not None and None not in (n, counters, p) and counters > 0:
        cut, low, high = DEFAULT_RULES[key]
        snr = counter_model.signal_to_noise(int(n), int(counters), p, int(layers))
        return low if snr < cut else high
    return DEFAULTS[_key(DEFAULTS, mode, layers)]


def default_method(mode: str, layers: int, *, n=None, counters=None, p=None) -> str:
    """The estimator a release uses when none is named (:data:`DEFAULTS`).

    >>> default_method("hashed", 1), default_method("direct", 2), default_method("direct", 5)
    ('auto', 'auto', 'auto')
    """
    return _default(mode, layers, n, counters, p)[0]


def default_cap(mode: str, layers: int, *, n=None, counters=None, p=None) -> str:
    """The rule that caps a release's total at n when none is named (:data:`DEFAULTS`; with n,
    the number of counters and p: :data:`DEFAULT_RULES` where it has an entry)."""
    return _default(mode, layers, n, counters, p)[1]


def phi_estimate(noisy_counts, p, *, layers=1, method=None, mode="direct", n=None) -> np.ndarray:
    """phi_hat_{>=r} by the named estimator (:data:`METHODS`; default :func:`default_method`).

    ``n``: the number of events when public; the estimators that use it (``"xfit"``) fit
    under sum_r phi_{>=r} = n, the others ignore it.

    ``mode`` only selects the default: ``"hashed"`` when the counters are hash buckets (their
    phi is then the reduced histogram's, which :mod:`aggregator.largedomain` inverts).
    """
    if method is None:
        method = default_method(mode, layers)
    if mode == "hashed" and not _BUCKET_COUNTERS.get():
        with bucket_counters():
            return phi_estimate(noisy_counts, p, layers=layers, method=method, mode=mode, n=n)
    if method in BASIC_METHODS:
        return basic_prevalence(noisy_counts, p, layers=layers, method=method)
    if method == "auto":
        return selected_prevalence(noisy_counts, p, layers=layers, n=n)
    if method == "xfit":
        return crossfit_prevalence(noisy_counts, p, layers=layers, n=n)
    if method == "wupagh":
        if not threshold_usable(p, layers):  # the same inverse filter g^{*k}
            raise ValueError(f"the wupagh estimator cannot run on {layers} noise layers (its "
                             "inverse filter amplifies the noise past 1e6); use "
                             "release.estimator = default")
        return wupagh_prevalence(noisy_counts, p, layers=layers)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
