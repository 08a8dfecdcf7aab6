"""Memos of the last counters: what a release derived from them, kept for its error bars.

A release and its error bars ask for the same fits on the same counters (``auto``'s pilots are
the error bars' stand-ins; its choice is what their bootstrap re-runs), and those fits are the
costliest part of a release, so the last ones are kept. A memo holds one entry per thread
(:class:`LastCounters`): threads of one process release at once. :func:`forget_fits` clears
every memo of the calling thread once its release is made (as
:func:`aggregator.release.estimate_with_accuracy` does), so nothing derived from a window's
counters outlives its release.

An entry is keyed by the counters themselves (:func:`aggregator.counters.counters_key`, or the
value counts compared in full) and the public parameters, so a hit is exactly what a fresh fit
would give: the memos change the cost of a release, never its numbers.

>>> import numpy as np
>>> from aggregator.counters import noisy_value_counts
>>> vc = noisy_value_counts(np.array([2, 0, 1]))
>>> remember_fits(vc, 0.5, 1, {"deconvolution": [2, 1]})
>>> remembered_fit(vc, 0.5, 1, "deconvolution").tolist(), remembered_fit(vc, 0.5, 2, "mle")
([2, 1], None)
>>> forget_fits(); remembered_fit(vc, 0.5, 1, "deconvolution") is None
True
"""

from __future__ import annotations

import threading

import numpy as np

from .counters import NoisyValueCounts

__all__ = ["LastCounters", "remember_fits", "remembered_fit", "forget_fits", "forget_with"]


class LastCounters:
    """A one-entry memo of what was derived from the last counters, one per thread.

    A release and its error bars ask for the same fits on the same counters, so the last result
    is kept. Per thread, because threads of one process compute at once (each aggregation's
    accuracy plan): with one shared entry, a thread could find its key and then read the entry
    another thread had just put there (another window's fit), or find it cleared under it.
    :func:`forget_fits` clears the calling thread's entries.
    """

    def __init__(self):
        self._local = threading.local()
        _FORGET.append(self.clear)

    @property
    def entry(self):
        """The calling thread's last entry (None: none)."""
        return getattr(self._local, "entry", None)

    def put(self, entry) -> None:
        self._local.entry = entry

    def clear(self) -> None:
        self._local.entry = None


_FORGET: list = []  # every memo of a window's counters: each one's clear()
_FITS = LastCounters()  # (counters' value counts, p, layers, {method: projected phi_{>=r}})


def remember_fits(vc: NoisyValueCounts, p: float, layers: int, fits: dict) -> None:
    """Keep the l1-projected estimates ``fits`` ({method: phi_{>=r}}, before any cap) of the
    counters ``vc`` (the last counters only): :func:`aggregator.anonymize.anonymized_cumulative`
    on the same counters takes them instead of fitting again. ``method="auto"`` fits the pilots
    on the real counters (:mod:`aggregator.selection`), and the error bars' stand-ins are the
    same fits. Only fits that do not depend on n belong here (the key holds no n): the caller
    passes those (:attr:`aggregator.estimator.Estimator.uses_n`)."""
    _FITS.put((vc, float(p), int(layers), {m: np.array(y, dtype=np.int64) for m, y in
                                           fits.items()}))


def forget_fits() -> None:
    """Drop what :func:`remember_fits` keeps, every :class:`LastCounters` memo (the calling
    thread's entries: each thread's release forgets its own counters) and every memo registered
    with :func:`forget_with` (the release path does once its release is made: nothing derived
    from a window's counters outlives its release)."""
    for clear in _FORGET:  # _FITS among them
        clear()


def forget_with(clear) -> None:
    """Register ``clear`` (a memo's clear()) to run with :func:`forget_fits`: the memos other
    modules keep of the last counters (``auto``'s choice, hashed mode's start) go with it."""
    _FORGET.append(clear)


def remembered_fit(vc: NoisyValueCounts, p: float, layers: int, method: str):
    held = _FITS.entry
    if held is None:
        return None
    old, p0, k0, fits = held
    if method not in fits or p0 != float(p) or k0 != int(layers):
        return None
    if old is not vc and (old.lo != vc.lo or len(old.c) != len(vc.c)
                          or not np.array_equal(old.c, vc.c)):
        return None
    return fits[method].copy()
