"""Synthetic login events: accounts drawn from a Zipf(s) law over a fixed population.

Used by ``panagg demo`` (through the same decode -> count -> checkpoint -> release pipeline as
Kafka) and by the benchmarks. Randomness here makes synthetic *data*, not privacy noise, so a seed
is fine (and it is recorded nowhere in the state).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import numpy as np

from .base import Segment, Source

__all__ = ["ZipfLogins", "GeneratorSource"]


class ZipfLogins:
    """Batches of account ids in [0, accounts), P[id = i] proportional to 1 / (i+1)^s.

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
        Seed of the synthetic-data generator (None: fresh). Batch b is generated from
        (seed, b), so any offset can be regenerated after a restart.

    >>> g = ZipfLogins(events=1000, accounts=50)
    >>> sum(len(b) for b in g.iter_batches())
    1000
    """

    def __init__(
        self,
        events: int,
        accounts: int,
        s: float = 1.1,
        batch: int = 65536,
        seed: int | None = None,
    ):
        if events < 0 or accounts < 1 or batch < 1 or s <= 0:
            raise ValueError("need events >= 0, accounts >= 1, batch >= 1, s > 0")
        self.events, self.accounts, self.s, self.batch = (
            int(events),
            int(accounts),
            float(s),
            int(batch),
        )
        self.seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else int(seed)
        w = 1.0 / np.arange(1, self.accounts + 1, dtype=np.float64) ** self.s
        self._cdf = np.cumsum(w / w.sum())
        self._cdf[-1] = 1.0

    def batch_at(self, b: int) -> np.ndarray:
        """Events [b * batch, min((b+1) * batch, events)) as account ids."""
        k = min(self.batch, self.events - b * self.batch)
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        u = np.random.default_rng([self.seed, b]).random(k)
        return np.searchsorted(self._cdf, u, side="right").astype(np.int64)

    def iter_batches(self, start: int = 0) -> Iterator[np.ndarray]:
        b, skip = divmod(int(start), self.batch)
        while b * self.batch < self.events:
            ids = self.batch_at(b)[skip:]
            skip = 0
            b += 1
            if len(ids):
                yield ids


class GeneratorSource(Source):
    """The generator as an event source: msgpack ``{"item": id}`` messages, optional rate limit."""

    partition = "generator"

    def __init__(self, gen: ZipfLogins, rate: float | None = None):
        self.gen, self.rate = gen, rate
        self._next = 0
        self._it = None
        self._t0 = None

    def seek(self, offsets: dict[str, int]) -> None:
        self._next = int(offsets.get(self.partition, 0))
        self._it = None

    def poll(self, timeout_s: float = 1.0) -> list[Segment]:
        if self._it is None:
            self._it = self.gen.iter_batches(self._next)
            self._t0, self._base = time.monotonic(), self._next
        ids = next(self._it, None)
        if ids is None:
            self.exhausted = True
            return []
        if self.rate:
            due = self._t0 + (self._next + len(ids) - self._base) / self.rate
            time.sleep(max(0.0, due - time.monotonic()))
        pack = msgpack.Packer().pack
        values = [pack({"item": i}) for i in ids.tolist()]
        offsets = list(range(self._next, self._next + len(ids)))
        self._next += len(ids)
        return [Segment(self.partition, offsets, values)]
