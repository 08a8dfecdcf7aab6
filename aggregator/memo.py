"""A release's memo: what a release derived from its counters, handed to its error bars.

A release and its error bars ask for the same fits on the same counters: ``auto``'s pilot fits
are the error bars' stand-ins, its choice (the candidate, and for the early-stopped EM the
start it took) is what their bootstrap re-runs, and hashed mode's start decision is what the
bootstrap re-runs there. Those fits are the costliest part of a release, so a release makes
one :class:`ReleaseMemo` and passes it (``memo=``) to every call that fits these counters:
:func:`aggregator.release.estimate_with_accuracy` to the estimator and to
:func:`aggregator.intervals.error_bars`, which pass it on to ``anonymize``, ``selection`` and
``largedomain``. The memo is the only link between them, and it is visible in every signature.

A function given no memo computes afresh (the same numbers: every entry is a deterministic
function of its key); only the cost differs. Each entry is keyed by the counters themselves
(:func:`aggregator.counters.counters_key`, or the value counts compared in full) and the public
parameters, so a hit is exactly what a fresh fit would give. The memo lives as long as the
release that made it: nothing derived from a window's counters outlives its release, and two
releases (two threads, two windows) never see each other's entries.

One entry is a choice, not only a cost: in direct mode at one layer ``auto`` may take the
early-stopped EM from its shrunk start (:mod:`aggregator.selection`), and the ``"deconvolution"``
fit it keeps is then that one, so the error bars' stand-in is the fit the release took; without
the memo ``anonymized_cumulative(method="deconvolution")`` is the named estimator (the smoothed
start). :func:`aggregator.intervals.error_bars` therefore always runs with a memo (its own when
given none, in which it makes ``auto``'s choice again): the same numbers either way.

>>> import numpy as np
>>> from aggregator.counters import noisy_value_counts
>>> vc = noisy_value_counts(np.array([2, 0, 1]))
>>> memo = ReleaseMemo()
>>> memo.remember_fits(vc, 0.5, 1, {"deconvolution": [2, 1]})
>>> memo.fit(vc, 0.5, 1, "deconvolution").tolist(), memo.fit(vc, 0.5, 2, "mle")
([2, 1], None)
>>> ReleaseMemo().fit(vc, 0.5, 1, "deconvolution") is None  # another release's memo
True
>>> remembered_fit(None, vc, 0.5, 1, "deconvolution") is None  # no memo: fit afresh
True
"""

from __future__ import annotations

import numpy as np

from .counters import NoisyValueCounts

__all__ = ["ReleaseMemo", "remembered_fit"]


class ReleaseMemo:
    """What one release derived from its counters, one entry per kind (the last one kept).

    * ``fits``: (value counts, p, layers, {method: l1-projected phi_{>=r}}), the fits
      ``auto`` made on the real counters (:meth:`remember_fits`);
    * ``choice``: (key, (phi_{>=r}, (method, cap), start)), :func:`aggregator.selection.select`'s
      result and the early-stopped EM's start decision in direct mode;
    * ``starts``: (key, shrunk?, fit, the other start's fit as released), hashed mode's start
      decision (:func:`aggregator.largedomain.chosen_start`).

    A plain object: made by the release, passed down explicitly, dropped with the release.
    """

    __slots__ = ("fits", "choice", "starts")

    def __init__(self) -> None:
        self.fits: tuple | None = None
        self.choice: tuple | None = None
        self.starts: tuple | None = None

    def remember_fits(self, vc: NoisyValueCounts, p: float, layers: int, fits: dict) -> None:
        """Keep the l1-projected estimates ``fits`` ({method: phi_{>=r}}, before any cap) of the
        counters ``vc``: :func:`aggregator.anonymize.anonymized_cumulative` on the same counters
        takes them instead of fitting again. ``method="auto"`` fits the pilots on the real
        counters (:mod:`aggregator.selection`), and the error bars' stand-ins are the same fits.
        Only fits that do not depend on n belong here (the key holds no n): the caller passes
        those (:attr:`aggregator.estimator.Estimator.uses_n`)."""
        self.fits = (
            vc,
            float(p),
            int(layers),
            {m: np.array(y, dtype=np.int64) for m, y in fits.items()},
        )

    def fit(self, vc: NoisyValueCounts, p: float, layers: int, method: str):
        """The kept fit of ``method`` on these counters (a copy), or None."""
        if self.fits is None:
            return None
        old, p0, k0, fits = self.fits
        if method not in fits or p0 != float(p) or k0 != int(layers):
            return None
        if old is not vc and (
            old.lo != vc.lo or len(old.c) != len(vc.c) or not np.array_equal(old.c, vc.c)
        ):
            return None
        return fits[method].copy()


def remembered_fit(
    memo: ReleaseMemo | None, vc: NoisyValueCounts, p: float, layers: int, method: str
):
    """``memo.fit(...)``, None without a memo (the caller fits afresh)."""
    return None if memo is None else memo.fit(vc, p, layers, method)
