"""Decode raw event messages into items, sorting bad input into named reasons.

Schema: a map ``{"item": <str | bytes | int>, ...}`` encoded as msgpack (default) or JSON. Bad
input is never fatal and never counted as an event; each rejected message gets one reason:

===============  ===========================================================================
reason           meaning
===============  ===========================================================================
``oversized``    the message is longer than ``max_message_bytes``, or its item longer than
                 ``max_item_bytes``
``undecodable``  not valid msgpack / JSON (or not UTF-8 JSON)
``not_a_map``    decodes, but is not a map/object
``missing_item`` a map without an ``"item"`` key
``wrong_type``   the item is not str/bytes/int (bool, float, list, null ...), or not an int
                 in direct mode
``out_of_range`` direct mode: an int outside [0, D)
===============  ===========================================================================

Error messages and counters name the reason and, at most, the position of the message (topic,
partition, offset); never its content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgpack

__all__ = ["REASONS", "Decoder", "DecodedBatch"]

REASONS = ("oversized", "undecodable", "not_a_map", "missing_item", "wrong_type", "out_of_range")


@dataclass
class DecodedBatch:
    """Items of the good messages, in order, and the positions of the bad ones by reason."""

    items: list = field(default_factory=list)
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (index in batch, reason)

    def reason_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, reason in self.rejected:
            counts[reason] = counts.get(reason, 0) + 1
        return counts


class Decoder:
    """Turns message values (bytes) into items for a direct- or hashed-mode state.

    Parameters
    ----------
    fmt
        ``"msgpack"`` (default) or ``"json"``.
    domain_size
        D for direct mode (items must be ints in [0, D)); None for hashed mode.
    max_message_bytes, max_item_bytes
        Size limits; longer input is rejected as ``oversized``.

    >>> d = Decoder(domain_size=10)
    >>> b = d.decode([msgpack.packb({"item": 3}), b"\\xc1", msgpack.packb({"item": 99})])
    >>> b.items, b.rejected
    ([3], [(1, 'undecodable'), (2, 'out_of_range')])
    """

    def __init__(self, fmt: str = "msgpack", domain_size: int | None = None,
                 max_message_bytes: int = 65536, max_item_bytes: int = 1024):
        if fmt not in ("msgpack", "json"):
            raise ValueError(f"format must be 'msgpack' or 'json', got {fmt!r}")
        self.fmt = fmt
        self.domain_size = domain_size
        self.max_message_bytes = int(max_message_bytes)
        self.max_item_bytes = int(max_item_bytes)

    def _load(self, raw: bytes):
        if self.fmt == "msgpack":
            return msgpack.unpackb(raw, raw=False, strict_map_key=False)
        return json.loads(raw.decode("utf-8"))

    def decode_one(self, raw) -> tuple[object, str | None]:
        """(item, None) for a good message, (None, reason) for a bad one."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            return None, "undecodable"
        if len(raw) > self.max_message_bytes:
            return None, "oversized"
        try:
            doc = self._load(bytes(raw))
        except Exception:  # msgpack/json raise many types for garbage; all mean undecodable
            return None, "undecodable"
        if not isinstance(doc, dict):
            return None, "not_a_map"
        if "item" not in doc:
            return None, "missing_item"
        item = doc["item"]
        if isinstance(item, bool) or not isinstance(item, (int, str, bytes)):
            return None, "wrong_type"
        if self.domain_size is not None:
            if not isinstance(item, int):
                return None, "wrong_type"
            if not 0 <= item < self.domain_size:
                return None, "out_of_range"
            return item, None
        if isinstance(item, int):
            if not -(2**63) <= item < 2**64:
                return None, "oversized"
        elif len(item) > self.max_item_bytes or (isinstance(item, str) and
                                                 len(item.encode("utf-8", "surrogatepass")) > self.max_item_bytes):
            return None, "oversized"
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates cannot be hashed as UTF-8
                return None, "undecodable"
        return item, None

    def decode(self, values) -> DecodedBatch:
        out = DecodedBatch()
        append_item, append_bad = out.items.append, out.rejected.append
        for i, raw in enumerate(values):
            item, reason = self.decode_one(raw)
            if reason is None:
                append_item(item)
            else:
                append_bad((i, reason))
        return out
