"""Synthetic login events: accounts drawn from a Zipf(s) law over a fixed population.

Used by ``panagg demo`` and the benchmarks. Randomness here is synthetic data, not privacy
noise, so a seed is allowed (and recorded nowhere in the state).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["ZipfLogins"]


class ZipfLogins:
    """Yield batches of account ids in [0, accounts), P[id = i] proportional to 1 / (i+1)^s.

    Parameters
    ----------
    events
        Total number of events to produce.
    accounts
        Size of the account population (the direct-mode domain D).
    s
        Zipf exponent (1.1 by default: a heavy head and a long tail, like real logins).
    batch
        Events per batch.
    seed
        Seed of the synthetic-data generator (None: fresh).

    >>> g = ZipfLogins(events=1000, accounts=50, seed=1)
    >>> sum(len(b) for b in g.iter_batches())
    1000
    """

    def __init__(self, events: int, accounts: int, s: float = 1.1, batch: int = 65536,
                 seed: int | None = None):
        if events < 0 or accounts < 1 or batch < 1 or s <= 0:
            raise ValueError("need events >= 0, accounts >= 1, batch >= 1, s > 0")
        self.events, self.accounts, self.s, self.batch = int(events), int(accounts), float(s), int(batch)
        self._rng = np.random.default_rng(seed)
        w = 1.0 / np.arange(1, self.accounts + 1, dtype=np.float64) ** self.s
        self._cdf = np.cumsum(w / w.sum())
        self._cdf[-1] = 1.0

    def iter_batches(self) -> Iterator[np.ndarray]:
        left = self.events
        while left > 0:
            k = min(self.batch, left)
            u = self._rng.random(k)
            yield np.searchsorted(self._cdf, u, side="right").astype(np.int64)
            left -= k
