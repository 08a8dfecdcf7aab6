"""Keyed 64-bit hashing of items into buckets, vectorized (SipHash-2-4).

The hashed state maps an item x to counter ``siphash24(key, canonical_bytes(x)) mod B``. The key
fixes the item -> counter map; it is not secret for privacy (the noise, not the map, protects events) and is
stored in snapshots so that a restored state keeps counting into the same buckets. A keyed PRF
rather than a fixed hash keeps an adversary who does not know the key from crafting many items
that collide in one bucket.

Item encoding (:func:`canonical_bytes`): ``str`` is UTF-8, ``bytes`` as is, ``int`` (any size) as
its decimal ASCII form (so the JSON item ``"42"`` and the msgpack item ``42`` are the same item),
and then trailing NUL bytes are dropped. Dropping them keeps the map the one that numpy
fixed-width strings gave from the start (numpy ``S``/``U`` arrays cannot hold trailing NULs), so
existing snapshots keep their buckets. The price is a deliberate collision class: ``b"a"``,
``b"a\\x00"`` and ``"a\\x00\\x00"`` are one item and share a counter, and anyone can craft such
pairs without the key. That costs accuracy for those items only; privacy does not depend on the
map. NULs inside an item are significant.

The whole batch is hashed at once: items become a fixed-width byte matrix, and SipHash's rounds
run as uint64 array operations over the rows, one 8-byte column at a time.

References
----------
Aumasson, Bernstein. SipHash: a fast short-input PRF. INDOCRYPT 2012.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KEY_BYTES", "canonical_bytes", "encode_items", "siphash24", "siphash24_scalar",
           "bucket_of"]

KEY_BYTES = 16
_MASK = (1 << 64) - 1


def _rotl(x: np.ndarray, b: int) -> np.ndarray:
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


def _sipround(v0, v1, v2, v3):
    v0 += v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 += v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 += v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def _check_key(key: bytes) -> tuple[int, int]:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"hash key must be {KEY_BYTES} bytes")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


def canonical_bytes(item) -> bytes:
    """The bytes an item is hashed as (scalar reference of :func:`encode_items`)."""
    if isinstance(item, str):
        try:
            data = item.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(_NO_UTF8) from None
    elif isinstance(item, bytes):
        data = bytes(item)
    elif isinstance(item, int) and not isinstance(item, bool):
        data = b"%d" % item
    else:
        raise TypeError(f"items must be str, bytes or int, got {type(item).__name__}")
    return data.rstrip(b"\x00")


_NO_UTF8 = "str item has no UTF-8 form (lone surrogate)"


def encode_items(items) -> tuple[np.ndarray, np.ndarray]:
    """Items as a (rows, width) uint8 matrix (zero padded) and their byte lengths.

    Accepts a sequence of str / bytes / int (mixed is fine; ints of any size) or a numpy array
    of ints, bytes (``S``) or strings (``U``).
    """
    try:
        return _encode_items(items)
    except UnicodeEncodeError:  # its message would quote the item: name only the problem
        raise ValueError(_NO_UTF8) from None


def _int64_or_none(items):
    try:
        return np.asarray(items, dtype=np.int64)
    except OverflowError:  # past int64, e.g. a msgpack uint64 >= 2**63: the generic path
        return None


def _encode_items(items):
    arr = items if isinstance(items, np.ndarray) else None
    if arr is None:
        items = list(items)
        kinds = set(map(type, items))
        if kinds == {int} and (arr := _int64_or_none(items)) is not None:
            pass
        elif kinds == {bytes}:
            arr = np.asarray(items, dtype=np.bytes_)
        elif kinds == {str}:
            arr = np.asarray(items, dtype=np.str_)  # one C loop; encoded below
        else:
            for x in items:
                if not isinstance(x, (str, bytes, int)) or isinstance(x, bool):
                    raise TypeError(f"items must be str, bytes or int, got {type(x).__name__}")
            enc = [x.encode("utf-8") if isinstance(x, str) else
                   (x if isinstance(x, bytes) else b"%d" % x) for x in items]
            arr = np.asarray(enc, dtype=np.bytes_) if enc else np.zeros(0, dtype="S1")
    if arr.dtype.kind in "iu":
        arr = arr.astype(np.bytes_)  # decimal ASCII, vectorized in C
    elif arr.dtype.kind == "U":
        codes = arr.view(np.uint32).reshape(len(arr), -1) if arr.size else np.zeros((0, 1), np.uint32)
        if codes.size and int(codes.max()) < 128:
            # ASCII: UTF-8 bytes are the code points; no per-item encode call
            mat = np.ascontiguousarray(codes.astype(np.uint8))
            lengths = np.count_nonzero(mat, axis=1).astype(np.int64)
            zero = mat == 0
            if np.any(zero[:, :-1] & ~zero[:, 1:]):  # a NUL before a character
                arr = np.strings.encode(arr, "utf-8")  # embedded NULs: take the exact path
            else:
                return mat, lengths
        else:
            arr = np.strings.encode(arr, "utf-8")
    elif arr.dtype.kind != "S":
        raise TypeError(f"items must be str, bytes or int, got array of {arr.dtype}")
    arr = np.ascontiguousarray(arr.ravel())
    width = max(arr.dtype.itemsize, 1)
    mat = arr.view(np.uint8).reshape(len(arr), width) if len(arr) else np.zeros((0, width), np.uint8)
    lengths = np.strings.str_len(arr).astype(np.int64) if len(arr) else np.zeros(0, np.int64)
    return mat, lengths


def siphash24(key: bytes, mat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """SipHash-2-4 of each row ``mat[i, :lengths[i]]`` (rows zero padded past their length)."""
    k0, k1 = _check_key(key)
    rows = mat.shape[0]
    n_full = lengths // 8  # full 8-byte blocks per row
    blocks = int(n_full.max()) + 1 if rows else 1
    width = blocks * 8
    padded = np.zeros((rows, width), dtype=np.uint8)
    padded[:, : min(mat.shape[1], width)] = mat[:, :width]
    words = padded.view("<u8").astype(np.uint64, copy=False)  # (rows, blocks)
    u = np.uint64
    v0 = np.full(rows, u(k0 ^ 0x736F6D6570736575))
    v1 = np.full(rows, u(k1 ^ 0x646F72616E646F6D))
    v2 = np.full(rows, u(k0 ^ 0x6C7967656E657261))
    v3 = np.full(rows, u(k1 ^ 0x7465646279746573))
    last = (lengths.astype(np.uint64) & u(0xFF)) << u(56)
    with np.errstate(over="ignore"):
        for b in range(blocks):
            # Rows with a full block here absorb it; the row whose tail block this is absorbs
            # the tail (zero padded already) with the length byte; longer-done rows are idle.
            is_full = n_full > b
            is_tail = n_full == b
            active = is_full | is_tail
            if not active.any():
                break
            m = words[:, b] | np.where(is_tail, last, u(0))
            n0, n1, n2, n3 = v0.copy(), v1.copy(), v2.copy(), v3 ^ m
            n0, n1, n2, n3 = _sipround(n0, n1, n2, n3)
            n0, n1, n2, n3 = _sipround(n0, n1, n2, n3)
            n0 ^= m
            v0 = np.where(active, n0, v0)
            v1 = np.where(active, n1, v1)
            v2 = np.where(active, n2, v2)
            v3 = np.where(active, n3, v3)
        v2 ^= u(0xFF)
        for _ in range(4):
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def siphash24_scalar(key: bytes, data: bytes) -> int:
    """Reference scalar SipHash-2-4 (plain Python integers), used to check the vector path."""
    k0, k1 = _check_key(key)

    def rotl(x, b):
        return ((x << b) | (x >> (64 - b))) & _MASK

    def rnd(v0, v1, v2, v3):
        v0 = (v0 + v1) & _MASK; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32)  # noqa: E702
        v2 = (v2 + v3) & _MASK; v3 = rotl(v3, 16); v3 ^= v2  # noqa: E702
        v0 = (v0 + v3) & _MASK; v3 = rotl(v3, 21); v3 ^= v0  # noqa: E702
        v2 = (v2 + v1) & _MASK; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32)  # noqa: E702
        return v0, v1, v2, v3

    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573
    full = len(data) // 8 * 8
    tail = data[full:] + bytes(8 - (len(data) - full))
    blocks = [int.from_bytes(data[i:i + 8], "little") for i in range(0, full, 8)]
    blocks.append(int.from_bytes(tail, "little") | ((len(data) & 0xFF) << 56))
    for m in blocks:
        v3 ^= m
        v0, v1, v2, v3 = rnd(v0, v1, v2, v3)
        v0, v1, v2, v3 = rnd(v0, v1, v2, v3)
        v0 ^= m
    v2 ^= 0xFF
    for _ in range(4):
        v0, v1, v2, v3 = rnd(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def bucket_of(items, key: bytes, buckets: int) -> np.ndarray:
    """Bucket index in [0, buckets) of each item, as int64."""
    mat, lengths = encode_items(items)
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    return (siphash24(key, mat, lengths) % np.uint64(buckets)).astype(np.int64)
