"""Decode raw event messages into items, sorting bad input into named reasons.

Schema: a map ``{"item": <str | bytes | int>, ...}`` encoded as msgpack (default) or JSON. Bad
input is never fatal and never counted as an event; each rejected message gets one reason:

===============  ===========================================================================
reason           meaning
===============  ===========================================================================
``oversized``    the message is longer than ``max_message_bytes``, or its item longer than
                 ``max_item_bytes``
``undecodable``  not valid msgpack / JSON (or not UTF-8 JSON, a byte order mark included), or a
                 str item with a lone surrogate (no UTF-8 form to hash)
``not_a_map``    decodes, but is not a map/object
``missing_item`` a map without an ``"item"`` key
``wrong_type``   the item is not str/bytes/int (bool, float, list, null ...), or not an int
                 in direct mode
``out_of_range`` direct mode: an int outside [0, D)
===============  ===========================================================================

In hashed mode an int item is accepted in [-2**63, 2**64) (what msgpack can carry) and is oversized
outside it; a JSON integer too long for Python to parse (``sys.get_int_max_str_digits()``) is such
an int too (not undecodable: it is valid JSON).
Duplicate keys: the last ``"item"`` wins (both formats). Every accepted item hashes
(aggregator.hashing), so no message can make counting its batch fail.

Error messages and counters name the reason and, at most, the position of the message (topic,
partition, offset); never its content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgpack
import numpy as np

__all__ = ["REASONS", "Decoder", "DecodedBatch"]

REASONS = ("oversized", "undecodable", "not_a_map", "missing_item", "wrong_type", "out_of_range")
_HUGE = 10**100  # stands for any JSON integer past Python's parse limit: outside every range


def _capped_int(digits: str) -> int:
    return int(digits) if len(digits) < 100 else (-_HUGE if digits.startswith("-") else _HUGE)


@dataclass
class DecodedBatch:
    """Items of the good messages, in order, and the positions of the bad ones by reason."""

    items: list | np.ndarray = field(default_factory=list)  # int64 array on the fast path
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
        text = raw.decode("utf-8")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # a valid integer past Python's digit limit: judge it by its range
            return json.loads(text, parse_int=_capped_int)

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

    def _decode_msgpack_batch(self, values) -> DecodedBatch | None:
        """All-good msgpack batches in one pass through C; None means "use the slow path".

        The batch is unpacked as one stream; the end position of every object must equal the
        cumulative message lengths, so each message holds exactly one object (a message with two
        objects next to an empty one would otherwise pass). Anything unusual (a bad message, an
        item of another type, a long string) falls back to per-message decoding, which names the
        reason of each bad message.
        """
        n = len(values)
        try:
            lens = np.fromiter(map(len, values), np.int64, n)
        except TypeError:
            return None
        if lens.min() < 2 or lens.max() > self.max_message_bytes:
            return None
        try:
            buf = b"".join(values)
        except TypeError:  # a value that is not bytes-like: decode_one names it
            return None
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(buf) + 1)
        unpacker.feed(buf)
        objs, ends = [], []
        add_obj, add_end, tell = objs.append, ends.append, unpacker.tell
        try:
            for obj in unpacker:
                add_obj(obj)
                add_end(tell())
        except Exception:
            return None
        if len(objs) != n or not np.array_equal(np.asarray(ends, dtype=np.int64), np.cumsum(lens)):
            return None
        items = [o.get("item") if type(o) is dict else None for o in objs]
        kinds = set(map(type, items))
        if self.domain_size is not None:
            if kinds != {int}:
                return None
            try:
                arr = np.fromiter(items, np.int64, n)
            except OverflowError:
                return None
            inside = (arr >= 0) & (arr < self.domain_size)
            if inside.all():
                return DecodedBatch(items=arr)
            bad = np.flatnonzero(~inside)
            return DecodedBatch(items=arr[inside], rejected=[(int(i), "out_of_range") for i in bad])
        if not kinds <= {int, str, bytes}:
            return None
        if kinds - {int}:
            # Only items that could pass the limit once UTF-8 encoded (<= 4 bytes a character)
            # are measured exactly: a long but valid item costs its own bytes, instead of sending
            # the whole batch down the per-message path (a timing channel, docs/hash_timing.md).
            limit = self.max_item_bytes
            for x in [x for x in items if type(x) is not int and len(x) * 4 > limit]:
                if (len(x.encode("utf-8")) if type(x) is str else len(x)) > limit:
                    return None  # oversized: the per-message path names it
        return DecodedBatch(items=items)

    def decode(self, values) -> DecodedBatch:
        if self.fmt == "msgpack" and len(values) >= 64:
            fast = self._decode_msgpack_batch(values)
            if fast is not None:
                return fast
        return self.decode_each(values)

    def decode_each(self, values) -> DecodedBatch:
        """The per-message path: each message decoded on its own, never raising for one
        message's sake (whatever a message makes the decoder do, it is ``undecodable``)."""
        out = DecodedBatch()
        append_item, append_bad = out.items.append, out.rejected.append
        for i, raw in enumerate(values):
            try:
                item, reason = self.decode_one(raw)
            except Exception:
                item, reason = None, "undecodable"
            if reason is None:
                append_item(item)
            else:
                append_bad((i, reason))
        return out
