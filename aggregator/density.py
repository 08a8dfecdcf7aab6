"""Distinct users with user-level pan-privacy: a hashed universe of bits (density estimation).

Every other state of panagg is a vector of counters, one +1 per event: a user with g events
moves a counter by g, so it is protected at g x eps (event-level). This module keeps, for each
cell of a hashed universe, ONE BIT whose law depends only on whether some user of the cell has
appeared, never on how often. A user who logs in once and one who logs in 10,000 times leave
the same distribution in the state: that is user-level privacy (Dwork, Naor, Pitassi, Rothblum,
Yekhanin 2010, "density estimation").

The mechanism
-------------
* Users are hashed into m cells with the project's keyed SipHash-2-4
  (:func:`aggregator.hashing.bucket_of`; the key fixes the map and is not secret for privacy).
* Every cell starts as a bit b ~ D0 = Bernoulli(a).
* On each arrival of a user, the bit of its cell is REDRAWN from D1 = Bernoulli(b), b > a,
  independently of its old value. After one arrival or many, the bit is a fresh D1 draw: the
  redraw forgets, so repetition changes nothing.
* The release is Y = (number of 1-bits) + Z, Z ~ DLap(p_r) (exact, :mod:`aggregator.noise`).

If k of the m cells were visited, E[Y | k] = m a + k (b - a), so

    k_hat = (Y - m a) / (b - a)          (unbiased for k),
    theta_hat = k_hat / m                (the hashed universe's density),

and with b - a = eps / 4, a = 1/2 this is DNPRY's theta_hat = 4 (frac - 1/2) / eps. U distinct
users hashed uniformly occupy k cells with E[k] = m (1 - (1 - 1/m)^U); inverting,

    U_hat = ln(1 - k_hat / m) / ln(1 - 1/m).

Privacy (per cell; the cells are independent, and a user touches one cell)
-----------------------------------------------------------------------
A user's presence turns its cell's law from D0 into D1; the log-ratio of any one look at the
bit is at most eps_cell = max(ln(b / a), ln((1 - a) / (1 - b))). With one intrusion at time t
and the release at T, the joint view adds the release's look at the final bit: the count has
sensitivity 1 (one cell), so DLap(exp(-eps_r)) bounds it by eps_r, and the joint loss is at most
eps_cell + eps_r (basic composition; ``tests/test_density.py`` computes it exactly).

* ``calibration="dnpry"``: DNPRY'10's D0 = Bernoulli(1/2), D1 = Bernoulli(1/2 + e/4) with
  output noise at e, claimed as 2e in total (their theorem: the density estimator is 2e
  user-level pan-private). Exactly, the state spends only -ln(1 - e/2) ~ e/2 of its e.
* ``calibration="full"`` (default): the state's share is spent exactly, as randomized response
  does, a = 1 / (1 + e^eps_s), b = e^eps_s / (1 + e^eps_s), so ln(b/a) = ln((1-a)/(1-b)) =
  eps_s. This is the "use the whole budget" improvement of Digalakis, Karystinos, Garofalakis
  (2021); per unit of epsilon it has the largest signal b - a = tanh(eps_s / 2) (DNPRY's is
  eps_s / 8 once its 2e is counted as eps). The split eps = eps_s + eps_r is chosen by
  :func:`best_state_share` to minimise the variance for the m at hand (most of it goes to the
  state: the release's noise is one DLap on one count, the state's is m Bernoulli bits).

Neighbours are user-level: ``"replace-one"`` (the default, as for the event-level state: every
event of one user given to another user, at the same times, so the number of events is the same
for neighbours; two cells change, each bit gets eps_s / 2 and the release sensitivity 2) or
``"add-remove"`` (DNPRY's: every event of one user added or removed; one cell, sensitivity 1;
about half the error, but the event count then moves by the user's g, so it holds only where
nothing reveals the count, and a stream's offsets do). The state holds NO event count.

What this state does not do
---------------------------
* Only ONE intrusion is covered (DNPRY's model). Two looks at the bits, before and after a user
  arrives, see the bit redrawn (with probability a(1-b) + b(1-a) it changes; without the user
  it never does): unbounded loss. Pan-privacy against many intrusions is local privacy (Amin,
  Joseph, Mao 2020). So no announced export re-randomization, no snapshot of the open state.
* Not mergeable: a day's distinct users is not a sum of minutes' (a user is in many), and two
  cells' bits do not combine into the bit of the union. A day's figure comes from one day-long
  state. States over DISJOINT users (partitions keyed by user) add: sum their U_hat and
  variances.
* One release per state: a second would be a second eps_r look (:meth:`release` refuses).

Error bars: :func:`distinct_variance` (Bernoulli bits + output noise + hashing, through the
inversion by the delta method), :func:`expected_relative_error`, :meth:`DensityRelease.interval`.
Planning: :func:`plan_cells` (the m for expected users, eps and a target relative error; the
error cannot go below a floor reached near m = 2U).

>>> s = PanPrivateDensity(epsilon=1.0, cells=4000)
>>> s.update(["alice", "bob", "alice"] + [f"user{i}" for i in range(1997)])
>>> r = s.release()
>>> r.cells, round(s.epsilon_state + s.epsilon_release, 12)
(4000, 1.0)
>>> 1000 < r.distinct < 3000                 # 1,999 distinct users; stated error ~14 %
True
>>> lo, hi = r.interval(0.9)
>>> lo < r.distinct < hi
True

References
----------
Dwork, Naor, Pitassi, Rothblum, Yekhanin. Pan-Private Streaming Algorithms. ICS 2010 (density).
Digalakis, Karystinos, Garofalakis. Improved Pan-Private Stream Density Estimation. 2021
(arXiv 2111.08784).
Amin, Joseph, Mao. Pan-Private Uniformity Testing. COLT 2020 (many intrusions = local privacy).
docs/privacy.md section 23 (the user-level guarantee and what it does not give).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from statistics import NormalDist

import numpy as np

from .hashing import KEY_BYTES, bucket_of
from .noise import WORD, bernoulli, discrete_laplace, p_from_epsilon

__all__ = [
    "NEIGHBOR_RELATIONS",
    "CALIBRATIONS",
    "PanPrivateDensity",
    "DensityRelease",
    "DensityPlan",
    "bit_thresholds",
    "best_state_share",
    "expected_occupied",
    "occupied_variance",
    "invert_occupied",
    "distinct_variance",
    "expected_relative_error",
    "plan_cells",
]

#: user-level neighbour relation -> number of cells one neighbour step changes
NEIGHBOR_RELATIONS = {"add-remove": 1, "replace-one": 2}
CALIBRATIONS = ("full", "dnpry")
_SHARES = np.linspace(0.5, 0.995, 100)  # the state shares best_state_share tries


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------
def _check_epsilon(epsilon) -> float:
    eps = float(epsilon)
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}")
    return eps


def _check_cells(cells) -> int:
    if isinstance(cells, bool) or not isinstance(cells, (int, np.integer)) or cells < 2:
        raise ValueError(f"cells must be an integer >= 2, got {cells!r}")
    return int(cells)


def _check_neighbor(neighbor: str) -> int:
    if neighbor not in NEIGHBOR_RELATIONS:
        raise ValueError(f"neighbor must be one of {sorted(NEIGHBOR_RELATIONS)}, got {neighbor!r}")
    return NEIGHBOR_RELATIONS[neighbor]


def bit_thresholds(epsilon_cell: float, calibration: str = "full") -> tuple[int, int]:
    """(A, B): D0 = Bernoulli(A / 2**64), D1 = Bernoulli(B / 2**64) for one cell's budget.

    ``"full"``: A = ceil(2**64 / (1 + e^eps)) and B = 2**64 - A, so b / a = (1 - a) / (1 - b)
    = (2**64 - A) / A <= e^eps (rounding A up can only lose signal, never privacy).
    ``"dnpry"``: A = 2**63 (a = 1/2) and B = floor(2**64 (1/2 + eps / 4)) (eps <= 2), DNPRY'10's
    distributions for their parameter eps.

    >>> A, B = bit_thresholds(1.0)
    >>> round(A / 2**64, 4), round(B / 2**64, 4), A + B == 2**64
    (0.2689, 0.7311, True)
    >>> bit_thresholds(1.0, "dnpry") == (2**63, 3 * 2**62)
    True
    """
    eps = _check_epsilon(epsilon_cell)
    with localcontext() as ctx:
        ctx.prec = 50
        if calibration == "full":
            ctx.rounding = ROUND_CEILING
            A = int((Decimal(WORD) / (1 + Decimal(eps).exp())).to_integral_value())
            return A, WORD - A
        if calibration == "dnpry":
            if eps > 2:
                raise ValueError("calibration 'dnpry' needs epsilon <= 2 (b = 1/2 + eps/4 <= 1)")
            ctx.rounding = ROUND_FLOOR
            B = int((Decimal(WORD) * (Decimal(1) / 2 + Decimal(eps) / 4)).to_integral_value())
            return WORD // 2, min(B, WORD)
    raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")


def _split(epsilon: float, share: float, calibration: str) -> tuple[float, float]:
    """(eps_state, eps_release) of a total; ``"dnpry"`` is always half and half (its 2e)."""
    if calibration == "dnpry":
        return epsilon / 2, epsilon / 2
    if not 0.0 < share < 1.0:
        raise ValueError(f"state_share must be in (0, 1), got {share!r}")
    return epsilon * share, epsilon * (1.0 - share)


def _dlap_variance(p: float) -> float:
    return 2.0 * p / (1.0 - p) ** 2


def _mechanism(epsilon, cells, neighbor, calibration, share):
    """(a, b, p_release, eps_state, eps_release) of a configuration."""
    sens = _check_neighbor(neighbor)
    eps_s, eps_r = _split(epsilon, share, calibration)
    A, B = bit_thresholds(eps_s / sens, calibration)
    return A / WORD, B / WORD, p_from_epsilon(eps_r, sens), eps_s, eps_r


def best_state_share(
    epsilon: float, cells: int, *, users: float | None = None, neighbor: str = "replace-one"
) -> float:
    """The share of epsilon for the state (the rest goes to the release) that minimises the
    variance of U_hat at ``users`` (default cells / 2), for ``calibration="full"``.

    >>> 0.85 < best_state_share(1.0, 20_000) < 1.0
    True
    """
    eps, m = _check_epsilon(epsilon), _check_cells(cells)
    sens = _check_neighbor(neighbor)
    U = m / 2 if users is None else float(users)
    # the variance of k_hat over the shares tried, in floats (the exact thresholds differ by
    # 2**-64): the hash term and the inversion's slope do not depend on the share
    k = expected_occupied(U, m)
    a = 1.0 / (1.0 + np.exp(_SHARES * eps / sens))
    p = np.exp(-(1.0 - _SHARES) * eps / sens)
    var = ((m - k) * a * (1 - a) + k * a * (1 - a) + 2 * p / (1 - p) ** 2) / (1 - 2 * a) ** 2
    return float(_SHARES[int(np.argmin(var))])


# --------------------------------------------------------------------------------------------
# occupancy: U users hashed uniformly into m cells
# --------------------------------------------------------------------------------------------
def expected_occupied(users: float, cells: int) -> float:
    """E[k] = m (1 - (1 - 1/m)^U): the expected number of occupied cells."""
    m = _check_cells(cells)
    return m * -math.expm1(users * math.log1p(-1.0 / m))


def occupied_variance(users: float, cells: int) -> float:
    """Var[k] over the hash (balls in bins): m(m-1)(1-2/m)^U + m(1-1/m)^U - m^2 (1-1/m)^2U."""
    m = _check_cells(cells)
    q1 = math.exp(users * math.log1p(-1.0 / m))
    q2 = math.exp(users * math.log1p(-2.0 / m))
    return max(m * (m - 1) * q2 + m * q1 - m * m * q1 * q1, 0.0)


def invert_occupied(k: float, cells: int) -> float:
    """U with E[k] = k: ln(1 - k/m) / ln(1 - 1/m) (k clipped to [0, m - 1/2])."""
    m = _check_cells(cells)
    k = min(max(float(k), 0.0), m - 0.5)
    return math.log1p(-k / m) / math.log1p(-1.0 / m)


# --------------------------------------------------------------------------------------------
# error bars and the plan
# --------------------------------------------------------------------------------------------
def _k_hat_variance(k: float, m: int, a: float, b: float, noise_var: float) -> float:
    """Var[k_hat | k]: the bits (m - k of D0, k of D1) plus the release noise, over (b-a)^2."""
    return ((m - k) * a * (1 - a) + k * b * (1 - b) + noise_var) / (b - a) ** 2


def distinct_variance(
    users: float,
    cells: int,
    epsilon: float,
    *,
    neighbor: str = "replace-one",
    calibration: str = "full",
    state_share: float | None = None,
) -> float:
    """Var[U_hat] at U = ``users``: (Var[k_hat | k] + Var_hash[k]) * (dU/dk)^2 (delta method).

    dU/dk = -1 / ((m - k) ln(1 - 1/m)) ~ 1 / (1 - k/m): the inversion magnifies the error as
    the cells fill up.
    """
    m, eps = _check_cells(cells), _check_epsilon(epsilon)
    if state_share is None:
        state_share = (
            best_state_share(eps, m, users=users, neighbor=neighbor)
            if calibration == "full"
            else 0.5
        )
    a, b, p, _, _ = _mechanism(eps, m, neighbor, calibration, state_share)
    k = expected_occupied(users, m)
    var_k = _k_hat_variance(k, m, a, b, _dlap_variance(p)) + occupied_variance(users, m)
    slope = -1.0 / ((m - k) * math.log1p(-1.0 / m))
    return var_k * slope * slope


def expected_relative_error(users: float, cells: int, epsilon: float, **kw) -> float:
    """sd[U_hat] / U at U = ``users`` (the keywords of :func:`distinct_variance`).

    >>> round(expected_relative_error(10_000, 20_000, 1.0), 3)
    0.056
    >>> round(expected_relative_error(10_000, 20_000, 1.0, neighbor="add-remove"), 3)
    0.026
    """
    if users <= 0:
        raise ValueError("users must be positive for a relative error")
    return math.sqrt(distinct_variance(users, cells, epsilon, **kw)) / users


@dataclass(frozen=True)
class DensityPlan:
    """The cells to use for ``users`` expected users, and what they achieve.

    ``cells`` minimises the relative error at ``users`` (about 2.3 U); it stays within about
    1.0-1.3x of that error from U to 4U actual users and grows fast past ~5U (the cells fill
    up: the error grows like e^(U/m)), slowly below U (like sqrt(m/U)). ``cells_range`` is every
    m that meets the target at ``users``: its top end leaves room for many more users than
    expected, at a larger error at ``users``.
    """

    users: float
    epsilon: float
    target: float
    cells: int
    relative_error: float
    state_share: float
    cells_range: tuple[int, int]


def plan_cells(
    users: float, epsilon: float, target_relative_error: float, *, neighbor: str = "replace-one"
) -> DensityPlan:
    """The m for ``users`` expected distinct users at ``epsilon`` and a target relative error.

    The relative error at U = x m is ~ e^x / (2 (b - a) sqrt(x U)): minimal near m = 2U and
    ~1.17 / ((b - a) sqrt(U)) there, so a target below that floor is refused (with the floor
    and the users it would need). The error of any other m: :func:`expected_relative_error`.

    >>> pl = plan_cells(10_000, 1.0, 0.1)
    >>> lo, hi = pl.cells_range
    >>> pl.relative_error < 0.1 and lo < 20_000 < 22_000 < pl.cells < 25_000 < hi
    True
    """
    eps = _check_epsilon(epsilon)
    if users < 1:
        raise ValueError("users must be >= 1")
    if not 0 < target_relative_error:
        raise ValueError("target_relative_error must be positive")

    def err(m: int) -> float:
        return expected_relative_error(users, m, eps, neighbor=neighbor)

    grid = np.unique(np.geomspace(max(2, users / 8), users * 400, 160).astype(np.int64))
    errs = np.array([err(int(m)) for m in grid])
    i = int(np.argmin(errs))
    # refine the minimum between the grid's neighbours (the error is unimodal in m)
    lo, hi = int(grid[max(i - 1, 0)]), int(grid[min(i + 1, len(grid) - 1)])
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        lo, hi = (lo, m2) if err(m1) <= err(m2) else (m1, hi)
    best = min(range(lo, hi + 1), key=err)
    floor = err(best)
    if floor > target_relative_error:
        need = users * (floor / target_relative_error) ** 2
        raise ValueError(
            f"a relative error of {target_relative_error:g} is out of reach for "
            f"{users:g} users at epsilon {eps:g}: the best is {floor:.3g} (at "
            f"{best} cells); it needs about {need:.3g} users"
        )

    def edge(inside: int, outside: int) -> int:
        """The last m meeting the target between ``inside`` (meets it) and ``outside``."""
        while abs(outside - inside) > max(1, min(inside, outside) // 1000):
            mid = (inside + outside) // 2
            inside, outside = (mid, outside) if err(mid) <= target_relative_error else (inside, mid)
        return inside

    ok = np.flatnonzero(errs <= target_relative_error)
    top = edge(int(grid[ok[-1]]), int(grid[min(ok[-1] + 1, len(grid) - 1)]))
    bottom = edge(int(grid[ok[0]]), int(grid[max(ok[0] - 1, 0)])) if ok[0] > 0 else int(grid[0])
    share = best_state_share(eps, best, users=users, neighbor=neighbor)
    return DensityPlan(
        float(users),
        eps,
        float(target_relative_error),
        best,
        floor,
        share,
        (min(bottom, best), max(top, best)),
    )


# --------------------------------------------------------------------------------------------
# the state
# --------------------------------------------------------------------------------------------
class PanPrivateDensity:
    """m cells of one bit each; any single look at them, plus the release, is user-level eps-DP.

    Privacy contract: under :attr:`neighbor` (user-level: all events of one user), one intrusion
    at any time (the bits) together with the release is ``epsilon``-DP, whatever the number of
    events of the user: :attr:`epsilon_state` to the bits (each cell's D0 vs D1 log-ratio is at
    most ``epsilon_state / sensitivity``), :attr:`epsilon_release` to the release's DLap on the
    count of 1-bits (sensitivity 1 or 2). The state holds the bits, the public parameters and
    the hash key; no event count, no user, no RNG state (bits come from the OS CSPRNG). Two
    intrusions are NOT covered, a second release is refused, and states do not merge (module
    docstring).

    Parameters
    ----------
    epsilon
        The total user-level budget of the state and its release.
    cells
        m, the hashed universe (:func:`plan_cells` sizes it from the expected users).
    neighbor
        ``"replace-one"`` (default: one user's events given to another user, so the number of
        events, which a stream's offsets reveal, is the same for neighbours) or
        ``"add-remove"`` (DNPRY's relation; only where nothing reveals the event count).
    calibration
        ``"full"`` (default; randomized-response bits spending the state's share exactly) or
        ``"dnpry"`` (DNPRY'10's Bernoulli(1/2) / Bernoulli(1/2 + e/4), e = epsilon / 2).
    state_share
        Fraction of epsilon for the bits (``"full"`` only); default :func:`best_state_share`.
    key
        16-byte SipHash key; random if omitted. Not secret for privacy.
    rng
        Test-only source with ``bytes(n)``; never stored.
    """

    def __init__(
        self,
        epsilon: float,
        cells: int,
        *,
        neighbor: str = "replace-one",
        calibration: str = "full",
        state_share: float | None = None,
        key: bytes | None = None,
        rng=None,
    ):
        self._epsilon = _check_epsilon(epsilon)
        self._cells = _check_cells(cells)
        self._sensitivity = _check_neighbor(neighbor)
        self._neighbor = neighbor
        if calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")
        if calibration == "dnpry" and state_share is not None:
            raise ValueError("calibration 'dnpry' splits epsilon half and half (its 2e)")
        if state_share is None and calibration == "full":
            state_share = best_state_share(self._epsilon, self._cells, neighbor=neighbor)
        self._calibration = calibration
        self._eps_state, self._eps_release = _split(self._epsilon, state_share or 0.5, calibration)
        self._A, self._B = bit_thresholds(self._eps_state / self._sensitivity, calibration)
        self._p = p_from_epsilon(self._eps_release, self._sensitivity)
        key = os.urandom(KEY_BYTES) if key is None else bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes")
        self._key = key
        self._bits = bernoulli(self._A, self._cells, rng=rng)
        self._released = False

    # -- the privacy contract, explicit -------------------------------------------------------
    @property
    def epsilon(self) -> float:
        """One intrusion plus the release is epsilon-DP, user-level, under :attr:`neighbor`."""
        return self._epsilon

    @property
    def epsilon_state(self) -> float:
        """The bits' share: any single look at them is epsilon_state-DP, user-level."""
        return self._eps_state

    @property
    def epsilon_release(self) -> float:
        """The release's share: the DLap on the count of 1-bits."""
        return self._eps_release

    @property
    def neighbor(self) -> str:
        return self._neighbor

    @property
    def sensitivity(self) -> int:
        """Cells one neighbour step changes (and the count's l1 sensitivity)."""
        return self._sensitivity

    @property
    def calibration(self) -> str:
        return self._calibration

    @property
    def a(self) -> float:
        """P[bit = 1] of a cell no user visited (D0), exactly ``thresholds[0] / 2**64``."""
        return self._A / WORD

    @property
    def b(self) -> float:
        """P[bit = 1] of a visited cell (D1), exactly ``thresholds[1] / 2**64``."""
        return self._B / WORD

    @property
    def thresholds(self) -> tuple[int, int]:
        return self._A, self._B

    @property
    def p(self) -> float:
        """DLap parameter of the release noise."""
        return self._p

    @property
    def cells(self) -> int:
        return self._cells

    @property
    def key(self) -> bytes:
        return self._key

    @property
    def bits(self) -> np.ndarray:
        """A read-only view of the bits (what an intrusion sees)."""
        v = self._bits.view()
        v.flags.writeable = False
        return v

    # -- counting -------------------------------------------------------------------------------
    def cell_of(self, users) -> np.ndarray:
        """The cell of each user (str / bytes / int): SipHash-2-4(key, user) mod m."""
        return bucket_of(users, self._key, self._cells)

    def update(self, users, rng=None) -> None:
        """Redraw the bit of every cell a user of the batch visits from D1.

        A cell visited several times in a batch is redrawn once: after one redraw or many the
        bit is a fresh D1 draw, so the state's law is the same (and a batch costs its distinct
        cells, not its events).
        """
        self.add_cells(self.cell_of(users), rng=rng)

    def add_cells(self, cells, rng=None) -> None:
        idx = np.unique(np.asarray(cells, dtype=np.int64))
        if idx.size == 0:
            return
        if idx[0] < 0 or idx[-1] >= self._cells:
            raise ValueError(f"cell indices must be in [0, {self._cells})")
        if self._released:
            raise RuntimeError("this state was released; count the next window into a new one")
        self._bits[idx] = bernoulli(self._B, idx.size, rng=rng)

    # -- the release ----------------------------------------------------------------------------
    def release(self, rng=None) -> "DensityRelease":
        """The count of 1-bits plus DLap(p): the state's one release (a second is refused)."""
        if self._released:
            raise RuntimeError(
                "a density state is released once: a second release would be a "
                "second epsilon_release look at the same bits"
            )
        self._released = True
        ones = int(np.count_nonzero(self._bits)) + int(discrete_laplace(self._p, 1, rng=rng)[0])
        return DensityRelease(
            self._cells,
            ones,
            self.a,
            self.b,
            _dlap_variance(self._p),
            self._epsilon,
            self._neighbor,
        )

    def __repr__(self) -> str:
        return (
            f"PanPrivateDensity(epsilon={self._epsilon!r}, cells={self._cells}, "
            f"neighbor={self._neighbor!r}, calibration={self._calibration!r}, "
            f"state_share={self._eps_state / self._epsilon:.3f})"
        )


@dataclass(frozen=True)
class DensityRelease:
    """Y = (1-bits) + DLap and the public parameters: everything here is post-processing."""

    cells: int
    noisy_ones: int
    a: float
    b: float
    noise_variance: float
    epsilon: float
    neighbor: str

    @property
    def occupied(self) -> float:
        """k_hat = (Y - m a) / (b - a): unbiased for the number of visited cells."""
        return (self.noisy_ones - self.cells * self.a) / (self.b - self.a)

    @property
    def density(self) -> float:
        """theta_hat = k_hat / m, the visited fraction of the hashed universe."""
        return self.occupied / self.cells

    @property
    def distinct(self) -> float:
        """U_hat: distinct users, the hash collisions undone (:func:`invert_occupied`)."""
        return invert_occupied(self.occupied, self.cells)

    def fraction_of(self, universe: int) -> float:
        """Distinct users as a fraction of a public universe (e.g. registered accounts)."""
        return self.distinct / universe

    def _k_variance(self, k: float) -> float:
        m = self.cells
        k = min(max(k, 0.0), m - 0.5)
        return _k_hat_variance(k, m, self.a, self.b, self.noise_variance) + occupied_variance(
            invert_occupied(k, m), m
        )

    @property
    def standard_error(self) -> float:
        """sd of U_hat by the delta method, at the estimate."""
        m = self.cells
        k = min(max(self.occupied, 0.0), m - 1.0)
        slope = 1.0 / ((m - k) * -math.log1p(-1.0 / m))
        return math.sqrt(self._k_variance(k)) * slope

    def interval(self, level: float = 0.9) -> tuple[float, float]:
        """A ``level`` interval for U: normal on k_hat (variance at the estimate), its ends
        mapped through the monotone inversion (so it is asymmetric as the cells fill up); the
        upper end is inf when it reaches a full universe."""
        if not 0 < level < 1:
            raise ValueError("level must be in (0, 1)")
        z = NormalDist().inv_cdf(0.5 + level / 2)
        m = self.cells
        k = self.occupied
        sd = math.sqrt(self._k_variance(k))
        lo, hi = k - z * sd, k + z * sd
        upper = math.inf if hi >= m - 0.5 else invert_occupied(hi, m)
        return invert_occupied(max(lo, 0.0), m), upper
