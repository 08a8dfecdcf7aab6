"""The pan-private state: a vector of counters that starts at discrete Laplace noise.

Privacy contract
----------------
* Neighbor relation: two streams are neighbors if one event is replaced by another
  (``"replace-one"``, the default and the only choice for streams whose length is revealed,
  e.g. by consumer offsets), or if one event is added or removed (``"add-remove"``).
* Sensitivity of the counter vector in l1: 2 for replace-one (one counter -1, another +1), 1 for
  add-remove.
* Noise: every counter starts at an independent DLap(p) draw with p = exp(-epsilon / sensitivity)
  (rounded up, see :func:`aggregator.noise.p_from_epsilon`); each event adds 1 to its counter.
  Any snapshot of the counters is then epsilon-DP with respect to the events seen so far
  (seed 001, section 1.1 footnote 6; Fact 8).
* The number of events ``n`` is the only other data-dependent value. Replace-one neighbors have
  the same n, so a replace-one state keeps it and publishes it (``n``, snapshots, repr,
  releases). Add-remove neighbors differ in n by one, so publishing it exactly would have
  infinite privacy loss: an add-remove state does not count it at all (``n`` raises
  AttributeError, snapshots carry nil, repr omits it, releases say ``"n": null``).
* No RNG seed or state is kept: noise comes from the OS CSPRNG at the moment it is drawn.

Modes
-----
* direct (``size=D``): items are integers in [0, D).
* hashed (``buckets=B``): any str / bytes / int item goes to counter
  ``SipHash-2-4(key, item) mod B``; collisions are undone statistically at release time.

Layers
------
``rerandomize()`` adds a fresh DLap(p) layer to every counter (done around announced exports and
before a release in the joint model; see docs/privacy.md). The counters then carry the sum of
``layers`` independent DLap(p) draws, which the estimators must be told about.

Examples
--------
>>> from aggregator.state import PanPrivateHistogram
>>> s = PanPrivateHistogram(epsilon=1.0, size=10)
>>> s.update([1, 2, 2, 3])
>>> s.n, s.layers, s.counts.shape
(4, 1, (10,))
>>> t = PanPrivateHistogram.deserialize(s.serialize())
>>> bool((t.counts == s.counts).all()) and t.n == 4
True
"""

from __future__ import annotations

import copy

import hashlib
import os

import msgpack
import numpy as np

from .hashing import KEY_BYTES, bucket_of
from .noise import discrete_laplace, p_from_epsilon

__all__ = ["PanPrivateHistogram", "NEIGHBOR_RELATIONS", "SnapshotError"]

NEIGHBOR_RELATIONS = {"replace-one": 2, "add-remove": 1}
# Why an add-remove state refuses to give or take an event count.
_HIDDEN_N = "add-remove neighbors differ by one event, so the event count is not public"
_FORMAT = "panagg.state"
_VERSION = 1
# The only fields a snapshot may carry; tests assert this set so nothing RNG-related sneaks in.
SNAPSHOT_FIELDS = frozenset(
    {
        "format",
        "version",
        "mode",
        "size",
        "key",
        "epsilon",
        "neighbor",
        "p",
        "layers",
        "n",
        "counts",
        "checksum",
    }
)


def _checksum(header: dict, counts) -> bytes:
    """SHA-256 over the packed header fields and the raw counter bytes (no second copy)."""
    digest = hashlib.sha256(msgpack.packb(header, use_bin_type=True))
    digest.update(counts)
    return digest.digest()


class SnapshotError(ValueError):
    """A serialized state that is corrupt, truncated, or of an unknown format."""


class PanPrivateHistogram:
    """Counters initialised with discrete Laplace noise; any snapshot is epsilon-DP.

    Privacy contract: every snapshot, the live state and anything computed from them is
    epsilon-DP under :attr:`neighbor`. The counters are the DP part. The event count ``n`` is
    public only under ``"replace-one"`` (neighbors have the same n). An ``"add-remove"`` state
    never holds n: neighbors differ by one event, and an exact n would tell them apart with
    certainty. So for add-remove, :attr:`n` raises AttributeError (``getattr(s, "n", None)``
    gives None), :meth:`serialize` stores nil, :meth:`deserialize` refuses a snapshot that
    carries a count, repr omits it and :func:`aggregator.release.make_release` publishes
    ``"n": null`` and gives the estimators no n.

    >>> a = PanPrivateHistogram(epsilon=1.0, size=10, neighbor="add-remove")
    >>> a.update([1, 2, 2, 3])
    >>> a
    PanPrivateHistogram(epsilon=1.0, size=10, neighbor='add-remove', layers=1)
    >>> getattr(a, "n", None) is None
    True
    >>> a.n  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AttributeError: an add-remove state has no n: add-remove neighbors differ by one event, ...
    >>> import msgpack
    >>> msgpack.unpackb(a.serialize())["n"] is None
    True

    Parameters
    ----------
    epsilon
        Privacy parameter of every snapshot of this state (and of one release layer).
    size
        Domain size D for direct mode (items are ints in [0, D)). Give exactly one of
        ``size`` and ``buckets``.
    buckets
        Number of hash buckets B for hashed mode (items are str / bytes / int).
    neighbor
        ``"replace-one"`` (default; sensitivity 2; n public) or ``"add-remove"`` (sensitivity 1;
        no n anywhere, for offline use where the stream length is not revealed).
    key
        16-byte SipHash key for hashed mode; random if omitted. Not secret for privacy.
    rng
        Test-only noise source with a ``bytes(n)`` method; never stored on the object.
    """

    def __init__(
        self,
        epsilon: float,
        *,
        size: int | None = None,
        buckets: int | None = None,
        neighbor: str = "replace-one",
        key: bytes | None = None,
        rng=None,
    ):
        if (size is None) == (buckets is None):
            raise ValueError("give exactly one of size= (direct mode) or buckets= (hashed mode)")
        if neighbor not in NEIGHBOR_RELATIONS:
            raise ValueError(
                f"neighbor must be one of {sorted(NEIGHBOR_RELATIONS)}, got {neighbor!r}"
            )
        length = size if size is not None else buckets
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"size/buckets must be a positive integer, got {length!r}")
        self._mode = "direct" if size is not None else "hashed"
        self._neighbor = neighbor
        self._epsilon = float(epsilon)
        self._p = p_from_epsilon(self._epsilon, NEIGHBOR_RELATIONS[neighbor])
        if self._mode == "hashed":
            key = os.urandom(KEY_BYTES) if key is None else bytes(key)
            if len(key) != KEY_BYTES:
                raise ValueError(f"key must be {KEY_BYTES} bytes")
        elif key is not None:
            raise ValueError("key= only applies to hashed mode (buckets=)")
        self._key = key
        self._counts = discrete_laplace(self._p, int(length), rng=rng)
        self._layers = 1
        # add-remove: n is not public, so the state does not even count it (an intrusion into
        # the live state must not find it either)
        self._n = 0 if self._public_n else None

    # -- the privacy contract, explicit -------------------------------------------------------
    @property
    def epsilon(self) -> float:
        """Each snapshot (and each noise layer) is epsilon-DP under :attr:`neighbor`."""
        return self._epsilon

    @property
    def neighbor(self) -> str:
        return self._neighbor

    @property
    def sensitivity(self) -> int:
        return NEIGHBOR_RELATIONS[self._neighbor]

    @property
    def p(self) -> float:
        """DLap parameter of each layer: exp(-epsilon / sensitivity), rounded up."""
        return self._p

    @property
    def layers(self) -> int:
        """Number of independent DLap(p) layers summed into each counter."""
        return self._layers

    # -- data ----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def size(self) -> int:
        """Number of counters (D in direct mode, B in hashed mode)."""
        return len(self._counts)

    @property
    def key(self) -> bytes | None:
        return self._key

    @property
    def counts(self) -> np.ndarray:
        """The noisy counters (read-only view)."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    @property
    def _public_n(self) -> bool:
        return self._neighbor == "replace-one"

    @property
    def n(self) -> int:
        """Number of events counted (public under replace-one neighbors).

        Raises AttributeError for an add-remove state, which does not count its events.
        """
        if self._n is None:
            raise AttributeError(f"an add-remove state has no n: {_HIDDEN_N}")
        return self._n

    def index_of(self, items) -> np.ndarray:
        """Counter index of each item (validates direct-mode ranges; hashes in hashed mode)."""
        if self._mode == "hashed":
            assert self._key is not None  # a hashed state always holds its key
            return bucket_of(items, self._key, self.size)
        idx = np.asarray(items)
        if idx.size == 0:
            return np.zeros(0, dtype=np.int64)
        if idx.dtype.kind not in "iu":
            if idx.dtype.kind == "O" or idx.dtype.kind == "b":
                raise TypeError("direct-mode items must be integers")
            raise TypeError(f"direct-mode items must be integers, got {idx.dtype}")
        idx = idx.ravel()
        lo, hi = idx.min(), idx.max()
        if lo < 0 or hi >= self.size:
            bad = int(np.count_nonzero((idx < 0) | (idx >= self.size)))
            raise ValueError(f"{bad} item(s) outside the domain [0, {self.size})")
        return idx.astype(np.int64, copy=False)

    def update(self, items) -> None:
        """Count a batch of events (vectorized). The batch is all-or-nothing on bad input."""
        idx = self.index_of(items)
        self.add_indices(idx)

    def add_indices(self, idx: np.ndarray) -> None:
        """Count events already mapped to counter indices in [0, size) (no validation)."""
        if len(idx) == 0:
            return
        if 8 * len(idx) >= self.size:
            self._counts += np.bincount(idx, minlength=self.size)
        else:  # small batch against a large state: touch only what changes
            np.add.at(self._counts, idx, 1)
        if self._n is not None:
            self._n += int(len(idx))

    def rerandomize(self, rng=None) -> None:
        """Add a fresh DLap(p) layer to every counter (see docs/privacy.md for when)."""
        self._counts += discrete_laplace(self._p, self.size, rng=rng)
        self._layers += 1

    def merge(self, other: "PanPrivateHistogram") -> "PanPrivateHistogram":
        """Add another state over a disjoint sub-stream into this one (in place; returns self).

        Counters add, so the noise layers add: the result carries ``self.layers + other.layers``
        layers. Both states must share mode, size, key, epsilon and neighbor relation. Event
        counts add under replace-one; add-remove states have none.
        """
        if not isinstance(other, PanPrivateHistogram):
            raise TypeError("can only merge another PanPrivateHistogram")
        mine = (self._mode, self.size, self._key, self._p, self._neighbor)
        theirs = (other._mode, other.size, other._key, other._p, other._neighbor)
        if mine != theirs:
            raise ValueError(
                "cannot merge states with different mode, size, key, epsilon or neighbor"
            )
        self._counts += other._counts
        self._layers += other._layers
        if self._n is not None:
            assert other._n is not None  # the same neighbor relation (checked above): both count
            self._n += other._n
        return self

    # -- moving the counters between processes ---------------------------------------------------
    def split_counters(self) -> tuple["PanPrivateHistogram", np.ndarray]:
        """``(shell, counters)``: a copy of this state without its counters (small to pickle)
        and the counters themselves (not copied), so that a caller can move them by another
        route (the release worker's shared memory). :meth:`with_counters` joins them again.

        >>> s = PanPrivateHistogram(1.0, size=4)
        >>> shell, c = s.split_counters()
        >>> shell.with_counters(c.copy()).counts.tolist() == s.counts.tolist()
        True
        """
        shell = copy.copy(self)
        shell._counts = np.empty(0, dtype=np.int64)
        return shell, self._counts

    def with_counters(self, counters: np.ndarray) -> "PanPrivateHistogram":
        """This shell holding ``counters`` (in place; returns self)."""
        self._counts = np.asarray(counters, dtype=np.int64)
        return self

    # -- snapshots -------------------------------------------------------------------------------
    def serialize(self) -> bytes:
        """A self-describing msgpack snapshot (SHA-256 checked). Holds no seed or RNG state.

        The field set is always :data:`SNAPSHOT_FIELDS`; ``n`` is nil for an add-remove state.
        """
        header = {
            "format": _FORMAT,
            "version": _VERSION,
            "mode": self._mode,
            "size": self.size,
            "key": self._key,
            "epsilon": self._epsilon,
            "neighbor": self._neighbor,
            "p": self._p,
            "layers": self._layers,
            "n": self._n,
        }
        counts = np.ascontiguousarray(self._counts, dtype="<i8").data.cast("B")
        body = dict(header, counts=counts, checksum=_checksum(header, counts))
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def deserialize(cls, data: bytes) -> "PanPrivateHistogram":
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types; all mean "not a snapshot"
            raise SnapshotError(f"snapshot is not valid msgpack ({type(exc).__name__})") from None
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            raise SnapshotError("not a panagg state snapshot")
        if body.get("version") != _VERSION:
            raise SnapshotError(f"unsupported snapshot version {body.get('version')!r}")
        if set(body) != SNAPSHOT_FIELDS:
            raise SnapshotError("snapshot fields do not match the format")
        checksum = body.pop("checksum")
        raw = body.pop("counts")
        if not isinstance(raw, bytes) or _checksum(body, raw) != checksum:
            raise SnapshotError("snapshot checksum mismatch (corrupt or tampered)")
        counts = np.frombuffer(raw, dtype="<i8")
        if len(counts) != body["size"]:
            raise SnapshotError("snapshot counter array has the wrong length")
        obj = cls.__new__(cls)
        obj._mode = body["mode"]
        obj._neighbor = body["neighbor"]
        obj._epsilon = float(body["epsilon"])
        obj._p = float(body["p"])
        if obj._neighbor not in NEIGHBOR_RELATIONS or obj._mode not in ("direct", "hashed"):
            raise SnapshotError("snapshot has an unknown mode or neighbor relation")
        if obj._p != p_from_epsilon(obj._epsilon, NEIGHBOR_RELATIONS[obj._neighbor]):
            raise SnapshotError("snapshot p does not match its epsilon")
        obj._key = body["key"]
        obj._counts = counts.astype(np.int64)  # own, writable copy
        obj._layers = int(body["layers"])
        if obj._layers < 1:
            raise SnapshotError("snapshot has no noise layer")
        if not obj._public_n:
            if body["n"] is not None:
                raise SnapshotError(f"an add-remove snapshot must not carry n: {_HIDDEN_N}")
            obj._n = None
        elif body["n"] is None:
            raise SnapshotError("a replace-one snapshot must carry n")
        else:
            obj._n = int(body["n"])
            if obj._n < 0:
                raise SnapshotError("snapshot has a negative event count")
        return obj

    def __repr__(self) -> str:
        what = f"size={self.size}" if self._mode == "direct" else f"buckets={self.size}"
        count = f", n={self._n}" if self._n is not None else ""
        return (
            f"PanPrivateHistogram(epsilon={self._epsilon}, {what}, "
            f"neighbor={self._neighbor!r}, layers={self._layers}{count})"
        )
