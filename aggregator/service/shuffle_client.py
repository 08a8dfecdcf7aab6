"""Shuffle-model clients: one event -> its sealed messages (docs/shuffle.md, "Clients").

A client holds the analyzer's public key and the randomizer every party of the deployment
shares (:func:`.shuffler.make_randomizer` of the common config). ``messages(item)`` maps the
item to its bucket, randomizes (``encode``), and seals every row to the analyzer, so the
shuffler that forwards the messages can read none of them; ``record(item)`` adds a fresh random
event id as the Kafka key (the shuffler drops redelivered copies by it).

Items: direct mode takes integer ids in ``[0, state.domain_size)``; hashed mode is not offered
to clients yet (it needs the bucket hash key on every client: not built).
"""

from __future__ import annotations

import numpy as np

from .shuffle_wire import client_record, load_public_key, new_event_id, seal_rows


class ShuffleClient:
    def __init__(self, public_key, randomizer):
        self.public_key = load_public_key(public_key) if isinstance(public_key, str) else public_key
        self.randomizer = randomizer

    @classmethod
    def from_config(cls, cfg: dict) -> "ShuffleClient":
        from .shuffler import ShufflerError, make_randomizer
        if cfg["state"]["mode"] != "direct":
            raise ShufflerError("shuffle-model clients take direct-mode items (state.mode = "
                                "direct, integer ids below state.domain_size); hashed mode is "
                                "not built for clients")
        if not cfg["shuffle"]["public_key"]:
            raise ShufflerError("clients need shuffle.public_key (printed by `panagg shuffle-keygen`)")
        return cls(str(cfg["shuffle"]["public_key"]), make_randomizer(cfg))

    def bucket(self, item) -> int:
        b = int(item)
        if not 0 <= b < self.randomizer.buckets:
            raise ValueError(f"item {item!r} is not an id in [0, {self.randomizer.buckets})")
        return b

    def messages(self, item) -> list[bytes]:
        """The sealed messages of one event (in the randomizer's row order: the shuffler
        permutes them with every other event's)."""
        return seal_rows(self.randomizer.encode(self.bucket(item)), self.public_key)

    def record(self, item) -> tuple[bytes, bytes]:
        """(Kafka key, value) of one event for the client topic."""
        return new_event_id(), client_record(self.messages(item))

    def records(self, items) -> list[tuple[bytes, bytes]]:
        """Many events at once (one randomizer pass; a load generator's path)."""
        b = np.array([self.bucket(x) for x in items], dtype=np.int64)
        rows, owner = self.randomizer.encode_many(b)
        order = np.argsort(owner, kind="stable")
        rows, owner = rows[order], owner[order]
        cuts = np.searchsorted(owner, np.arange(1, len(b)))
        return [(new_event_id(), client_record(seal_rows(part, self.public_key)))
                for part in np.split(rows, cuts)]
