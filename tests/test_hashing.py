"""SipHash-2-4: reference vectors, vector path == scalar path, item encoding."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.hashing import bucket_of, canonical_bytes, encode_items, siphash24, siphash24_scalar

KEY = bytes(range(16))


def scalar_hashes(items):
    return [siphash24_scalar(KEY, canonical_bytes(x)) for x in items]


def vector_hashes(items):
    return [int(h) for h in siphash24(KEY, *encode_items(items))]


def test_reference_vectors():
    # Aumasson-Bernstein reference: key 00..0f, message 00 01 .. (len-1)
    assert siphash24_scalar(KEY, b"") == 0x726FDB47DD0E0E31
    assert siphash24_scalar(KEY, bytes(range(15))) == 0xA129CA6149BE45E5


def test_vector_path_matches_scalar_for_all_lengths():
    items = [bytes(range(1, i + 1)) for i in range(0, 70)]  # no trailing NUL
    mat, lengths = encode_items(items)
    got = siphash24(KEY, mat, lengths)
    assert [int(g) for g in got] == [siphash24_scalar(KEY, x) for x in items]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=20))
def test_vector_path_matches_scalar_on_text(texts):
    mat, lengths = encode_items(texts)
    got = siphash24(KEY, mat, lengths)
    assert [int(g) for g in got] == scalar_hashes(texts)


ITEMS = st.one_of(st.text(max_size=300), st.binary(max_size=300), st.integers(),
                  st.integers(-(2**63), 2**64 - 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(ITEMS, max_size=80))
def test_mixed_batches_match_the_scalar_reference(items):
    got = bucket_of(items, KEY, 97)
    assert got.tolist() == [h % 97 for h in scalar_hashes(items)]


def test_ints_past_int64_hash_as_their_decimal_form():
    # 2**63 <= n < 2**64 is a valid msgpack uint64; an all-int batch holding one used to raise
    # OverflowError (numpy int64), so a single such event stopped the service on every restart
    ints = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 2**64, -(2**63) - 1, 10**40]
    got = bucket_of(ints, KEY, 2**20)
    assert got.tolist() == [h % 2**20 for h in scalar_hashes(ints)]
    assert got.tolist() == bucket_of([str(n) for n in ints], KEY, 2**20).tolist()
    poison = bucket_of(list(range(63)) + [2**63], KEY, 64)[-1]
    assert poison == siphash24_scalar(KEY, b"9223372036854775808") % 64
    big = np.array([2**63, 2**64 - 1], dtype=np.uint64)
    assert bucket_of(big, KEY, 97).tolist() == bucket_of([2**63, 2**64 - 1], KEY, 97).tolist()


def test_trailing_nuls_are_not_significant_everywhere():
    # documented collision: numpy fixed-width strings cannot hold trailing NULs, and the map
    # stays the one they gave; NULs inside an item still count
    same = [b"a", b"a\x00", b"a\x00\x00\x00\x00\x00\x00\x00\x00\x00", "a\x00", "a", np.bytes_(b"a")]
    assert len(set(bucket_of(same, KEY, 2**30).tolist())) == 1
    assert canonical_bytes(b"a\x00\x00") == canonical_bytes("a") == b"a"
    assert canonical_bytes(b"\x00\x00") == b"" and canonical_bytes(0) == b"0"
    assert bucket_of([b"\x00" * 20], KEY, 2**30)[0] == bucket_of([b""], KEY, 2**30)[0]
    assert bucket_of([b"a\x00b"], KEY, 2**30)[0] != bucket_of([b"ab"], KEY, 2**30)[0]
    assert np.array_equal(bucket_of(np.array([b"a\x00", b"\x00b"]), KEY, 97),
                          bucket_of([b"a", b"\x00b"], KEY, 97))
    nul_items = ["a\x00", "\x00", "é\x00", b"\x00a\x00", "x" * 9 + "\x00" * 9]
    assert vector_hashes(nul_items) == scalar_hashes(nul_items)
    assert vector_hashes(nul_items) == [siphash24_scalar(KEY, s.rstrip("\x00").encode() if isinstance(s, str)
                                                         else s.rstrip(b"\x00")) for s in nul_items]


def test_int_str_bytes_encode_alike_and_arrays_work():
    b = bucket_of([7, "7", b"7"], KEY, 10**9)
    assert b[0] == b[1] == b[2]
    assert np.array_equal(bucket_of(np.array([1, 2, 3]), KEY, 97), bucket_of(["1", "2", "3"], KEY, 97))
    assert np.array_equal(bucket_of(np.array(["x", "y"]), KEY, 97), bucket_of(["x", "y"], KEY, 97))
    assert len(bucket_of([], KEY, 5)) == 0


def test_buckets_are_roughly_uniform():
    b = bucket_of(np.arange(100_000), KEY, 10)
    counts = np.bincount(b, minlength=10)
    assert counts.min() > 9_500 and counts.max() < 10_500


@pytest.mark.parametrize("bad", [[1.5], [None], [True], ["ok", np.int64(3)], [bytearray(b"x")]])
def test_bad_item_types(bad):
    with pytest.raises(TypeError):
        bucket_of(bad, KEY, 10)


def test_errors_name_the_problem_not_the_item():
    with pytest.raises(TypeError) as exc:
        bucket_of(["secret-login", 2.5], KEY, 10)
    assert "secret" not in str(exc.value) and "2.5" not in str(exc.value)
    # a lone surrogate has no UTF-8 form; UnicodeEncodeError's text would quote the item
    for items in (["secret\ud800"], ["secret\ud800", b"x"], np.array(["secret\ud800"])):
        with pytest.raises(ValueError) as exc:
            bucket_of(items, KEY, 10)
        assert not isinstance(exc.value, UnicodeError)
        assert "secret" not in str(exc.value) and "d800" not in str(exc.value)


def test_bad_key():
    with pytest.raises(ValueError):
        bucket_of(["a"], b"short", 10)
