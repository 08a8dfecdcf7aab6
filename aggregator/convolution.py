"""Convolution of many vectors with one fixed, symmetric kernel: the EM's inner loop.

Every EM step for the prevalences (:mod:`aggregator.em`) convolves twice with the noise pmf q
(odd length 2K + 1, symmetric, so convolution and correlation agree),

    (a * q)_i = sum_{m=-K}^{K} a_{i-m} q_m,

thousands of times per release, with the same q. :func:`convolve` computes it at "same" length:
directly for short kernels (numpy's loop wins there), and for wide kernels (small eps, many
layers) by one real FFT of a with the kernel's spectrum kept, since the transform of q is the same
every time. :func:`convolver` makes the choice once for a given length.

What is kept, and why it is not a correctness risk: the spectra and plans are keyed by the
kernel's ``id`` *and hold the kernel*, so an id cannot be reused while its entry lives; both
tables are cleared when they grow past a few dozen entries. scipy's pocketfft kernels and numpy's
correlate kernel are called directly when a probe at first use shows they give bit for bit what
the public functions give (the public functions otherwise): their argument handling was most of
the time of small transforms.

>>> import numpy as np
>>> q = np.array([0.25, 0.5, 0.25])
>>> convolve(np.array([0.0, 4.0, 0.0, 0.0]), q).tolist()
[1.0, 2.0, 1.0, 0.0]

References: numpy.convolve, scipy.fft (pocketfft); docs/speed.md for the measured costs.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["convolve", "convolver"]


_FFT_TAPS = 96  # kernels at least this long convolve by FFT on long axes
_SPECTRA: dict = {}  # (id(q), FFT length) -> (q, its spectrum): the EM convolves with one q


def _kernel_spectrum(q: np.ndarray, size: int) -> np.ndarray:
    from scipy import fft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    key = (id(q), size)
    hit = _SPECTRA.get(key)
    if hit is not None and hit[0] is q:  # the entry holds q, so its id cannot be reused
        return hit[1]
    if len(_SPECTRA) > 16:
        _SPECTRA.clear()
    spec = fft.rfft(q, size)
    _SPECTRA[key] = (q, spec)
    return spec


def convolve(a: np.ndarray, q: np.ndarray) -> np.ndarray:
    """a * q, "same" length (q symmetric, odd length). Direct for short kernels (numpy's loop is
    faster there); one real FFT with the kernel's spectrum cached for the wide kernels of small
    eps or many layers: the EM convolves thousands of times with the same q, and scipy's
    argument handling dominated the transforms' time (docs/core_figures.md, "Convolution")."""
    if len(q) < _FFT_TAPS or len(a) < 4 * len(q):
        return np.convolve(a, q, mode="same")
    key = (id(q), len(a))
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not q:  # the entry holds q, so its id cannot be reused
        from scipy import fft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

        size = fft.next_fast_len(len(a) + len(q) - 1, real=True)
        if len(_PLANS) > 64:
            _PLANS.clear()
        plan = _PLANS[key] = (q, size, (len(q) - 1) // 2, _kernel_spectrum(q, size))
    _, size, half, spec = plan
    buf = np.zeros(size)  # the zero padding scipy.fft.rfft(a, size) makes
    buf[: len(a)] = a
    out = _irfft(_rfft(buf) * spec, size)[half : half + len(a)]
    # FFT rounding is ~1e-16 of the largest value: below that level a value is noise, and a zero
    # there would make the EM's ratio w / m explode
    return np.maximum(out, 1e-15 * max(float(out.max()), 0.0))


_PLANS: dict = {}  # (id(q), len(a)) -> (q, FFT length, kernel half-width, kernel spectrum)


def _fft_pair():
    """(rfft(x), irfft(X, n)) on 1-d float64 / complex128 arrays of the FFT length: scipy's
    pocketfft kernels called directly (the EM makes thousands of small transforms per release,
    and scipy.fft's argument handling took most of their time: docs/core_figures.md), checked at
    first use to give bit for bit what scipy.fft.rfft / irfft give; scipy.fft itself otherwise."""
    from scipy import fft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    try:
        from scipy.fft._pocketfft import pypocketfft as pfft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

        def rfft(x):
            return pfft.r2c(x, (0,), True, 0, None, 1)

        def irfft(X, n):
            return pfft.c2r(X, (0,), n, False, 2, None, 1)

        x = np.random.default_rng().random(1350)  # any values: an equality probe
        X = fft.rfft(x)
        if np.array_equal(rfft(x), X) and np.array_equal(irfft(X, 1350), fft.irfft(X, 1350)):
            return rfft, irfft
    except Exception:  # another scipy: its public functions
        pass
    return fft.rfft, (lambda X, n: fft.irfft(X, n))


def _rfft(x):
    global _rfft, _irfft
    _rfft, _irfft = _fft_pair()
    return _rfft(x)


def _irfft(X, n):
    global _rfft, _irfft
    _rfft, _irfft = _fft_pair()
    return _irfft(X, n)


def convolver(q: np.ndarray, length: int):
    """a -> :func:`convolve` (a, q) for arrays of ``length`` values, with the choice of method and
    numpy's argument handling made once (the EM convolves thousands of times per run)."""
    if len(q) >= _FFT_TAPS and length >= 4 * len(q):
        return lambda a: convolve(a, q)
    if _CORRELATE is None or len(q) > length:
        return lambda a: np.convolve(a, q, mode="same")
    q_rev = q[::-1]
    return lambda a: _CORRELATE(a, q_rev, "same")  # what np.convolve(a, q, "same") calls


_CORRELATE: Callable[..., np.ndarray] | None = None
try:  # numpy's kernel behind np.convolve (np.convolve(a, v) = correlate(a, v[::-1]))
    from numpy._core.multiarray import correlate as _np_correlate

    _probe = np.random.default_rng().random((2, 40))  # any values: an equality probe
    if np.array_equal(
        _np_correlate(_probe[0], _probe[1][:9][::-1], "same"),
        np.convolve(_probe[0], _probe[1][:9], mode="same"),
    ):
        _CORRELATE = _np_correlate
except Exception:  # another numpy: np.convolve itself
    pass
