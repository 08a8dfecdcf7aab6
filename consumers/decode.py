"""Decode raw event messages into items, sorting bad input into named reasons.

Schema: a map ``{"item": <str | bytes | int>, ...}`` encoded as msgpack (default) or JSON. Which
field is the item is an :class:`ItemSpec` (config section ``[item]``): a field path in the value
(``user.id``), the record key, or a header; optional coercion of numeric strings (direct mode),
NFC normalisation and case folding (hashed mode), and a filter on another field. Records the
filter leaves out are neither events nor rejects (:data:`FILTERED`). Bad input is never fatal and
never counted as an event; each rejected message gets one reason:

===============  ===========================================================================
reason           meaning
===============  ===========================================================================
``oversized``    the message is longer than ``max_message_bytes``, or its item longer than
                 ``max_item_bytes``
``undecodable``  not valid msgpack / JSON (or not UTF-8 JSON, a byte order mark included), or a
                 str item with a lone surrogate (no UTF-8 form to hash)
``not_a_map``    decodes, but is not a map/object
``missing_item`` a map without the item field (``"item"``, or ``item.field``'s path), or no
                 record key / header when the item comes from there
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
import unicodedata
from itertools import compress, repeat
from dataclasses import dataclass, field

import msgpack
import numpy as np

__all__ = ["REASONS", "FILTERED", "Decoder", "DecodedBatch", "ItemSpec"]

REASONS = ("oversized", "undecodable", "not_a_map", "missing_item", "wrong_type", "out_of_range")
#: not a reason: a record the filter (``item.filter_field``) leaves out; not an event, not a reject
FILTERED = "filtered"
_MISSING = object()
_HUGE = 10**100  # stands for any JSON integer past Python's parse limit: outside every range
#: the plain direct-mode message: fixmap of one entry, fixstr "item", then the int's tag; its
#: six bytes as the low bytes of a little-endian word
_PLAIN_PREFIX = np.uint64(int.from_bytes(b"\x81\xa4item", "little"))
_LOW_SIX = np.uint64((1 << 48) - 1)
#: bytes of the int after the fixstr (tag included) by tag; 0: not a plain non-negative int
_PLAIN_INT_BYTES = np.zeros(256, np.int64)
_PLAIN_INT_BYTES[:0x80] = 1  # positive fixint
_PLAIN_INT_BYTES[[0xCC, 0xCD, 0xCE, 0xCF]] = [2, 3, 5, 9]  # uint 8, 16, 32, 64


def _capped_int(digits: str) -> int:
    return int(digits) if len(digits) < 100 else (-_HUGE if digits.startswith("-") else _HUGE)


@dataclass(frozen=True)
class ItemSpec:
    """Which part of a record is the item, and how it is normalised (config section ``[item]``).

    source
        ``"value"`` (a field of the decoded message), ``"key"`` (the Kafka record key) or
        ``"header"`` (the last Kafka header named ``header``).
    path
        The field path in the value, e.g. ``("user", "id")`` for ``user.id``; a segment of
        digits indexes a list.
    coerce
        Direct mode: a str (or key/header bytes) of ASCII digits is that int ("00042" is 42).
        Key and header items in direct mode are always read this way (bytes are no int).
    nfc, casefold
        Hashed mode, str items: Unicode NFC normalisation, ``str.casefold()``.
    filter_path, filter_value
        Only records whose value has ``filter_value`` at ``filter_path`` (compared as text:
        strings as they are, ints in decimal, booleans as ``true``/``false``) are events; the
        rest (the field missing included) are :data:`FILTERED`.
    filter_exclude
        Instead of ``filter_value`` (a breakdown's ``other`` key): the records whose value at
        ``filter_path`` is one of these are :data:`FILTERED`, all others are events.
    """

    source: str = "value"
    path: tuple = ("item",)
    header: str = ""
    coerce: bool = False
    nfc: bool = False
    casefold: bool = False
    filter_path: tuple | None = None
    filter_value: str = ""
    filter_exclude: frozenset | None = None

    @classmethod
    def from_config(cls, item: dict) -> "ItemSpec":
        fp = tuple(item["filter_field"].split(".")) if item["filter_field"] else None
        return cls(
            source=item["source"],
            path=tuple(item["field"].split(".")),
            header=item["header"],
            coerce=bool(item["coerce"]),
            nfc=item["normalize"] == "nfc",
            casefold=bool(item["casefold"]),
            filter_path=fp,
            filter_value=str(item["filter_value"]),
            filter_exclude=(frozenset(map(str, item.get("filter_exclude") or ())) or None),
        )

    def passes(self, value) -> bool:
        """Whether a record whose value at ``filter_path`` is ``value`` is an event."""
        text = _as_text(value)
        if self.filter_exclude is not None:
            return text not in self.filter_exclude
        return text == self.filter_value

    @property
    def default(self) -> bool:
        return self == ItemSpec()

    @property
    def needs_value(self) -> bool:
        return self.source == "value" or self.filter_path is not None


def _walk(doc, path):
    """The value at ``path`` in ``doc`` or _MISSING (a missing key, a non-container on the way)."""
    for seg in path:
        if type(doc) is dict:
            doc = doc.get(seg, _MISSING)
        elif type(doc) is list and seg.isdigit() and int(seg) < len(doc):
            doc = doc[int(seg)]
        else:
            return _MISSING
        if doc is _MISSING:
            return _MISSING
    return doc


def _pluck(objs: list, path: tuple) -> list:
    """``_walk(o, path)`` for every map in ``objs`` (None for a non-map), in list comprehensions
    for the common one- and two-level map paths (the batch fast path's hot loop)."""
    M = _MISSING
    if len(path) == 1:
        (a,) = path
        return [o.get(a, M) if type(o) is dict else None for o in objs]
    if len(path) == 2 and not path[1].isdigit():
        a, b = path
        return [
            (v.get(b, M) if type(v) is dict else M) if v is not None else None
            for v in [o.get(a, M) if type(o) is dict else None for o in objs]
        ]
    return [_walk(o, path) if type(o) is dict else None for o in objs]


def _matches(values: list, want: str) -> list:
    """``_as_text(v) == want`` for each value, without a call per value for str, int and bool."""
    digits = want[1:] if want.startswith("-") else want
    as_int = int(want) if digits.isdigit() and digits.isascii() and len(digits) < 30 else None
    as_bool = {"true": True, "false": False}.get(want)
    out = [v == want for v in values]  # True only for the equal str (no other type equals one)
    kinds = set(map(type, values))
    if kinds <= {str} or (as_int is None and as_bool is None and bytes not in kinds):
        return out
    for i, v in enumerate(values):
        if not out[i] and type(v) is not str and v is not _MISSING:
            t = type(v)
            out[i] = (
                (t is int and v == as_int)
                or (t is bool and v is as_bool)
                or (t is bytes and _as_text(v) == want)
            )
    return out


def _as_text(value) -> str | None:
    """The filter's view of a field: str as is, int in decimal, bool as true/false."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return str(value) if not isinstance(value, int) or abs(value) < 10**30 else None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _digits(item):
    """A str/bytes of ASCII digits as its int (at most 40 digits), else None."""
    if isinstance(item, bytes):
        if 0 < len(item) <= 40 and item.isdigit():  # bytes.isdigit is ASCII-only
            return int(item)
        return None
    if isinstance(item, str) and 0 < len(item) <= 40 and item.isascii() and item.isdigit():
        return int(item)
    return None


@dataclass
class DecodedBatch:
    """Items of the good messages, in order, and the positions of the bad ones by reason.

    Records the filter left out are in ``rejected`` too, with reason :data:`FILTERED` (the
    service accounts them apart from rejects: not events, no dead letter)."""

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

    def __init__(
        self,
        fmt: str = "msgpack",
        domain_size: int | None = None,
        max_message_bytes: int = 65536,
        max_item_bytes: int = 1024,
        spec: ItemSpec | None = None,
    ):
        if fmt not in ("msgpack", "json"):
            raise ValueError(f"format must be 'msgpack' or 'json', got {fmt!r}")
        self.fmt = fmt
        self.domain_size = domain_size
        self.max_message_bytes = int(max_message_bytes)
        self.max_item_bytes = int(max_item_bytes)
        self.spec = spec or ItemSpec()
        self._default = self.spec.default
        self._normalises = domain_size is None and (self.spec.nfc or self.spec.casefold)
        self._plain_direct = domain_size is not None and self._default
        #: several aggregations of one stream: a dict shared by their decoders for one chunk of
        #: a poll, id(raw) -> (raw, parsed document), so each record is parsed once (None: none)
        self.shared: dict | None = None

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

    def _load_shared(self, raw: bytes):
        shared = self.shared
        if shared is None:
            return self._load(raw)
        hit = shared.get(id(raw))
        if hit is not None and hit[0] is raw:  # the same bytes object, not a reused id
            return hit[1]
        doc = self._load(raw)  # (a record that fails to parse is parsed again by each: rare)
        shared[id(raw)] = (raw, doc)
        return doc

    def decode_one(self, raw, key=None, headers=None) -> tuple[object, str | None]:
        """(item, None) for a good message, (None, reason) for a bad one, (None, FILTERED) for
        one the filter leaves out. ``key`` and ``headers``: the Kafka record's, where the item
        comes from there."""
        spec = self.spec
        doc = None
        if spec.needs_value:
            if not isinstance(raw, (bytes, bytearray, memoryview)):
                return None, "undecodable"
            if len(raw) > self.max_message_bytes:
                return None, "oversized"
            try:
                doc = self._load_shared(bytes(raw))
            except Exception:  # msgpack/json raise many types for garbage; all mean undecodable
                return None, "undecodable"
            if not isinstance(doc, dict):
                return None, "not_a_map"
            if spec.filter_path is not None and not spec.passes(_walk(doc, spec.filter_path)):
                return None, FILTERED
        if spec.source == "value":
            item = _walk(doc, spec.path) if not self._default else doc.get("item", _MISSING)
        elif spec.source == "key":
            item = _MISSING if key is None else key
        else:
            item = _MISSING
            for name, value in headers or ():
                if name == spec.header:
                    item = value
        if item is _MISSING:
            return None, "missing_item"
        return self._check(item, spec.source != "value")

    def _check(self, item, raw_bytes: bool) -> tuple[object, str | None]:
        """Type, range, size and normalisation of one item (``raw_bytes``: a key or header)."""
        if isinstance(item, (bytearray, memoryview)):
            item = bytes(item)
        if isinstance(item, bool) or not isinstance(item, (int, str, bytes)):
            return None, "wrong_type"
        if self.domain_size is not None:
            if not isinstance(item, int):
                if not (self.spec.coerce or raw_bytes):
                    return None, "wrong_type"
                if len(item) > self.max_item_bytes:
                    return None, "oversized"
                item = _digits(item)
                if item is None:
                    return None, "wrong_type"
            if not 0 <= item < self.domain_size:
                return None, "out_of_range"
            return item, None
        if isinstance(item, int):
            if not -(2**63) <= item < 2**64:
                return None, "oversized"
            return item, None
        if len(item) > self.max_item_bytes or (
            isinstance(item, str)
            and len(item.encode("utf-8", "surrogatepass")) > self.max_item_bytes
        ):
            return None, "oversized"
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates cannot be hashed as UTF-8
                return None, "undecodable"
            if self._normalises:
                item = self._normalise(item)
                if len(item.encode("utf-8")) > self.max_item_bytes:  # casefold can lengthen
                    return None, "oversized"
        elif self._normalises and raw_bytes:
            try:  # a key or header: text if it is UTF-8 (else the bytes count as they are)
                item = self._normalise(item.decode("utf-8"))
            except UnicodeDecodeError:
                return item, None
            if len(item.encode("utf-8")) > self.max_item_bytes:
                return None, "oversized"
        return item, None

    def _normalise(self, text: str) -> str:
        if self.spec.nfc:
            text = unicodedata.normalize("NFC", text)
        if self.spec.casefold:
            text = text.casefold()
            if self.spec.nfc:  # folding can leave a string that is not NFC
                text = unicodedata.normalize("NFC", text)
        return text

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
        spec, keep, left_out = self.spec, None, []
        if spec.filter_path is not None:
            if set(map(type, objs)) != {dict}:
                return None  # not_a_map: the per-message path names it
            values = _pluck(objs, spec.filter_path)
            match = (
                _matches(values, spec.filter_value)
                if spec.filter_exclude is None
                else [spec.passes(v) for v in values]
            )
            if not all(match):
                mask = np.fromiter(match, bool, n)
                keep = np.flatnonzero(mask).tolist()
                left_out = list(zip(np.flatnonzero(~mask).tolist(), repeat(FILTERED)))
                objs = list(compress(objs, match))
                n = len(objs)
        if self._default:
            items = [o.get("item") if type(o) is dict else None for o in objs]
        else:
            items = _pluck(objs, spec.path)
        kinds = set(map(type, items))
        if self.domain_size is not None:
            if spec.coerce and kinds - {int}:
                items = [x if type(x) is int else _digits(x) for x in items]
                kinds = set(map(type, items))
            if kinds - {int}:
                return None
            try:
                arr = np.fromiter(items, np.int64, n)
            except OverflowError:
                return None
            inside = (arr >= 0) & (arr < self.domain_size)
            if inside.all():
                return DecodedBatch(items=arr, rejected=left_out)
            bad = np.flatnonzero(~inside)
            rejected = [(int(i) if keep is None else keep[i], "out_of_range") for i in bad]
            return DecodedBatch(items=arr[inside], rejected=sorted(rejected + left_out))
        if not kinds <= {int, str, bytes}:
            return None
        if kinds - {int}:
            # Only items that could pass the limit once UTF-8 encoded (<= 4 bytes a character)
            # are measured exactly: a long but valid item costs its own bytes, instead of sending
            # the whole batch down the per-message path (a timing channel, docs/hash_timing.md).
            limit = self.max_item_bytes
            if self._normalises:
                items = [self._normalise(x) if type(x) is str else x for x in items]
            for x in [x for x in items if type(x) is not int and len(x) * 4 > limit]:
                if (len(x.encode("utf-8")) if type(x) is str else len(x)) > limit:
                    return None  # oversized: the per-message path names it
        return DecodedBatch(items=items, rejected=left_out)

    def _decode_plain_direct(self, values) -> DecodedBatch | None:
        """Direct mode, default item spec, a batch whose every message is exactly
        ``{"item": <uint>}`` laid out as msgpack packs it (fixmap 1, fixstr "item", a positive
        fixint or uint 8/16/32/64): the items read with numpy from the joined bytes, without
        building a Python object per message. None (another layout anywhere in the batch, an
        int >= 2**63): the general paths, which give the same items and reasons for these
        messages; out-of-range ints are rejected here as there."""
        n = len(values)
        try:
            lens = np.fromiter(map(len, values), np.int64, n)
            joined = b"".join(values)
        except TypeError:
            return None
        if lens.min() < 7 or lens.max() > min(15, self.max_message_bytes):
            return None
        # the 8 bytes from every byte on, as unaligned little-endian words (one gather reads a
        # message's first 8 bytes; 8 zero bytes pad the end)
        words = np.ndarray((len(joined),), "<u8", joined + bytes(8), 0, (1,))
        starts = np.cumsum(lens) - lens
        head = words[starts]
        if not ((head & _LOW_SIX) == _PLAIN_PREFIX).all():
            return None
        tag = (head >> np.uint64(48)).astype(np.uint8)  # the seventh byte: the int's tag
        if not (lens == 6 + _PLAIN_INT_BYTES[tag]).all():
            return None  # another tag (signed, negative, nil, ...) or trailing bytes
        arr = tag.astype(np.int64)
        wide = np.flatnonzero(tag >= 0x80)
        if len(wide):
            width = lens[wide] - 7  # 1, 2, 4 or 8 big-endian bytes after the tag
            raw = words[starts[wide] + 7].byteswap()  # those bytes first, big-endian
            big = raw >> (8 * (8 - width)).astype(np.uint64)
            if (big >> np.uint64(63)).any():
                return None  # >= 2**63: the general path decides (out of every range)
            arr[wide] = big.astype(np.int64)
        inside = arr < self.domain_size
        if inside.all():
            return DecodedBatch(items=arr, rejected=[])
        return DecodedBatch(
            items=arr[inside], rejected=[(int(i), "out_of_range") for i in np.flatnonzero(~inside)]
        )

    def decode(self, values, keys=None, headers=None) -> DecodedBatch:
        """Decode a batch; ``keys`` and ``headers`` (per record, Kafka) where the item comes
        from the record key or a header."""
        if self.fmt == "msgpack" and len(values) >= 64 and self.spec.source == "value":
            if self._plain_direct:
                fast = self._decode_plain_direct(values)
                if fast is not None:
                    return fast
            fast = self._decode_msgpack_batch(values)
            if fast is not None:
                return fast
        return self.decode_each(values, keys, headers)

    def decode_each(self, values, keys=None, headers=None) -> DecodedBatch:
        """The per-message path: each message decoded on its own, never raising for one
        message's sake (whatever a message makes the decoder do, it is ``undecodable``)."""
        out = DecodedBatch()
        append_item, append_bad = out.items.append, out.rejected.append
        plain = self.spec.source == "value"
        for i, raw in enumerate(values):
            try:
                if plain:
                    item, reason = self.decode_one(raw)
                else:
                    item, reason = self.decode_one(
                        raw,
                        None if keys is None else keys[i],
                        None if headers is None else headers[i],
                    )
            except Exception:
                item, reason = None, "undecodable"
            if reason is None:
                append_item(item)
            else:
                append_bad((i, reason))
        return out
