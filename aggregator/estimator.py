"""An estimator of the cumulative prevalence as an object, and the three that need only counters.

Every estimator of phi_{>=r} = #{j : h_j >= r} in this package maps the noisy counters (or their
value counts c_v), the DLap parameter p and the layer count k to a real-valued estimate
phi_hat_{>=r}, r = 1..R, not yet projected (:mod:`aggregator.projection` makes it a valid
histogram, :mod:`aggregator.cap` caps it at n). An :class:`Estimator` says, beside that map,
what the release around it needs to know:

* ``uses_n``: whether it uses the public number of events n when given (fitting under
  sum_r phi_{>=r} = n); one that does not gives the same estimate with and without n, so its
  fit may be kept for the same counters whatever n
  (:meth:`aggregator.memo.ReleaseMemo.remember_fits`);
* ``hashed``: whether it may run on hash-bucket counters (:mod:`aggregator.largedomain`);
* ``usable(p, layers)``: whether it can run at all there (the inverse filters amplify the noise
  past 1e6 with the many layers of a rollup: :func:`aggregator.threshold.threshold_usable`).

This module holds the three that need nothing but the counters (:data:`BASIC`): the threshold
estimate (unbiased), the early-stopped EM and the converged NPMLE. The registry of every
estimator by name, the ones built on these among them, is :mod:`aggregator.estimators`.

>>> import numpy as np
>>> [e.name for e in BASIC], DECONVOLUTION.uses_n, THRESHOLD.usable(0.6065, 48)
(['threshold', 'deconvolution', 'mle'], False, False)
>>> THRESHOLD.estimate(np.array([3, 0, 1, 0, 0]), 0.1).round(2).tolist()
[1.75, 0.88, 1.12, -0.12]

References: seed 001 (Lemma 10: the threshold estimate); docs/estimators.md (what each one
costs and where it wins); docs/accuracy_grid.md (the measurements behind the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .deconvolution import DECONV_MAX_ITER, MLE_MAX_ITER, MLE_TOL, deconvolved_prevalence
from .threshold import cumulative_prevalence, threshold_usable

__all__ = [
    "Estimator",
    "THRESHOLD",
    "DECONVOLUTION",
    "MLE",
    "BASIC",
    "BASIC_METHODS",
    "basic_prevalence",
]


def _always(p: float, layers: int) -> bool:
    return True


@dataclass(frozen=True)
class Estimator:
    """An estimator of phi_{>=r} by name.

    ``fit(noisy_counts, p, *, layers, n, hashed)`` returns phi_hat_{>=r} (floats, not
    projected); ``hashed``: the counters are hash buckets (the EM's early stop does not scale
    with the layers there: :func:`aggregator.deconvolution.deconv_tol`). :meth:`estimate`
    calls it after checking :attr:`usable`. ``doc``: one line for listings
    (``panagg estimators``). ``uses_memo``: ``fit`` also takes ``memo``, a release's
    :class:`aggregator.memo.ReleaseMemo` (or None), to keep what it derived for the error bars.
    """

    name: str
    fit: Callable[..., np.ndarray] = field(repr=False)
    doc: str
    uses_n: bool = False
    hashed: bool = True
    usable: Callable[[float, int], bool] = field(default=_always, repr=False)
    uses_memo: bool = False

    def estimate(
        self, noisy_counts, p: float, *, layers: int = 1, n=None, hashed: bool = False, memo=None
    ) -> np.ndarray:
        """phi_hat_{>=r} of these counters (``n``: the public number of events, or None;
        ``hashed``: they are hash buckets; ``memo``: the release's, for the estimators that
        keep what they derive, :attr:`uses_memo`)."""
        if not self.usable(p, layers):
            raise ValueError(
                f"the {self.name} estimator cannot run on {layers} noise layers "
                "(its inverse filter amplifies the noise past 1e6); use "
                "release.estimator = default"
            )
        if self.uses_memo:
            return self.fit(noisy_counts, p, layers=layers, n=n, hashed=hashed, memo=memo)
        return self.fit(noisy_counts, p, layers=layers, n=n, hashed=hashed)


THRESHOLD = Estimator(
    "threshold",
    lambda noisy_counts, p, *, layers, n, hashed: cumulative_prevalence(
        noisy_counts, p, layers=layers
    ),
    "unbiased inverse-filter estimate (seed 001 Lemma 10); its variance grows ~100x per layer",
    usable=threshold_usable,
)
DECONVOLUTION = Estimator(
    "deconvolution",
    lambda noisy_counts, p, *, layers, n, hashed: deconvolved_prevalence(
        noisy_counts, p, layers=layers, hashed=hashed
    ),
    f"EM NPMLE of the prevalences stopped early (deconv_tol, at most {DECONV_MAX_ITER} steps)",
)
MLE = Estimator(
    "mle",
    lambda noisy_counts, p, *, layers, n, hashed: deconvolved_prevalence(
        noisy_counts, p, layers=layers, max_iter=MLE_MAX_ITER, tol=MLE_TOL
    ),
    "the same EM run to convergence: the NPMLE",
)

#: the estimators that need nothing but the counters, in registry order
BASIC = (THRESHOLD, DECONVOLUTION, MLE)
BASIC_METHODS = tuple(e.name for e in BASIC)
_BY_NAME = {e.name: e for e in BASIC}


def basic_prevalence(
    noisy_counts, p, *, layers=1, method="deconvolution", hashed=False
) -> np.ndarray:
    """phi_hat_{>=r} by one of the estimators that need nothing but the counters
    (:data:`BASIC`); :func:`aggregator.estimators.phi_estimate` names every estimator, these
    and the ones built on them."""
    if method not in _BY_NAME:
        raise ValueError(f"method must be one of {BASIC_METHODS}, got {method!r}")
    return _BY_NAME[method].estimate(noisy_counts, p, layers=layers, hashed=hashed)
