"""Shuffle-model clients: one event -> its sealed messages (docs/shuffle.md, "Deployment:
clients and the shuffler").

A client holds the analyzer's public key, the randomizer every party of the deployment shares
(:func:`.shuffler.make_randomizer` of the common config) and the item -> bucket map of the
service (``to_bucket``). ``messages(item)`` maps the item to its bucket, randomizes
(``encode``) and seals every row, with the fingerprint of the randomizer's parameters, to the
analyzer, so the shuffler that forwards the messages can
read none of them; ``record(item)`` adds a fresh random event id as the Kafka key (the shuffler
drops redelivered copies by it).

The item -> bucket maps are the service's (:func:`bucket_map`):
* direct mode: integer ids in ``[0, state.domain_size)``, the bucket is the id;
* hashed mode: ``siphash24(key, canonical_bytes(item)) mod B`` (:func:`aggregator.hashing.
  bucket_of`, after ``item.normalize`` / ``item.casefold`` as the decoder applies them), with
  ``B`` from ``state.buckets`` / ``state.expected_n`` and the key ``shuffle.hash_key`` (32 hex
  digits), which every client must share. The key is not secret for privacy (the noise, not
  the map, protects events; aggregator/hashing.py): it only keeps outsiders from crafting
  colliding items.

>>> from aggregator.shuffle import GKMPRandomizer
>>> from aggregator.service.shuffle_wire import new_keypair, open_boxes
>>> keys = new_keypair()
>>> c = ShuffleClient(keys.public_key, GKMPRandomizer(1.0, 1e-6, 1000, 20))
>>> rows = open_boxes(c.messages(7), keys)
>>> int(((rows[:, 0] == 7) & (rows[:, 1] == 1)).sum()) >= 1     # the event's own (7, +1)
True
"""

from __future__ import annotations

import unicodedata
from typing import Callable

import numpy as np

from ..hashing import KEY_BYTES, bucket_of
from .identity import choose_buckets_for
from .settings import Config
from .shuffle_wire import ParamTag, client_record, load_public_key, new_event_id, seal_rows
from .shuffler import ShufflerError, make_randomizer

__all__ = ["ShuffleClient", "bucket_map", "direct_buckets", "hashed_buckets"]


def direct_buckets(buckets: int) -> Callable:
    """Direct mode: the item is the bucket (an integer id below ``buckets``)."""

    def to_bucket(items) -> np.ndarray:
        arr = np.asarray(items if isinstance(items, np.ndarray) else list(items))
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
            raise ValueError("direct-mode items must be integer ids")
        arr = arr.ravel()
        bad = (arr < 0) | (arr >= buckets)
        if bad.any():
            raise ValueError(f"item {arr[bad][0]!r} is not an id in [0, {buckets})")
        return arr.astype(np.int64)

    return to_bucket


def hashed_buckets(
    key: bytes, buckets: int, *, nfc: bool = False, casefold: bool = False
) -> Callable:
    """Hashed mode: SipHash-2-4 of the item's canonical bytes mod ``buckets`` (the service's
    map, :func:`aggregator.hashing.bucket_of`), after the decoder's text normalisation."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"the bucket hash key must be {KEY_BYTES} bytes")

    def norm(x):
        if isinstance(x, str):
            if nfc:
                x = unicodedata.normalize("NFC", x)
            if casefold:
                x = x.casefold()
                if nfc:
                    x = unicodedata.normalize("NFC", x)
        return x

    def to_bucket(items) -> np.ndarray:
        items = list(items) if not isinstance(items, np.ndarray) else items.ravel().tolist()
        if nfc or casefold:
            items = [norm(x) for x in items]
        return bucket_of(items, key, buckets)

    return to_bucket


def bucket_map(cfg: Config) -> Callable:
    """The item -> bucket map of ``cfg`` (direct or hashed); raises ValueError naming the key."""
    st = cfg.state
    if st.mode == "direct":
        return direct_buckets(int(st.domain_size))
    text = cfg.shuffle.hash_key.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 16:
        raise ValueError(
            "hashed-mode shuffle clients need shuffle.hash_key: 32 hex digits shared "
            'by every client (e.g. `python -c "import secrets; '
            'print(secrets.token_hex(16))"`)'
        )
    return hashed_buckets(
        key, choose_buckets_for(cfg), nfc=cfg.item.normalize == "nfc", casefold=cfg.item.casefold
    )


class ShuffleClient:
    """One client (or many: :meth:`records`) of a shuffle-model deployment.

    Parameters
    ----------
    public_key
        The analyzer's public key: ``nacl.public.PublicKey``, 64 hex digits, or a file holding them.
    randomizer
        ``GKMPRandomizer`` or ``BalcerCheuRandomizer`` with the deployment's parameters.
    to_bucket
        Items (a sequence) -> int64 buckets; default: direct ids below ``randomizer.buckets``.
    """

    def __init__(self, public_key, randomizer, to_bucket: Callable | None = None):
        self.public_key = load_public_key(public_key) if isinstance(public_key, str) else public_key
        self.randomizer = randomizer
        #: the randomizer's parameters, sealed into every message (shuffle_wire: the analyzer
        #: refuses a window holding messages of other parameters than its own)
        self.tag = ParamTag.of(randomizer)
        self.to_bucket = to_bucket or direct_buckets(int(randomizer.buckets))

    @classmethod
    def from_config(cls, cfg: Config) -> "ShuffleClient":
        if not cfg.shuffle.public_key:
            raise ShufflerError(
                "clients need shuffle.public_key (printed by `panagg shuffle-keygen`)"
            )
        try:
            to_bucket = bucket_map(cfg)
            return cls(str(cfg.shuffle.public_key), make_randomizer(cfg), to_bucket)
        except ValueError as exc:  # WireError, ShuffleConfigError, a bad hash key
            raise ShufflerError(str(exc)) from None

    def bucket(self, item) -> int:
        b = int(self.to_bucket([item])[0])
        if not 0 <= b < self.randomizer.buckets:
            raise ValueError(
                f"item {item!r} maps to bucket {b}, outside [0, {self.randomizer.buckets})"
            )
        return b

    def messages(self, item) -> list[bytes]:
        """The sealed messages of one event (in the randomizer's row order: the shuffler
        permutes them with every other event's)."""
        return seal_rows(self.randomizer.encode(self.bucket(item)), self.public_key, self.tag)

    def record(self, item) -> tuple[bytes, bytes]:
        """(Kafka key, value) of one event for the client topic."""
        return new_event_id(), client_record(self.messages(item))

    def records(self, items) -> list[tuple[bytes, bytes]]:
        """Many events at once (one randomizer pass; a load generator's path)."""
        b = np.asarray(self.to_bucket(items), dtype=np.int64)
        if len(b) == 0:
            return []
        if b.min() < 0 or b.max() >= self.randomizer.buckets:
            raise ValueError(f"an item maps outside [0, {self.randomizer.buckets})")
        rows, owner = self.randomizer.encode_many(b)
        order = np.argsort(owner, kind="stable")
        rows, owner = rows[order], owner[order]
        cuts = np.searchsorted(owner, np.arange(1, len(b)))
        return [
            (new_event_id(), client_record(seal_rows(part, self.public_key, self.tag)))
            for part in np.split(rows, cuts)
        ]
