"""Keyed 64-bit hashing of items into buckets, vectorized (SipHash-2-4).

The hashed state maps an item x to counter ``siphash24(key, canonical_bytes(x)) mod B``. The key
fixes the item -> counter map; it is not secret for privacy (the noise, not the map, protects
events) and is stored in snapshots so that a restored state keeps counting into the same buckets.
A keyed PRF rather than a fixed hash keeps an adversary who does not know the key from crafting
many items that collide in one bucket.

Item encoding (:func:`canonical_bytes`): ``str`` is UTF-8, ``bytes`` as is, ``int`` (any size) as
its decimal ASCII form (so the JSON item ``"42"`` and the msgpack item ``42`` are the same item),
and then trailing NUL bytes are dropped. Dropping them keeps the map the one that numpy
fixed-width strings gave from the start (numpy ``S``/``U`` arrays cannot hold trailing NULs), so
existing snapshots keep their buckets. The price is a deliberate collision class: ``b"a"``,
``b"a\\x00"`` and ``"a\\x00\\x00"`` are one item and share a counter, and anyone can craft such
pairs without the key. That costs accuracy for those items only; privacy does not depend on the
map. NULs inside an item are significant.

Timing: the work for a batch is the sum of each item's own work (its UTF-8 encoding and its
``len // 8 + 1`` SipHash message words), never the batch size times its longest or least ASCII
item, so one event changes the time to count its batch by about its own length, not by a
multiple of the batch (docs/hash_timing.md). Rows are hashed longest first, so the rows still
running at word ``b`` are a prefix and each step touches only them; the last few long rows finish
in plain Python, where a word costs a few microseconds instead of one numpy call per operation.

References
----------
Aumasson, Bernstein. SipHash: a fast short-input PRF. INDOCRYPT 2012.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

__all__ = [
    "KEY_BYTES",
    "canonical_bytes",
    "encode_items",
    "siphash24",
    "siphash24_scalar",
    "bucket_of",
]

KEY_BYTES = 16
_MASK = (1 << 64) - 1
_INIT = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)
# At most this many rows still running finish word by word in Python (~2-3 us a word each): a
# numpy step costs ~30 us whatever its row count (about 60 calls); the two cross near 12-16 rows
# (``python -m bench.service.hash_timing --crossover``).
_SCALAR_ROWS = 12


def _check_key(key: bytes) -> tuple[int, int]:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"hash key must be {KEY_BYTES} bytes")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


# -- item encoding ---------------------------------------------------------------------------------
def _encode_one(x) -> bytes:
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, bytes):
        return bytes(x)
    if isinstance(x, int) and not isinstance(x, bool):
        return b"%d" % x
    raise TypeError(f"items must be str, bytes or int, got {type(x).__name__}")


def canonical_bytes(item) -> bytes:
    """The bytes an item is hashed as (scalar reference of the batch encoding)."""
    try:
        return _encode_one(item).rstrip(b"\x00")
    except UnicodeEncodeError:
        raise ValueError("str item has no UTF-8 form (lone surrogate)") from None


def _encoded(items) -> list[bytes]:
    """UTF-8 / as-is / decimal bytes of each item: the same calls per item whatever its content,
    so a non-ASCII or NUL-containing item costs its own bytes and nothing for the others."""
    if isinstance(items, np.ndarray):
        if items.dtype.kind in "iu":
            return items.ravel().astype(np.bytes_).tolist()  # decimal ASCII, in C
        if items.dtype.kind not in "USO":
            raise TypeError(f"items must be str, bytes or int, got array of {items.dtype}")
        items = items.ravel().tolist()
    elif not isinstance(items, list):
        items = list(items)
    kinds = set(map(type, items))
    try:
        if kinds == {str}:
            return list(map(str.encode, items))
        if kinds == {bytes}:
            return items
        if kinds == {int}:
            return list(map(b"%d".__mod__, items))  # any size: 2**64 - 1 included
        return [_encode_one(x) for x in items]
    except UnicodeEncodeError:  # its message would quote the item: name only the problem
        raise ValueError("str item has no UTF-8 form (lone surrogate)") from None


def _canonical(items) -> list[bytes]:
    return list(map(bytes.rstrip, _encoded(items), repeat(b"\x00")))  # see the module docstring


def _flat(items) -> tuple[bytes, np.ndarray, np.ndarray]:
    """(buf, start, lengths): item i's canonical bytes are
    ``buf[start[i] : start[i] + lengths[i]]``; ``buf`` ends with 8 spare zero bytes so that every
    8-byte load from a row start stays inside."""
    enc = _canonical(items)
    lengths = np.array(list(map(len, enc)), dtype=np.int64)
    enc.append(bytes(8))
    return b"".join(enc), np.cumsum(lengths) - lengths, lengths


def encode_items(items) -> tuple[np.ndarray, np.ndarray]:
    """Items as a (rows, width) uint8 matrix (zero padded) and their byte lengths.

    Accepts a sequence of str / bytes / int (mixed is fine) or a numpy array of ints,
    bytes (``S``) or strings (``U``). The matrix is as wide as the longest item; :func:`bucket_of`
    does not build it (its cost would grow with the longest item times the batch).
    """
    enc = _canonical(items)
    lengths = np.array(list(map(len, enc)), dtype=np.int64)
    width = max(int(lengths.max()) if len(enc) else 0, 1)
    buf = bytearray(b"".join(map(bytes.ljust, enc, repeat(width), repeat(b"\x00"))))
    return np.frombuffer(buf, dtype=np.uint8).reshape(len(enc), width), lengths


# -- SipHash-2-4 -------------------------------------------------------------------------------
# In place on equal-length uint64 arrays; ``t`` is scratch of the same length.
def _rotl(x, b, t):
    np.left_shift(x, b, out=t)
    x >>= 64 - b
    x |= t


def _round(v0, v1, v2, v3, t):
    v0 += v1
    _rotl(v1, 13, t)
    v1 ^= v0
    _rotl(v0, 32, t)
    v2 += v3
    _rotl(v3, 16, t)
    v3 ^= v2
    v0 += v3
    _rotl(v3, 21, t)
    v3 ^= v0
    v2 += v1
    _rotl(v1, 17, t)
    v1 ^= v2
    _rotl(v2, 32, t)


def _compress(v0, v1, v2, v3, m, t):
    v3 ^= m
    _round(v0, v1, v2, v3, t)
    _round(v0, v1, v2, v3, t)
    v0 ^= m


def _init(k0: int, k1: int, rows: int):
    return (
        np.full(rows, k0 ^ _INIT[0], np.uint64),
        np.full(rows, k1 ^ _INIT[1], np.uint64),
        np.full(rows, k0 ^ _INIT[2], np.uint64),
        np.full(rows, k1 ^ _INIT[3], np.uint64),
    )


def _finish(v0, v1, v2, v3, t):
    v2 ^= np.uint64(0xFF)
    for _ in range(4):
        _round(v0, v1, v2, v3, t)
    return v0 ^ v1 ^ v2 ^ v3


def _round_py(v0, v1, v2, v3, M=_MASK):
    # rotations written out: this runs per word of every long row, and a call costs ~0.1 us
    v0 = (v0 + v1) & M
    v1 = (((v1 << 13) | (v1 >> 51)) & M) ^ v0
    v0 = ((v0 << 32) | (v0 >> 32)) & M
    v2 = (v2 + v3) & M
    v3 = (((v3 << 16) | (v3 >> 48)) & M) ^ v2
    v0 = (v0 + v3) & M
    v3 = (((v3 << 21) | (v3 >> 43)) & M) ^ v0
    v2 = (v2 + v1) & M
    v1 = (((v1 << 17) | (v1 >> 47)) & M) ^ v2
    v2 = ((v2 << 32) | (v2 >> 32)) & M
    return v0, v1, v2, v3


def _compress_py(v0, v1, v2, v3, m):
    v0, v1, v2, v3 = _round_py(v0, v1, v2, v3 ^ m)
    v0, v1, v2, v3 = _round_py(v0, v1, v2, v3)
    return v0 ^ m, v1, v2, v3


_LOW_BYTES = np.array([(1 << 8 * r) - 1 for r in range(8)], dtype=np.uint64)


def _sip_flat(k0: int, k1: int, buf: bytes, start: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """SipHash-2-4 of each ``buf[start[i] : start[i] + lengths[i]]`` (8 readable bytes past the
    last row start), reading message words straight from ``buf`` (no padded copy of the rows)."""
    rows = len(lengths)
    # element j of this view is the little-endian word buf[j : j + 8], aligned or not
    word_at = np.ndarray((len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))
    nw = (lengths >> 3) + 1  # message words per row, the last one holding the length byte
    longest = int(nw.max()) if rows else 1
    # longest first: the rows still absorbing at word b are then the prefix [0, running[b])
    gap = longest - nw
    order = np.argsort(gap.astype(np.uint16) if longest < 65536 else gap, kind="stable")
    nw, start, lengths = nw[order], start[order], lengths[order]
    keep = _LOW_BYTES[lengths & 7]  # the last word's own bytes; the rest belongs to the next row
    tail = (lengths.astype(np.uint64) & np.uint64(0xFF)) << np.uint64(56)
    running = rows - np.cumsum(np.bincount(nw, minlength=longest + 1))
    v0, v1, v2, v3 = _init(k0, k1, rows)
    t = np.empty(rows, np.uint64)
    b = 0
    with np.errstate(over="ignore"):
        while running[b] > _SCALAR_ROWS:
            c, ending = int(running[b]), int(running[b + 1])
            m = word_at[start[:c] + 8 * b].astype(np.uint64, copy=False)
            m[ending:] &= keep[ending:c]  # rows whose last word this is
            m[ending:] |= tail[ending:c]
            _compress(v0[:c], v1[:c], v2[:c], v3[:c], m, t[:c])
            b += 1
        for i in range(int(running[b])):  # the few long rows left, word by word
            s = int(v0[i]), int(v1[i]), int(v2[i]), int(v3[i])
            msg = word_at[start[i] + 8 * np.arange(b, nw[i])].tolist()
            msg[-1] = msg[-1] & int(keep[i]) | int(tail[i])
            for m in msg:
                s = _compress_py(*s, m)
            v0[i], v1[i], v2[i], v3[i] = s
        h = _finish(v0, v1, v2, v3, t)
    out = np.empty(rows, np.uint64)
    out[order] = h
    return out


def siphash24(key: bytes, mat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """SipHash-2-4 of each row ``mat[i, :lengths[i]]`` (``lengths[i] <= mat.shape[1]``)."""
    k0, k1 = _check_key(key)
    lengths = np.asarray(lengths, dtype=np.int64)
    rows, width = len(lengths), mat.shape[1]
    buf = np.ascontiguousarray(mat, dtype=np.uint8).tobytes() + bytes(8)
    return _sip_flat(k0, k1, buf, np.arange(rows, dtype=np.int64) * width, lengths)


def siphash24_scalar(key: bytes, data: bytes) -> int:
    """Reference scalar SipHash-2-4 (plain Python integers), used to check the vector path."""
    k0, k1 = _check_key(key)
    v = (k0 ^ _INIT[0], k1 ^ _INIT[1], k0 ^ _INIT[2], k1 ^ _INIT[3])
    full = len(data) // 8 * 8
    tail = data[full:] + bytes(8 - (len(data) - full))
    blocks = [int.from_bytes(data[i : i + 8], "little") for i in range(0, full, 8)]
    blocks.append(int.from_bytes(tail, "little") | ((len(data) & 0xFF) << 56))
    for m in blocks:
        v = _compress_py(*v, m)
    v0, v1, v2, v3 = v[0], v[1], v[2] ^ 0xFF, v[3]
    for _ in range(4):
        v0, v1, v2, v3 = _round_py(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def bucket_of(items, key: bytes, buckets: int) -> np.ndarray:
    """Bucket index in [0, buckets) of each item, as int64: ``siphash24_scalar(key,
    canonical_bytes(item)) % buckets``, for every str (valid Unicode), bytes and int."""
    k0, k1 = _check_key(key)
    buf, start, lengths = _flat(items)
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    return (_sip_flat(k0, k1, buf, start, lengths) % np.uint64(buckets)).astype(np.int64)
