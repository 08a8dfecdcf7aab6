"""Decode -> count: no input record can make decoding or counting raise, and every accepted item
lands in counter ``siphash24(key, canonical bytes) % B`` (hashed) or at its own index (direct).

Every case runs in both formats, in hashed and direct mode, through the per-message path (a
batch under 64 records) and the msgpack batch fast path (64+ records: 63 good records of the
same type plus the case, and 64 copies of the case). The canonical encoding is written out here
from its documentation (str -> UTF-8, bytes as is, int -> decimal ASCII, trailing NULs dropped),
not taken from aggregator.hashing, so a change of the map fails here.
"""

import json
import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.hashing import siphash24_scalar
from aggregator.state import PanPrivateHistogram
from consumers.decode import REASONS, Decoder

B = 64
MAX = 1024  # Decoder's default max_item_bytes
D_SMALL, D_BIG = 64, 2**63  # D_SMALL: a real direct state; D_BIG: the int64 edge of direct mode
MODES = ["hashed", "direct64", "direct2**63"]


def canonical(item) -> bytes:
    if isinstance(item, str):
        data = item.encode("utf-8")
    elif isinstance(item, bytes):
        data = item
    else:
        data = str(item).encode("ascii")
    return data.rstrip(b"\x00")  # documented: trailing NULs are not significant


def decoder(fmt: str, mode: str) -> Decoder:
    return Decoder(
        fmt, domain_size={"hashed": None, "direct64": D_SMALL, "direct2**63": D_BIG}[mode]
    )


def direct_reason(item, domain: int):
    if type(item) is not int:
        return "wrong_type"
    return None if 0 <= item < domain else "out_of_range"


# -- the table ---------------------------------------------------------------------------------
# (id, item, outcome in hashed mode: None = accepted, else the reason). Direct mode follows one
# rule (an int in [0, D), else out_of_range; not an int: wrong_type), see direct_reason.
OK, BIG, TYPE, UNDEC = None, "oversized", "wrong_type", "undecodable"
ITEMS = [
    ("int 0", 0, OK),
    ("int -1", -1, OK),
    ("int 63", 63, OK),
    ("int 64", 64, OK),
    ("int 2**31-1", 2**31 - 1, OK),
    ("int 2**31", 2**31, OK),
    ("int -2**31", -(2**31), OK),
    ("int -2**31-1", -(2**31) - 1, OK),
    ("int 2**32-1", 2**32 - 1, OK),
    ("int 2**32", 2**32, OK),
    ("int -2**32", -(2**32), OK),
    ("int 2**53+1", 2**53 + 1, OK),
    ("int 2**63-1", 2**63 - 1, OK),
    ("int 2**63", 2**63, OK),
    ("int 2**64-1", 2**64 - 1, OK),
    ("int -2**63", -(2**63), OK),
    ("int 2**64", 2**64, BIG),
    ("int -2**63-1", -(2**63) - 1, BIG),
    ("int 10**30", 10**30, BIG),
    ("int -10**30", -(10**30), BIG),
    ("float 1e308", 1e308, TYPE),
    ("float -0.0", -0.0, TYPE),
    ("float 0.5", 0.5, TYPE),
    ("float 1.0", 1.0, TYPE),
    ("float nan", math.nan, TYPE),
    ("float inf", math.inf, TYPE),
    ("float -inf", -math.inf, TYPE),
    ("bool true", True, TYPE),
    ("bool false", False, TYPE),
    ("null", None, TYPE),
    ("map", {"a": 1}, TYPE),
    ("empty map", {}, TYPE),
    ("list", [1, "a"], TYPE),
    ("empty list", [], TYPE),
    ("str empty", "", OK),
    ("str a", "a", OK),
    ("str é", "é", OK),
    ("str emoji", "\U0001f600", OK),
    ("str NUL", "\x00", OK),
    ("str trailing NUL", "a\x00", OK),
    ("str inner NUL", "a\x00b", OK),
    ("str leading NUL", "\x00a", OK),
    ("str 9 trailing NULs", "a" + "\x00" * 9, OK),
    ("str MAX ascii", "a" * MAX, OK),
    ("str MAX+1 ascii", "a" * (MAX + 1), BIG),
    ("str MAX with 2-byte end", "a" * (MAX - 2) + "é", OK),
    ("str MAX+1 with 2-byte end", "a" * (MAX - 1) + "é", BIG),  # MAX characters, MAX+1 bytes
    ("str MAX with 3-byte end", "a" * (MAX - 3) + "€", OK),
    ("str MAX+1 with 3-byte end", "a" * (MAX - 2) + "€", BIG),
    ("str MAX with 4-byte end", "a" * (MAX - 4) + "\U0001f600", OK),
    ("str MAX+1 with 4-byte end", "a" * (MAX - 3) + "\U0001f600", BIG),
    ("str MAX all 2-byte", "é" * (MAX // 2), OK),
    ("str MAX+1 all 2-byte", "é" * (MAX // 2) + "a", BIG),
    ("str MAX/4 chars of 2 bytes", "é" * (MAX // 4), OK),  # short enough for the fast path
    ("str MAX ending in NUL", "a" * (MAX - 1) + "\x00", OK),
    ("str lone high surrogate", "\ud800", UNDEC),
    ("str lone low surrogate", "a\udfff", UNDEC),
    ("bytes empty", b"", OK),
    ("bytes NUL", b"\x00", OK),
    ("bytes trailing NUL", b"a\x00", OK),
    ("bytes inner NUL", b"a\x00b", OK),
    ("bytes not UTF-8", b"\xff\xfe", OK),
    ("bytes 0..255", bytes(range(256)), OK),
    ("bytes MAX", b"x" * MAX, OK),
    ("bytes MAX NULs", b"\x00" * MAX, OK),
    ("bytes MAX+1", b"x" * (MAX + 1), BIG),
]


def msgpack_message(item) -> bytes | None:
    """{"item": item} as msgpack (bin for bytes); a lone surrogate as its raw (invalid UTF-8)
    bytes, the only way msgpack can carry it; None if msgpack cannot carry the item at all."""
    try:
        return msgpack.packb({"item": item}, use_bin_type=True)
    except OverflowError:
        return None  # ints outside [-2**63, 2**64)
    except UnicodeEncodeError:
        raw = item.encode("utf-8", "surrogatepass")
        return b"\x81\xa4item" + bytes([0xA0 | len(raw)]) + raw


def has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def json_messages(item) -> list[tuple[bytes, bool]]:
    """{"item": item} as JSON with \\u escapes and as raw UTF-8: (message, undecodable).
    JSON has no bytes; NaN/Infinity are written as Python's json writes them."""
    if isinstance(item, bytes):
        return []
    out = [(json.dumps({"item": item}).encode("ascii"), False)]
    if isinstance(item, str):  # a lone surrogate written raw is not UTF-8
        raw = json.dumps({"item": item}, ensure_ascii=False).encode("utf-8", "surrogatepass")
        out.append((raw, has_surrogate(item)))
    return out


def messages(fmt: str, item) -> list[tuple[bytes, bool]]:
    if fmt == "json":
        return json_messages(item)
    m = msgpack_message(item)
    return [] if m is None else [(m, isinstance(item, str) and has_surrogate(item))]


def _key(item):
    return type(item).__name__, repr(item)


HASHED = {_key(x): r for _, x, r in ITEMS}


def expected(item, mode: str, undecodable: bool):
    if undecodable:
        return UNDEC
    if mode == "hashed":
        return HASHED[_key(item)]
    return direct_reason(item, D_SMALL if mode == "direct64" else D_BIG)


def filler(item, mode: str, i: int):
    """A good record of the same type as ``item`` (ints for direct mode and non-item types)."""
    if mode == "hashed" and isinstance(item, str):
        return f"s{i}"
    if mode == "hashed" and isinstance(item, bytes):
        return b"b%d" % i
    return i


# -- checking ------------------------------------------------------------------------------------
def count_and_check(items, mode: str) -> None:
    """Count the decoded items as the service does, the whole batch and each item alone; each
    must land in its counter."""
    items = list(items)
    if mode == "hashed":
        state = PanPrivateHistogram(1.0, buckets=B)
        want = [siphash24_scalar(state.key, canonical(x)) % B for x in items]
        assert state.index_of(items).tolist() == want
    else:
        if mode == "direct2**63":  # no state that large: the service's conversion must hold
            assert np.asarray(items, dtype=np.int64).tolist() == items
            return
        state = PanPrivateHistogram(1.0, size=D_SMALL)
        want = items
    per_counter = np.bincount(np.asarray(want, dtype=np.int64), minlength=B)
    before = state.counts.copy()
    state.update(items)
    assert np.array_equal(state.counts - before, per_counter)
    for x, w in zip(items, want):
        before = state.counts.copy()
        state.update([x])
        delta = state.counts - before
        assert delta[w] == 1 and delta.sum() == 1
    if mode == "direct64":  # the service's direct path
        before = state.counts.copy()
        state.add_indices(np.asarray(items, dtype=np.int64))
        assert np.array_equal(state.counts - before, per_counter)


def plain(items) -> list:
    """The direct-mode fast path returns an int64 array: compare its values as Python ints."""
    if isinstance(items, np.ndarray):
        assert items.dtype == np.int64
        return items.tolist()
    return list(items)


def check_batch(dec: Decoder, mode: str, values: list, outcomes: list) -> None:
    """``outcomes[i]``: ("ok", item) or the reason record i must be rejected with."""
    batch = dec.decode(values)
    rejected = dict(batch.rejected)
    assert len(rejected) == len(batch.rejected)
    items = plain(batch.items)
    assert len(items) + len(rejected) == len(values)
    accepted = iter(items)
    for i, want in enumerate(outcomes):
        if isinstance(want, tuple):
            assert i not in rejected, (i, rejected.get(i))
            got = next(accepted)
            assert got == want[1] and type(got) is type(want[1])
        else:
            assert rejected.get(i) == want
    count_and_check(items, mode)


def outcome(item, reason):
    return ("ok", item) if reason is None else reason


CASES = [
    pytest.param(fmt, mode, item, id=f"{fmt}-{mode}-{id_}")
    for fmt in ("msgpack", "json")
    for mode in MODES
    for id_, item, _ in ITEMS
]


@pytest.mark.parametrize("fmt,mode,item", CASES)
def test_boundary_item_per_message(fmt, mode, item):
    dec = decoder(fmt, mode)
    for raw, undecodable in messages(fmt, item):
        want = expected(item, mode, undecodable)
        assert dec.decode_one(raw)[1] == want
        check_batch(dec, mode, [raw], [outcome(item, want)])


@pytest.mark.parametrize("fmt,mode,item", CASES)
def test_boundary_item_in_batch(fmt, mode, item):
    dec = decoder(fmt, mode)
    encode = msgpack_message if fmt == "msgpack" else (lambda x: json.dumps({"item": x}).encode())
    for raw, undecodable in messages(fmt, item):
        want = outcome(item, expected(item, mode, undecodable))
        good = [filler(item, mode, i) for i in range(63)]
        check_batch(
            dec, mode, [encode(x) for x in good] + [raw], [("ok", x) for x in good] + [want]
        )
        check_batch(dec, mode, [raw] * 64, [want] * 64)
        check_batch(
            dec, mode, [raw] + [encode(x) for x in good], [want] + [("ok", x) for x in good]
        )


def test_fast_path_serves_the_uint64_batch(monkeypatch):
    """The poison batch goes through the msgpack fast path (no per-message decoding) and counts."""
    dec = Decoder("msgpack")
    monkeypatch.setattr(dec, "decode_one", lambda raw: pytest.fail("fast path not taken"))
    for items in (list(range(63)) + [2**63], [2**64 - 1] * 64, [-(2**63)] * 64):
        batch = dec.decode([msgpack.packb({"item": x}) for x in items])
        assert batch.rejected == [] and list(batch.items) == items
        count_and_check(batch.items, "hashed")


@pytest.mark.parametrize(
    "long_item",
    [
        "a" * MAX,
        "é" * (MAX // 2),
        "a" * (MAX - 4) + "\U0001f600",
        "\U0001f600" * (MAX // 4),
        b"x" * MAX,
    ],
)
def test_fast_path_keeps_a_batch_with_one_long_valid_item(monkeypatch, long_item):
    """One long but valid item must not send its whole batch down the per-message path (its
    time would tell the item's length, not just its own bytes)."""
    dec = Decoder("msgpack")
    monkeypatch.setattr(dec, "decode_one", lambda raw: pytest.fail("fast path not taken"))
    items = [f"s{i}" if isinstance(long_item, str) else b"b%d" % i for i in range(63)] + [long_item]
    batch = dec.decode([msgpack.packb({"item": x}, use_bin_type=True) for x in items])
    assert batch.rejected == [] and batch.items == items
    count_and_check(batch.items, "hashed")


@pytest.mark.parametrize(
    "too_long", ["a" * (MAX + 1), "a" * (MAX - 1) + "é", "é" * (MAX // 2 + 1), b"x" * (MAX + 1)]
)
def test_fast_path_hands_an_oversized_item_to_the_per_message_path(too_long):
    items = [f"s{i}" for i in range(63)] + [too_long]
    batch = Decoder("msgpack").decode(
        [msgpack.packb({"item": x}, use_bin_type=True) for x in items]
    )
    assert batch.rejected == [(63, "oversized")] and batch.items == items[:63]


def test_msgpack_str_and_bin_are_the_same_item():
    dec = Decoder("msgpack")
    s = dec.decode([msgpack.packb({"item": "abc"}, use_bin_type=True)]).items
    b = dec.decode([msgpack.packb({"item": b"abc"}, use_bin_type=True)]).items
    assert s == ["abc"] and b == [b"abc"]
    state = PanPrivateHistogram(1.0, buckets=2**20)
    assert state.index_of(s)[0] == state.index_of(b)[0] == state.index_of(["abc"])[0]


# -- whole messages that are not {"item": x} ------------------------------------------------------
DIGITS = b"9" * 5000  # past Python's int parse limit (4300 digits)
NEST = 30_000
RAW = [  # (id, format, message value, hashed outcome, direct (D = 64) outcome)
    ("None value", "both", None, UNDEC, UNDEC),
    ("empty message", "both", b"", UNDEC, UNDEC),
    ("str value", "both", '{"item": 1}', UNDEC, UNDEC),
    ("NUL byte", "json", b"\x00", UNDEC, UNDEC),
    ("NUL byte", "msgpack", b"\x00", "not_a_map", "not_a_map"),  # msgpack's int 0
    ("too long", "both", b"\x00" * 70_000, BIG, BIG),
    ("JSON not UTF-8", "json", b'{"item": "caf\xe9"}', UNDEC, UNDEC),
    ("JSON BOM", "json", b'\xef\xbb\xbf{"item": "a"}', UNDEC, UNDEC),
    ("JSON UTF-16", "json", '{"item": "a"}'.encode("utf-16"), UNDEC, UNDEC),
    ("JSON trailing garbage", "json", b'{"item": 1} x', UNDEC, UNDEC),
    ("JSON two documents", "json", b'{"item": 1}{"item": 2}', UNDEC, UNDEC),
    ("JSON trailing NUL", "json", b'{"item": 1}\x00', UNDEC, UNDEC),
    ("JSON NaN", "json", b'{"item": NaN}', TYPE, TYPE),
    ("JSON Infinity", "json", b'{"item": Infinity}', TYPE, TYPE),
    ("JSON -Infinity", "json", b'{"item": -Infinity}', TYPE, TYPE),
    ("JSON -0.0", "json", b'{"item": -0.0}', TYPE, TYPE),
    ("JSON 1e400", "json", b'{"item": 1e400}', TYPE, TYPE),
    ("JSON 1e-400", "json", b'{"item": 1e-400}', TYPE, TYPE),
    ("JSON 1.0", "json", b'{"item": 1.0}', TYPE, TYPE),
    ("JSON 5000-digit int", "json", b'{"item": ' + DIGITS + b"}", BIG, "out_of_range"),
    ("JSON -5000-digit int", "json", b'{"item": -' + DIGITS + b"}", BIG, "out_of_range"),
    (
        "JSON 5000-digit int elsewhere",
        "json",
        b'{"item": 3, "n": ' + DIGITS + b"}",
        ("ok", 3),
        ("ok", 3),
    ),
    ("JSON 5000-digit float", "json", b'{"item": ' + DIGITS + b".5}", TYPE, TYPE),
    ("JSON duplicate keys", "json", b'{"item": 1, "item": "b"}', ("ok", "b"), TYPE),
    ("JSON duplicate keys, int last", "json", b'{"item": "b", "item": 5}', ("ok", 5), ("ok", 5)),
    ("JSON \\u0000 at the end", "json", b'{"item": "a\\u0000"}', ("ok", "a\x00"), TYPE),
    ("JSON raw NUL in string", "json", b'{"item": "a\x00"}', UNDEC, UNDEC),  # control char
    (
        "JSON escaped surrogate pair",
        "json",
        b'{"item": "\\ud83d\\ude00"}',
        ("ok", "\U0001f600"),
        TYPE,
    ),
    ("JSON array", "json", b"[1]", "not_a_map", "not_a_map"),
    ("JSON number", "json", b"1", "not_a_map", "not_a_map"),
    ("JSON null", "json", b"null", "not_a_map", "not_a_map"),
    ("JSON no item", "json", b'{"x": 1}', "missing_item", "missing_item"),
    ("JSON deep nesting", "json", b'{"item": ' + b"[" * NEST + b"]" * NEST + b"}", UNDEC, UNDEC),
    ("msgpack trailing garbage", "msgpack", msgpack.packb({"item": 1}) + b"\x00", UNDEC, UNDEC),
    ("msgpack two objects", "msgpack", msgpack.packb({"item": 1}) * 2, UNDEC, UNDEC),
    ("msgpack truncated", "msgpack", msgpack.packb({"item": "abc"})[:-1], UNDEC, UNDEC),
    ("msgpack reserved byte", "msgpack", b"\xc1", UNDEC, UNDEC),
    ("msgpack str not UTF-8", "msgpack", b"\x81\xa4item\xa2\xff\xfe", UNDEC, UNDEC),
    ("msgpack ext type", "msgpack", msgpack.packb({"item": msgpack.ExtType(5, b"x")}), TYPE, TYPE),
    ("msgpack timestamp", "msgpack", msgpack.packb({"item": msgpack.Timestamp(1, 5)}), TYPE, TYPE),
    ("msgpack bad timestamp", "msgpack", b"\x81\xa4item\xc7\x03\xffxyz", UNDEC, UNDEC),
    ("msgpack float32", "msgpack", b"\x81\xa4item\xca" + struct.pack(">f", 1.5), TYPE, TYPE),
    ("msgpack nil", "msgpack", msgpack.packb({"item": None}), TYPE, TYPE),
    (
        "msgpack bin key",
        "msgpack",
        msgpack.packb({b"item": 1}, use_bin_type=True),
        "missing_item",
        "missing_item",
    ),
    ("msgpack int key", "msgpack", msgpack.packb({1: 1}), "missing_item", "missing_item"),
    ("msgpack list key", "msgpack", b"\x81\x91\x01\x01", UNDEC, UNDEC),
    ("msgpack duplicate keys", "msgpack", b"\x82\xa4item\x01\xa4item\xa1b", ("ok", "b"), TYPE),
    ("msgpack array", "msgpack", msgpack.packb([1]), "not_a_map", "not_a_map"),
    ("msgpack deep nesting", "msgpack", b"\x81\xa4item" + b"\x91" * 5000 + b"\x01", UNDEC, UNDEC),
    (
        "msgpack uint64 max",
        "msgpack",
        b"\x81\xa4item\xcf" + b"\xff" * 8,
        ("ok", 2**64 - 1),
        "out_of_range",
    ),
]
RAW_CASES = [
    pytest.param(fmt, mode, raw, (h if mode == "hashed" else d), id=f"{fmt}-{mode}-{id_}")
    for id_, where, raw, h, d in RAW
    for fmt in ("msgpack", "json")
    if where in ("both", fmt)
    for mode in ("hashed", "direct64")
]


@pytest.mark.parametrize("fmt,mode,raw,want", RAW_CASES)
def test_raw_message(fmt, mode, raw, want):
    dec = decoder(fmt, mode)
    item, reason = dec.decode_one(raw)
    assert (("ok", item) if reason is None else reason) == want
    check_batch(dec, mode, [raw], [want])
    check_batch(dec, mode, [raw] * 64, [want] * 64)
    good = [f"s{i}" if mode == "hashed" else i for i in range(63)]
    enc = msgpack.packb if fmt == "msgpack" else (lambda x: json.dumps(x).encode())
    check_batch(
        dec, mode, [enc({"item": x}) for x in good] + [raw], [("ok", x) for x in good] + [want]
    )


def test_error_reasons_are_the_documented_ones():
    assert set(REASONS) == {
        "oversized",
        "undecodable",
        "not_a_map",
        "missing_item",
        "wrong_type",
        "out_of_range",
    }


# -- arbitrary mixed batches ---------------------------------------------------------------------
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-(2**64), 2**65),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(exclude_categories=()), max_size=20),
    st.text(max_size=600),
    st.sampled_from([x for _, x, _ in ITEMS if len(repr(x)) < 40]),
)
MSGPACK_ONLY = st.one_of(
    st.binary(max_size=40),
    st.binary(min_size=1000, max_size=1100),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=5)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**34), st.integers(0, 999_999_999)),
)


def values(extra):
    def nest(c):
        return st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3)

    return st.recursive(st.one_of(SCALARS, extra), nest, max_leaves=6)


def records(extra):
    v = values(extra)
    return st.one_of(
        st.fixed_dictionaries({"item": v}, optional={"x": v}),
        v,
        st.binary(max_size=30).map(lambda b: ("raw", b)),
        st.just(("raw", None)),
    )


BOUNDARY_INTS = st.sampled_from([x for _, x, _ in ITEMS if type(x) is int])
ITEM_KINDS = [
    st.integers() | BOUNDARY_INTS | st.integers(-(2**63), 2**64 - 1),
    st.text(st.characters(exclude_categories=()), max_size=30) | st.text(max_size=1100),
    st.binary(max_size=1100),
]


def same_kind_batches(extra):
    """Batches whose items are of one kind (the case the vectorized paths take), with a little
    garbage mixed in."""
    return st.sampled_from(ITEM_KINDS).flatmap(
        lambda kind: st.lists(
            st.one_of(st.fixed_dictionaries({"item": kind}), records(extra)), max_size=130
        ).filter(lambda recs: sum(isinstance(r, dict) for r in recs) >= 0.8 * len(recs))
    )


def accepts(item, mode: str) -> bool:
    if mode == "direct64":
        return type(item) is int and 0 <= item < D_SMALL
    if type(item) is int:
        return -(2**63) <= item < 2**64
    if isinstance(item, str):
        try:
            return len(item.encode("utf-8")) <= MAX
        except UnicodeEncodeError:
            return False
    return isinstance(item, bytes) and len(item) <= MAX


GARBAGE = object()


def mixed_batch_check(fmt: str, recs: list) -> None:
    raws, docs = [], []
    for rec in recs:
        if isinstance(rec, tuple):
            raws.append(rec[1])
            docs.append(GARBAGE)  # any outcome, as long as nothing raises
            continue
        try:
            raw = (
                msgpack.packb(rec, use_bin_type=True)
                if fmt == "msgpack"
                else json.dumps(rec).encode()
            )
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError):
            continue  # not representable in this format
        raws.append(raw)
        docs.append(rec)
    for mode in ("hashed", "direct64"):
        dec = decoder(fmt, mode)
        batch = dec.decode(raws)
        rejected = dict(batch.rejected)
        assert set(rejected.values()) <= set(REASONS)
        items = iter(plain(batch.items))
        for i, doc in enumerate(docs):
            if doc is GARBAGE:
                if i not in rejected:
                    next(items)
            elif not isinstance(doc, dict):
                assert rejected.get(i) == "not_a_map"
            elif "item" not in doc:
                assert rejected.get(i) == "missing_item"
            else:
                ok = accepts(doc["item"], mode) and len(raws[i]) <= dec.max_message_bytes
                assert (i not in rejected) == ok, (fmt, mode, i, rejected.get(i))
                if ok:
                    got = next(items)
                    assert got == doc["item"] and type(got) is type(doc["item"])
        assert next(items, GARBAGE) is GARBAGE
        count_and_check(batch.items, mode)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(records(MSGPACK_ONLY), max_size=130) | same_kind_batches(MSGPACK_ONLY))
def test_mixed_msgpack_batches_never_raise(recs):
    mixed_batch_check("msgpack", recs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(records(st.nothing()), max_size=130) | same_kind_batches(st.nothing()))
def test_mixed_json_batches_never_raise(recs):
    mixed_batch_check("json", recs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=200), st.binary(max_size=200)),
        min_size=64,
        max_size=130,
    )
)
def test_good_msgpack_batches_take_the_fast_path_and_count(items):
    dec = Decoder("msgpack")
    batch = dec.decode([msgpack.packb({"item": x}, use_bin_type=True) for x in items])
    assert batch.rejected == [] and list(batch.items) == items
    count_and_check(batch.items, "hashed")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.integers(0, 2**64 - 1)
        | st.integers(0, 127)
        | st.integers(-40, 200)
        | st.sampled_from([None, True, 1.5, "7", b"7", 2**63 - 1, 2**63]),
        min_size=64,
        max_size=130,
    ),
    st.sampled_from([D_SMALL, 100_000, D_BIG]),
    st.integers(-1, 129),
    st.sampled_from([b"", b"\x00", b"\x81", b"\x01"]),
)
def test_plain_direct_batches_agree_with_per_message_decoding(items, domain, at, extra):
    """Direct mode's numpy path for {"item": <uint>} batches: the same items and reasons as
    decoding each message, whatever the ints, their encodings, a broken or extended message."""
    dec = Decoder("msgpack", domain_size=domain)
    raws = [msgpack.packb({"item": x}) for x in items]
    if 0 <= at < len(raws):
        raws[at] = raws[at] + extra if extra != b"\x81" else raws[at][:-1]
    batch, each = dec.decode(raws), dec.decode_each(raws)
    assert batch.rejected == each.rejected
    assert plain(batch.items) == plain(each.items)


def test_plain_direct_batches_skip_the_object_path(monkeypatch):
    dec = Decoder("msgpack", domain_size=100_000)
    monkeypatch.setattr(dec, "_decode_msgpack_batch", lambda v: pytest.fail("numpy path not taken"))
    items = [0, 127, 128, 255, 256, 65535, 65536, 99_999, 100_000, 2**32, 2**63 - 1] * 8
    batch = dec.decode([msgpack.packb({"item": x}) for x in items])
    assert plain(batch.items) == [x for x in items if x < 100_000]
    assert batch.rejected == [(i, "out_of_range") for i, x in enumerate(items) if x >= 100_000]
