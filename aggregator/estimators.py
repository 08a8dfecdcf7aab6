"""The registry of the estimators of phi_{>=r} by name, and the one a release uses when none is
named.

:data:`ESTIMATORS` maps each name to its :class:`aggregator.estimator.Estimator` (the name, whether
it uses n, whether it runs on hash buckets, where it is usable, its fit, one line of doc); every
list of estimator names is read from it: :data:`METHODS` here, the choices of
``release.estimator`` (:mod:`aggregator.service.config`), ``panagg estimators``, hashed mode's
(:data:`aggregator.largedomain.HASHED_METHODS`), and ``auto``'s candidates
(:mod:`aggregator.selection`, which takes the count-only ones, :data:`aggregator.estimator.BASIC`).
:func:`phi_estimate` dispatches by name through it. The estimators:

* ``"threshold"``, ``"deconvolution"``, ``"mle"``: need nothing but the counters
  (:mod:`aggregator.estimator`: the unbiased threshold estimate, the early-stopped EM, the
  converged NPMLE);
* ``"wupagh"``: Wu and Pagh's inverse-filter profile (:mod:`aggregator.wupagh`);
* ``"xfit"``: the EM stopped by cross-fitting, with n (:mod:`aggregator.crossfit`);
* ``"auto"``: one of the count-only ones with a cap rule, chosen from the counters by minimax
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

from .counters import check_layers as _check_layers
from .crossfit import crossfit_prevalence
from .estimator import BASIC, Estimator
from .selection import selected_prevalence
from .threshold import threshold_usable
from .wupagh import wupagh_prevalence

__all__ = [
    "ESTIMATORS",
    "METHODS",
    "estimator",
    "MODES",
    "DEFAULTS",
    "DEFAULT_METHODS",
    "default_method",
    "default_cap",
    "phi_estimate",
]


WUPAGH = Estimator(
    "wupagh",
    lambda noisy_counts, p, *, layers, n, hashed: wupagh_prevalence(noisy_counts, p, layers=layers),
    "Wu and Pagh (ICML 2024): the noise's circulant inverse, projected onto the simplex",
    usable=threshold_usable,
)  # the same inverse filter g^{*k} as the threshold estimate
XFIT = Estimator(
    "xfit",
    lambda noisy_counts, p, *, layers, n, hashed: crossfit_prevalence(
        noisy_counts, p, layers=layers, n=n
    ),
    "the EM stopped where the held-out likelihood of half the counters peaks",
    uses_n=True,
)
AUTO = Estimator(
    "auto",
    lambda noisy_counts, p, *, layers, n, hashed, memo: selected_prevalence(
        noisy_counts, p, layers=layers, n=n, hashed=hashed, memo=memo
    ),
    "a count-only estimator and cap rule chosen from the counters by minimax bootstrap regret",
    uses_n=True,
    uses_memo=True,
)

#: every estimator by name: the one place a name is written
ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (*BASIC, WUPAGH, XFIT, AUTO)}
METHODS = tuple(ESTIMATORS)
MODES = ("direct", "hashed")


def estimator(name: str) -> Estimator:
    """The estimator called ``name`` (:data:`ESTIMATORS`).

    >>> estimator("xfit").uses_n, estimator("mle").hashed
    (True, True)
    """
    if name not in ESTIMATORS:
        raise ValueError(f"method must be one of {METHODS}, got {name!r}")
    return ESTIMATORS[name]


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

# (The grid also evaluates rules on the public signal-to-noise ratio that would replace a
# DEFAULTS entry when n is known, bench/accuracy/accuracy_grid.py "rules"; none has beaten the
# fixed table
# held out, so none is in the code: tests/test_grid_defaults.py fails when the grid adopts one.)


def _default(mode: str, layers: int) -> tuple[str, str]:
    """DEFAULTS' entry of the largest layer count at most ``layers`` for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    k = _check_layers(layers)
    return DEFAULTS[(mode, max(kk for m, kk in DEFAULTS if m == mode and kk <= k))]


def default_method(mode: str, layers: int) -> str:
    """The estimator a release uses when none is named (:data:`DEFAULTS`).

    >>> default_method("hashed", 1), default_method("direct", 2), default_method("direct", 5)
    ('auto', 'auto', 'auto')
    """
    return _default(mode, layers)[0]


def default_cap(mode: str, layers: int) -> str:
    """The rule that caps a release's total at n when none is named (:data:`DEFAULTS`)."""
    return _default(mode, layers)[1]


def phi_estimate(
    noisy_counts, p, *, layers=1, method=None, mode="direct", n=None, memo=None
) -> np.ndarray:
    """phi_hat_{>=r} by the named estimator (:data:`METHODS`; default :func:`default_method`).

    ``n``: the number of events when public; the estimators that use it (``"xfit"``) fit
    under sum_r phi_{>=r} = n, the others ignore it.

    ``mode``: ``"hashed"`` when the counters are hash buckets (their phi is then the reduced
    histogram's, which :mod:`aggregator.largedomain` inverts); it selects the default, and the
    estimators' ``hashed`` (the EM's early stop: :func:`aggregator.deconvolution.deconv_tol`).
    ``memo``: the release's :class:`aggregator.memo.ReleaseMemo` (``"auto"`` keeps its choice
    and pilot fits there for the error bars); None computes afresh.
    """
    if method is None:
        method = default_method(mode, layers)
    return estimator(method).estimate(
        noisy_counts, p, layers=layers, n=n, hashed=mode == "hashed", memo=memo
    )
