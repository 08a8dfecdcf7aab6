"""SipHash-2-4: reference vectors, vector path == scalar path, item encoding."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.hashing import bucket_of, encode_items, siphash24, siphash24_scalar

KEY = bytes(range(16))


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
@given(st.lists(st.text(min_size=0, max_size=40).filter(lambda t: not t.endswith("\x00")),
                min_size=1, max_size=20))
def test_vector_path_matches_scalar_on_text(texts):
    mat, lengths = encode_items(texts)
    got = siphash24(KEY, mat, lengths)
    assert [int(g) for g in got] == [siphash24_scalar(KEY, t.encode()) for t in texts]


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


@pytest.mark.parametrize("bad", [[1.5], [None], [True]])
def test_bad_item_types(bad):
    with pytest.raises(TypeError):
        bucket_of(bad, KEY, 10)


def test_bad_key():
    with pytest.raises(ValueError):
        bucket_of(["a"], b"short", 10)
