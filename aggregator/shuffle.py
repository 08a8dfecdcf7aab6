"""Shuffle-model histograms: client randomizers and analyzers (seed 001 Cor. 3, seed 002).

In the shuffle model no party sees an identifiable message: each client randomizes its own
event into a multiset of messages, a shuffler strips metadata and permutes all messages of a
window, and the analyzer sees only the permuted multiset. Privacy is judged on that multiset,
for two windows of ``n`` events that differ in one event (replace-one, ``n`` public).

Two protocols, each a randomizer (one event -> messages) and an analyzer (messages -> counts):
**Correlated noise (GKMP).** Ghazi, Kumar, Manurangsi, Pagh, ICML 2020 (seed 001 ref. [29]).
Messages are ``(bucket, sign)`` rows. An event in bucket ``x`` sends ``(x, +1)``; for every bucket
``j`` it also sends ``Z+_j`` copies of ``(j, +1)`` and ``Z-_j`` copies of ``(j, -1)`` with
``Z ~ NB(1/n, p)``, and ``W_j ~ NB(r/n, q)`` flooding pairs ``(j, +1), (j, -1)``. Negative binomials
add up in their shape, so over the ``n`` events of a window bucket ``j`` holds

    N+_j = h_j + G1_j + F_j,      N-_j = G2_j + F_j,
    G1, G2 ~ NB(1, p) = Geometric(p),  F ~ NB(r, q),

and the analyzer's ``N+_j - N-_j = h_j + (G1_j - G2_j) = h_j + DLap(p)`` exactly: every estimator
of the pan-private path applies unchanged. Without flooding ``N-_j`` would reveal ``G2_j`` and
with it ``h_j + G1_j``, one-sided noise with no privacy; ``F`` hides how the difference splits.

The privacy budget splits: the DLap part takes ``(1 - gamma) eps`` (``p = exp(-(1-gamma) eps/2)``,
sensitivity 2 under replace-one) and the flooding buys the rest of ``eps`` with probability
``1 - delta``. The constants ``(r, q)`` are not taken from an asymptotic bound: they are the
cheapest pair (fewest expected messages) whose exact privacy profile, computed by
:func:`gkmp_delta`, is at most ``delta`` at ``eps``. ``docs/shuffle.md`` proves the formula
:func:`gkmp_delta` evaluates; the tests check it against brute-force enumeration of the view.

**Balcer-Cheu P^hist** (seed 002, Fig. 1-2, Thm 3.2): for every bucket ``j`` each event sends
``1[x = j] + Ber(s)`` copies of ``j``, ``s = 1 - 50 ln(2/delta') / (eps'^2 n)``; the analyzer
outputs ``N_j - s n`` where ``N_j > n`` and 0 elsewhere. It is ``(2 eps', 2 delta')``-DP, so
``eps' = eps/2, delta' = delta/2`` here. Its noise is ``Bin(n, s) - s n``, not DLap, and it sends
about ``B`` messages per event whatever ``n``: a baseline with its own analyzer.

Sampling. Noise comes from the operating system's CSPRNG (:class:`aggregator.noise.OSEntropy`,
or any object with ``bytes(k)`` in tests). Negative binomials with real shape ``k = 1/n`` have
irrational probabilities, so they cannot be sampled exactly from finitely many bits. They are
*provably close*: the positions of the non-zero buckets are geometric skips decided exactly
from the random bits (a float path with a guard band, and a 300-bit decimal path inside the
band), and the non-zero values come from an inverse-CDF table of 128-bit thresholds. The total
variation from the exact law is at most :data:`SAMPLING_TV_PER_DRAW` per draw (each of the at
most ``2**20`` thresholds is a floor at 2**-128, the tail beyond the table is below 2**-140); the
randomizer adds the per-window total, ``3 n (B + 1)`` draws at most, to the ``delta`` it reports
(``delta_spent``).

>>> rz = GKMPRandomizer(epsilon=1.0, delta=1e-6, n=1000, buckets=50)
>>> round(rz.p, 4)
0.6376
>>> rz.delta_spent <= 1e-6
True
>>> rows = rz.encode(7)
>>> rows.dtype, rows.shape[1]
(dtype('int64'), 2)
>>> counts = gkmp_analyze(rows, 50)     # one event plus its shares of the noise
>>> counts.shape
(50,)

References
----------
Ghazi, Kumar, Manurangsi, Pagh. Private Counting from Anonymous Messages: Near-Optimal Accuracy
with Vanishing Communication Overhead. ICML 2020.
Ghazi, Kamath, Kumar, Manurangsi. Anonymized Histograms in Intermediate Privacy Models. NeurIPS
2022 (Corollary 3).
Balcer, Cheu. Separating Local & Shuffled Differential Privacy via Histograms. ITC 2020.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import lru_cache

import numpy as np
from scipy.signal import lfilter
from scipy.special import gammaln

from .noise import OSEntropy, p_from_epsilon

__all__ = [
    "GKMPRandomizer",
    "gkmp_analyze",
    "gkmp_delta",
    "BalcerCheuRandomizer",
    "balcer_cheu_analyze",
    "balcer_cheu_delta",
    "SAMPLING_TV_PER_DRAW",
    "ShuffleConfigError",
]

_SOURCE = OSEntropy()
_TABLE_BITS = 128
# bound on the total variation of one table draw (see _NegBinomial)
SAMPLING_TV_PER_DRAW = 2.0**-100
DEFAULT_MAX_MESSAGES = 10_000  # expected messages per event above which a configuration is refused


class ShuffleConfigError(ValueError):
    """A protocol configuration that cannot be run as asked (the message names the fix)."""


# --------------------------------------------------------------------------------------------
# exact-ish samplers


def _words(source, count: int) -> np.ndarray:
    raw = source.bytes(8 * count)
    return np.frombuffer(raw, dtype="<u8", count=count).astype(np.uint64, copy=False)


def _dec(x) -> Decimal:
    if isinstance(x, Fraction):
        return Decimal(x.numerator) / Decimal(x.denominator)
    return Decimal(x)  # floats are dyadic: exact


class _NegBinomial:
    """Independent ``NB(k, q)`` draws for every bucket of ``range(buckets)``, returned sparsely.

    ``P[X = 0] = (1 - q)**k``; given ``X >= 1`` the value comes from a table. Which buckets are
    non-zero is decided by geometric skips: the gap ``g`` before the next non-zero bucket has
    ``P[g >= m] = P0**m``, i.e. ``g = floor(ln U / ln P0)``, decided from the random bits exactly.
    """

    def __init__(self, k: Fraction, q: float):
        if not (0.0 < q < 1.0):
            raise ValueError(f"q must be in (0, 1), got {q!r}")
        self.k = Fraction(k)
        self.q = float(q)
        with localcontext() as ctx:
            ctx.prec = 80
            kd, qd = _dec(self.k), _dec(self.q)
            self._ln_p0_dec = kd * (1 - qd).ln()  # ln P[X = 0] < 0
            p0 = self._ln_p0_dec.exp()
            nz = 1 - p0  # P[X >= 1]
            # pmf(j) / P[X >= 1] for j >= 1, by the ratio pmf(j)/pmf(j-1) = (k + j - 1) q / j
            thresholds = []
            term = p0 * kd * qd / nz  # pmf(1) / P[X >= 1]
            cdf = Decimal(0)
            tiny = Decimal(2) ** -(_TABLE_BITS + 12)
            scale = Decimal(2) ** _TABLE_BITS
            j = 1
            while True:
                cdf += term
                if 1 - cdf <= tiny:
                    break
                if j >= 2**20:  # keeps the table's TV <= 2**20 * 2**-127 < SAMPLING_TV_PER_DRAW
                    raise ShuffleConfigError(f"q={q!r} is too close to 1 for an exact table")
                thresholds.append(int((cdf * scale).to_integral_value(rounding="ROUND_FLOOR")))
                term = term * (kd + j) * qd / (j + 1)
                j += 1
        self.p0 = float(p0)
        self.nonzero = float(nz)
        self._ln_p0 = float(self._ln_p0_dec)
        self._t = thresholds  # value = 1 + #{t <= U}
        self._t_hi = np.array([t >> 64 for t in thresholds], dtype=np.uint64)
        self.table_size = len(thresholds) + 1

    # -- non-zero values ----------------------------------------------------------------
    def _values(self, count: int, source) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        w = _words(source, 2 * count).reshape(count, 2)
        hi, lo = w[:, 0], w[:, 1]
        below = np.searchsorted(self._t_hi, hi, side="left")  # thresholds with hi part < U's
        out = 1 + below.astype(np.int64)
        ties = (
            np.nonzero(
                (below < len(self._t)) & (self._t_hi[np.minimum(below, len(self._t) - 1)] == hi)
            )[0]
            if len(self._t)
            else np.zeros(0, dtype=np.int64)
        )
        for i in ties:  # rare: exact 128-bit comparison
            u = (int(hi[i]) << 64) | int(lo[i])
            out[i] = 1 + sum(1 for t in self._t if t <= u)
        return out

    # -- geometric skips ----------------------------------------------------------------
    def _gap_exact(self, a: int, source) -> int:
        """The gap for U in [a/2**64, (a+1)/2**64), refined with further bits until decided."""
        bits = 64
        lo_num, width = a, 1
        for _ in range(8):
            with localcontext() as ctx:
                ctx.prec = 120
                lo = Decimal(lo_num) / (Decimal(2) ** bits)
                hi = Decimal(lo_num + width) / (Decimal(2) ** bits)
                g_small_u = None if lo_num == 0 else int(math.floor(lo.ln() / self._ln_p0_dec))
                g_big_u = int(math.floor(hi.ln() / self._ln_p0_dec)) if hi < 1 else 0
            if g_small_u is not None and g_small_u == g_big_u:
                return g_big_u
            extra = int.from_bytes(source.bytes(8), "little")
            lo_num, bits = (lo_num << 64) | extra, bits + 64
        return g_big_u  # undecided after 576 bits: probability below 2**-500

    def _gaps(self, count: int, source) -> np.ndarray:
        a = _words(source, count)
        u = (a.astype(np.float64) + 0.5) * 2.0**-64
        x = np.log(u) / self._ln_p0  # >= 0, decreasing in U
        # half-width of the interval U can be in, plus float error (a few ulps, relative)
        width = (2.0**-64 / np.maximum(u, 2.0**-64)) / abs(self._ln_p0)
        guard = width + 1e-9 * (1.0 + x)
        g = np.floor(x)
        sure = (np.floor(x - guard) == g) & (np.floor(x + guard) == g) & (a >= np.uint64(1 << 32))
        out = g.astype(np.float64)
        for i in np.nonzero(~sure)[0]:
            out[i] = self._gap_exact(int(a[i]), source)
        return out

    def sparse(self, buckets: int, source) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, values)`` of the non-zero draws among ``buckets`` independent ones."""
        positions = []
        start = 0
        expect = buckets * self.nonzero
        while start < buckets:
            batch = int(expect + 6.0 * math.sqrt(expect) + 8)
            steps = self._gaps(batch, source) + 1.0
            pos = start - 1 + np.cumsum(steps)
            inside = pos[pos < buckets]
            positions.append(inside.astype(np.int64))
            if len(inside) < batch:
                break
            start = int(inside[-1]) + 1
        pos = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        return pos, self._values(len(pos), source)


# --------------------------------------------------------------------------------------------
# the exact privacy profile of the correlated-noise view


def _nb_logpmf(f: np.ndarray, r: float, q: float) -> np.ndarray:
    return gammaln(f + r) - gammaln(r) - gammaln(f + 1) + r * math.log1p(-q) + f * math.log(q)


def gkmp_delta(epsilon: float, p: float, r: float, q: float) -> float:
    """delta(eps) of the shuffled view of the correlated-noise protocol, replace-one neighbours.

    Per bucket the view is ``(h + G1 + F, G2 + F)`` with ``G1, G2 ~ Geometric(p)`` and
    ``F ~ NB(r, q)`` (all buckets independent). Replacing one event moves one unit from a bucket
    x to a bucket y. With ``t(f) = P[F = f] p**(-2 f)`` and ``R(m) = t(m) / sum_{f<m} t(f)``, the
    privacy loss of the view is exactly

        L = ln(1 + R_y) - ln(1 + R_x),

    where ``R_y = R(G1 + F)`` if ``G2 >= G1`` else 0 (bucket y) and ``R_x = R(1 + G1' + F')`` if
    ``G2' >= G1' + 1`` else 0 (bucket x), all independent (derivation in docs/shuffle.md). This
    returns ``E[(1 - exp(eps - L))_+]`` (the tight delta; the reverse direction is the same by
    symmetry), plus the probability mass beyond the truncation point.

    >>> gkmp_delta(1.0, math.exp(-0.45), 18.0, 0.95) < 1e-6
    True
    """
    if not (0 < p < 1 and 0 < q < 1 and r > 0):
        raise ValueError("gkmp_delta needs 0 < p < 1, 0 < q < 1, r > 0")
    mean = r * q / (1 - q)
    sd = math.sqrt(r * q) / (1 - q)
    m_max = int(mean + 40 * sd + 400 + 80 / -math.log(p))
    f = np.arange(m_max + 1, dtype=np.float64)
    log_pf = _nb_logpmf(f, r, q)
    log_t = log_pf - 2 * f * math.log(p)
    cum = np.logaddexp.accumulate(log_t)
    log_r = np.full(m_max + 1, 800.0)  # R(0) = inf: no f < 0
    log_r[1:] = np.minimum(log_t[1:] - cum[:-1], 800.0)
    a = np.logaddexp(0.0, log_r)  # ln(1 + R(m))
    pf = np.exp(log_pf)

    def geo(ratio, x):  # sum_g ratio**g x[m - g]
        return lfilter([1.0], [1.0, -ratio], x)

    y_act = (1 - p) * geo(p * p, pf)  # P[G1 + F = m, G2 >= G1]
    y_off = (1 - p) * geo(p, pf) - y_act
    x_act = np.zeros_like(pf)
    x_off = np.zeros_like(pf)
    xa = (1 - p) * p * geo(p * p, pf)  # P[G1 + F = m - 1, G2 >= G1 + 1]
    x_act[1:] = xa[:-1]
    x_off[1:] = ((1 - p) * geo(p, pf) - xa)[:-1]
    y_vals = np.append(a, 0.0)
    y_prob = np.append(y_act, y_off.sum())
    x_vals = np.append(a, 0.0)
    x_prob = np.append(x_act, x_off.sum())
    missing = max(0.0, 1.0 - y_prob.sum()) + max(0.0, 1.0 - x_prob.sum())
    return float(_delta_of_difference(epsilon, y_vals, y_prob, x_vals, x_prob) + missing)


def _delta_of_difference(eps, a_vals, a_prob, b_vals, b_prob) -> float:
    """E[(1 - exp(eps - (A - B)))_+] for independent discrete A, B >= 0 (infinities allowed).

    Where ``A > 60`` the integrand is counted as 1 (an upper bound, and such outcomes are the
    ones delta is made of); elsewhere only ``B < A - eps < 60`` contributes, so the cumulative
    sums of ``exp(B - 60)`` stay in range and lose no precision.
    """
    cap = 60.0
    big = ~(a_vals <= cap)
    out = float(a_prob[big].sum())
    a_vals, a_prob = a_vals[~big], a_prob[~big]
    order = np.argsort(b_vals)
    bv, bp = b_vals[order], b_prob[order]
    c_prob = np.concatenate([[0.0], np.cumsum(bp)])
    c_exp = np.concatenate([[0.0], np.cumsum(bp * np.exp(np.minimum(bv, cap) - cap))])
    k = np.searchsorted(bv, a_vals - eps, side="left")  # B < A - eps
    d = a_prob * (c_prob[k] - np.exp(eps - a_vals + cap) * c_exp[k])
    return out + float(np.sum(np.clip(d, 0.0, None)))


# candidate flooding parameters: dyadic q (exact in binary), r on a 1/256 grid
_FLOOD_Q = (0.5, 0.625, 0.75, 0.8125, 0.875, 0.90625, 0.9375, 0.953125, 0.96875, 0.984375)


@lru_cache(maxsize=128)
def _calibrate_flooding(epsilon: float, delta: float, p: float) -> tuple[Fraction, float, float]:
    """Cheapest (r, q) (least mean flooding r q / (1 - q)) with gkmp_delta <= delta."""
    best = None
    for q in _FLOOD_Q:
        hi = 1.0
        while gkmp_delta(epsilon, p, hi, q) > delta:
            hi *= 2
            if hi > 1e7:
                break
        if hi > 1e7:
            continue
        lo = hi / 2 if hi > 1 else 0.0
        for _ in range(40):
            mid = (lo + hi) / 2
            if mid > 0 and gkmp_delta(epsilon, p, mid, q) <= delta:
                hi = mid
            else:
                lo = mid
            if hi - lo < 1 / 256:
                break
        r = Fraction(math.ceil(hi * 256), 256)
        cost = float(r) * q / (1 - q)
        if best is None or cost < best[2]:
            best = (r, q, cost)
    if best is None:
        raise ShuffleConfigError(
            f"no flooding meets delta={delta:g} at epsilon={epsilon:g}; use a larger delta or gamma"
        )
    return best[0], best[1], gkmp_delta(epsilon, p, float(best[0]), best[1])


def _check_common(epsilon, delta, n, buckets):
    eps = float(epsilon)
    if not math.isfinite(eps) or eps <= 0:
        raise ShuffleConfigError(f"epsilon must be a positive number, got {epsilon!r}")
    d = float(delta)
    if not (0.0 < d < 1.0):
        raise ShuffleConfigError(f"delta must be in (0, 1), got {delta!r}")
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ShuffleConfigError(f"n (events per window) must be a positive integer, got {n!r}")
    if isinstance(buckets, bool) or int(buckets) != buckets or buckets < 1:
        raise ShuffleConfigError(f"buckets must be a positive integer, got {buckets!r}")
    return eps, d, int(n), int(buckets)


class GKMPRandomizer:
    """The client side of the correlated-noise shuffle protocol (module docstring).

    Parameters
    ----------
    epsilon, delta : the (eps, delta)-DP guarantee of the shuffled view of one window, for two
        windows of ``n`` events differing in one event (replace-one).
    n : events per window. Exactly ``n`` randomizer outputs must reach the shuffler per window for
        the noise to be ``DLap(p)``; a shuffler short of events adds :meth:`noise_only` outputs.
    buckets : ``B``, the number of counters (the domain size, or hash buckets).
    gamma : the share of ``epsilon`` spent on flooding (the DLap part uses ``(1 - gamma) eps``).
    max_messages : refuse a configuration whose expected messages per event exceed this.
    rng : anything with ``bytes(k)``; the OS CSPRNG by default.

    Attributes
    ----------
    p : the DLap parameter of the analyzer's noise, ``exp(-(1 - gamma) eps / 2)`` rounded up.
    r, q : the flooding law, ``NB(r/n, q)`` pairs per bucket per event.
    delta_spent : the exact delta of the view at ``epsilon`` (``<= delta``), sampling included.
    expected_messages : expected messages per event.
    """

    def __init__(
        self,
        epsilon: float,
        delta: float,
        n: int,
        buckets: int,
        gamma: float = 0.1,
        max_messages: float = DEFAULT_MAX_MESSAGES,
        rng=None,
    ):
        self.epsilon, self.delta, self.n, self.buckets = _check_common(epsilon, delta, n, buckets)
        if not (0.0 < float(gamma) < 1.0):
            raise ShuffleConfigError(f"gamma must be in (0, 1), got {gamma!r}")
        self.gamma = float(gamma)
        self.p = p_from_epsilon((1.0 - self.gamma) * self.epsilon, 2)
        r, q, d = _calibrate_flooding(self.epsilon, self.delta * 0.999, self.p)
        self.r, self.q = r, q
        self._shares = _NegBinomial(Fraction(1, self.n), self.p)
        self._flood = _NegBinomial(r / self.n, q)
        per_bucket = 2 * (self.p / (1 - self.p) + float(r) * q / (1 - q)) / self.n
        self.expected_messages = 1.0 + self.buckets * per_bucket
        # upper bound on table draws: the sum of nonzeros is < 3 B per event in expectation;
        # bound stated per bucket
        draws = self.n * 3 * (self.buckets + 1)
        self.sampling_tv = draws * SAMPLING_TV_PER_DRAW
        self.delta_spent = d + self.sampling_tv
        # variance of one event's message count: B independent buckets, each 2 NB(1/n, p)
        # shares and 2 copies of one NB(r/n, q) flooding count (NB(k, q) variance k q / (1-q)^2)
        self.messages_variance = (
            self.buckets
            * (2 * self.p / (1 - self.p) ** 2 + 4 * float(r) * q / (1 - q) ** 2)
            / self.n
        )
        self.max_buckets = int((max_messages - 1) / per_bucket)
        if self.expected_messages > max_messages:
            raise ShuffleConfigError(
                f"{self.expected_messages:,.0f} messages per event expected at "
                f"buckets={self.buckets:,}, "
                f"n={self.n:,}, epsilon={self.epsilon:g}, delta={self.delta:g}: above max_messages="
                f"{max_messages:,.0f}; use at most {self.max_buckets:,} buckets, a longer window "
                "(larger n) or a larger gamma"
            )
        self._source = rng if rng is not None else _SOURCE

    @property
    def params(self) -> dict:
        """What the analyzer must share with this randomizer (the messages' fingerprint,
        aggregator/service/shuffle_wire.py): protocol, epsilon, delta, n, buckets, gamma."""
        return {
            "protocol": "gkmp",
            "epsilon": self.epsilon,
            "delta": self.delta,
            "n": self.n,
            "buckets": self.buckets,
            "gamma": self.gamma,
        }

    def __repr__(self) -> str:
        return (
            f"GKMPRandomizer(epsilon={self.epsilon:g}, delta={self.delta:g}, n={self.n}, "
            f"buckets={self.buckets}, gamma={self.gamma:g})"
        )

    def _noise(self, events: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Noise rows of ``events`` clients at once, and which client each row belongs to.

        The draws of all clients are one run of independent draws over ``events * B`` slots
        (slot = client * B + bucket), the same law as ``events`` separate calls.
        """
        slots = events * self.buckets
        owners, parts = [], []
        for sampler, signs in ((self._shares, (1,)), (self._shares, (-1,)), (self._flood, (1, -1))):
            pos, val = sampler.sparse(slots, self._source)
            cells = np.repeat(pos, val)
            for sign in signs:
                parts.append(_rows(cells % self.buckets, sign))
                owners.append(cells // self.buckets)
        return np.concatenate(owners), parts

    def encode_many(self, buckets) -> tuple[np.ndarray, np.ndarray]:
        """The messages of many events at once: ``(rows, owner)``, owner = index into ``buckets``.

        ``encode(b)`` is ``encode_many([b])[0]``; a load generator playing many clients calls
        this once per batch.
        """
        b = np.asarray(buckets, dtype=np.int64).reshape(-1)
        if len(b) and (b.min() < 0 or b.max() >= self.buckets):
            raise ValueError(f"a bucket is outside [0, {self.buckets})")
        owner, parts = self._noise(len(b))
        rows = np.concatenate([_rows(b, 1)] + parts)
        return rows, np.concatenate([np.arange(len(b), dtype=np.int64), owner])

    def encode(self, bucket: int) -> np.ndarray:
        """The plaintext messages of one event in ``bucket``: int64 rows ``(bucket, sign)``.

        Rows come in no meaningful order; the shuffler permutes them with every other event's.
        """
        b = int(bucket)
        if not (0 <= b < self.buckets):
            raise ValueError(f"bucket {bucket!r} outside [0, {self.buckets})")
        return self.encode_many([b])[0]

    def noise_only(self) -> np.ndarray:
        """The messages of an absent event: its noise shares and flooding, no ``(x, +1)``.

        A shuffler that closes a window with fewer than ``n`` events adds one such output per
        missing event, so the noise stays exactly DLap(p) (docs/shuffle.md, "Short windows").
        """
        return np.concatenate(self._noise(1)[1])


def _rows(buckets: np.ndarray, sign: int) -> np.ndarray:
    out = np.empty((len(buckets), 2), dtype=np.int64)
    out[:, 0] = buckets
    out[:, 1] = sign
    return out


def _as_rows(messages, buckets: int) -> np.ndarray:
    m = np.asarray(messages, dtype=np.int64)
    if m.size == 0:
        return m.reshape(0, 2)
    if m.ndim != 2 or m.shape[1] != 2:
        raise ValueError(
            f"messages must be an (m, 2) array of (bucket, sign) rows, got shape {m.shape}"
        )
    if m[:, 0].min() < 0 or m[:, 0].max() >= buckets:
        raise ValueError(f"a message names a bucket outside [0, {buckets})")
    return m


def gkmp_analyze(messages, buckets: int) -> np.ndarray:
    """Counts per bucket: ``#(j, +1) - #(j, -1)``, i.e. ``h_j + DLap(p)`` (int64, length B)."""
    m = _as_rows(messages, int(buckets))
    if len(m) and not np.all(np.abs(m[:, 1]) == 1):
        raise ValueError("a message's sign is not +1 or -1")
    plus = np.bincount(m[m[:, 1] > 0, 0], minlength=buckets)
    minus = np.bincount(m[m[:, 1] < 0, 0], minlength=buckets)
    return (plus - minus).astype(np.int64)


# --------------------------------------------------------------------------------------------
# Balcer-Cheu


def balcer_cheu_delta(epsilon: float, n: int, s: float) -> float:
    """Exact delta(eps) of the Balcer-Cheu view (per-bucket counts ``h_j + Bin(n, s)``).

    Replace-one moves a unit from bucket x to y; with ``X ~ Bin(n, s)`` the loss is
    ``ln[P(X_y)/P(X_y - 1)] + ln[P(X_x)/P(X_x + 1)]`` (infinite where the other world cannot
    produce the view); this returns ``E[(1 - exp(eps - L))_+]`` under the first world.
    """
    from scipy.stats import binom  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    k = np.arange(n + 1)
    pm = binom.pmf(k, n, s)
    with np.errstate(divide="ignore"):
        up = np.where(k > 0, np.log((n - k + 1) * s) - np.log(np.maximum(k, 1) * (1 - s)), np.inf)
        down = np.where(k < n, np.log((k + 1) * (1 - s)) - np.log(np.maximum(n - k, 1) * s), np.inf)
    inf_mass = pm[~np.isfinite(up)].sum() + pm[~np.isfinite(down)].sum()
    fin_up, fin_dn = np.isfinite(up), np.isfinite(down)
    # L = up_y + down_x = up_y - (-down_x): A = up, B = -down
    return (
        _delta_of_difference(epsilon, up[fin_up], pm[fin_up], -down[fin_dn], pm[fin_dn]) + inf_mass
    )


class BalcerCheuRandomizer:
    """The client side of Balcer-Cheu's P^hist (seed 002, Fig. 2) for an (eps, delta) target.

    Thm 3.2 gives (2 eps', 2 delta') for the per-coordinate parameters, so eps' = eps / 2 and
    delta' = delta / 2; it needs eps' <= 1 and n >= 100 ln(2/delta') / eps'^2.

    Attributes
    ----------
    s : the Bernoulli rate of the blanket messages, ``1 - 50 ln(2/delta') / (eps'^2 n)`` rounded
        down to 64 bits (more blanket noise, never less).
    delta_spent : exact delta of the view at ``epsilon`` (:func:`balcer_cheu_delta`).
    expected_messages : ``1 + B s`` per event.
    """

    def __init__(
        self,
        epsilon: float,
        delta: float,
        n: int,
        buckets: int,
        max_messages: float = 10 * DEFAULT_MAX_MESSAGES,
        rng=None,
    ):
        self.epsilon, self.delta, self.n, self.buckets = _check_common(epsilon, delta, n, buckets)
        eps1, delta1 = self.epsilon / 2, self.delta / 2
        if eps1 > 1:
            raise ShuffleConfigError(
                f"Balcer-Cheu covers epsilon <= 2 (eps' = eps/2 <= 1), got {epsilon:g}"
            )
        need = 100 * math.log(2 / delta1) / eps1**2
        if self.n < need:
            raise ShuffleConfigError(
                "Balcer-Cheu needs n >= 100 ln(2/delta') / eps'^2 = "
                f"{math.ceil(need):,} events per window at "
                f"epsilon={epsilon:g}, delta={delta:g}; got n={n:,}"
            )
        blanket = 1 - 50 * math.log(2 / delta1) / (eps1**2 * self.n)
        self._threshold = int(math.floor(blanket * 2**64))  # Ber(s) with s = threshold / 2^64
        self.s = self._threshold / 2**64
        self.expected_messages = 1 + self.buckets * self.s
        self.messages_variance = self.buckets * self.s * (1 - self.s)
        if self.expected_messages > max_messages:
            raise ShuffleConfigError(
                f"{self.expected_messages:,.0f} messages per event expected "
                "(about one per bucket): above "
                f"max_messages={max_messages:,.0f}; use fewer buckets"
            )
        self.delta_spent = (
            balcer_cheu_delta(self.epsilon, self.n, self.s) if self.n <= 5_000_000 else None
        )
        self._source = rng if rng is not None else _SOURCE

    @property
    def params(self) -> dict:
        """Protocol, epsilon, delta, n, buckets (no gamma): see GKMPRandomizer.params."""
        return {
            "protocol": "balcer-cheu",
            "epsilon": self.epsilon,
            "delta": self.delta,
            "n": self.n,
            "buckets": self.buckets,
            "gamma": None,
        }

    def __repr__(self) -> str:
        return (
            f"BalcerCheuRandomizer(epsilon={self.epsilon:g}, delta={self.delta:g}, n={self.n}, "
            f"buckets={self.buckets})"
        )

    def _blanket(self) -> np.ndarray:
        w = _words(self._source, self.buckets)
        return np.nonzero(w < np.uint64(self._threshold))[0].astype(np.int64)

    def encode(self, bucket: int) -> np.ndarray:
        """One event's messages: ``(bucket, +1)`` plus ``(j, +1)`` for each blanket bucket j."""
        b = int(bucket)
        if not (0 <= b < self.buckets):
            raise ValueError(f"bucket {bucket!r} outside [0, {self.buckets})")
        return _rows(np.concatenate([np.array([b], dtype=np.int64), self._blanket()]), 1)

    def noise_only(self) -> np.ndarray:
        """An absent event's blanket messages (keeps the noise Bin(n, s) in a short window)."""
        return _rows(self._blanket(), 1)


def balcer_cheu_analyze(
    messages, buckets: int, randomizer=None, *, n: int | None = None, s: float | None = None
) -> np.ndarray:
    """Seed 002's analyzer: ``N_j - s n`` where ``N_j > n``, else 0 (float64, length B).

    ``n`` and ``s`` come from ``randomizer`` (a :class:`BalcerCheuRandomizer`) or are given.
    """
    if randomizer is not None:
        n, s = randomizer.n, randomizer.s
    if n is None or s is None:
        raise ValueError("balcer_cheu_analyze needs the randomizer, or n and s")
    m = _as_rows(messages, int(buckets))
    counts = np.bincount(m[:, 0], minlength=buckets).astype(np.float64)
    return np.where(counts > n, counts - s * n, 0.0)
