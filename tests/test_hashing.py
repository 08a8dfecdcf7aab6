"""SipHash-2-4: reference vectors, vector path == scalar path, item encoding, cost structure."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aggregator.hashing as hashing
from aggregator.hashing import bucket_of, canonical_bytes, encode_items, siphash24, siphash24_scalar

KEY = bytes(range(16))


def scalar_hashes(items):
    return [siphash24_scalar(KEY, canonical_bytes(x)) for x in items]


def vector_hashes(items):
    buf, start, lengths = hashing._flat(items)
    return [int(h) for h in hashing._sip_flat(*hashing._check_key(KEY), buf, start, lengths)]


def test_reference_vectors():
    # Aumasson-Bernstein reference: key 00..0f, message 00 01 .. (len-1)
    assert siphash24_scalar(KEY, b"") == 0x726FDB47DD0E0E31
    assert siphash24_scalar(KEY, bytes(range(15))) == 0xA129CA6149BE45E5


def test_vector_path_matches_scalar_for_all_lengths():
    items = [bytes(range(1, i + 1)) for i in range(0, 70)]  # no trailing NUL
    mat, lengths = encode_items(items)
    got = siphash24(KEY, mat, lengths)
    assert [int(g) for g in got] == [siphash24_scalar(KEY, x) for x in items]


# Hashes of these items as the rows-times-longest implementation computed them (git c70a57e):
# the item -> bucket map of existing snapshots must not move.
PINNED = [
    ("", 0x726FDB47DD0E0E31),
    ("a", 0x2BA3E8E9A71148CA),
    ("user-12345", 0xFE2395F75FDCFE92),
    ("é", 0x242AA8F118CA4BA5),
    ("日本語テキスト", 0xEC46111E43EE2178),
    ("x" * 7, 0x3428B366FEECE0CD),
    ("y" * 8, 0x62766FFC90047C4A),
    ("z" * 9, 0x6A123F8DC8001A11),
    ("w" * 1024, 0x1E762543933B33D1),
    ("a\x00b", 0x56D984989527C8D6),
    (b"", 0x726FDB47DD0E0E31),
    (b"\x01", 0x6E534DC3C9AB17A2),
    (b"\xff" * 15, 0xC222E7ECE2309AF1),
    (b"a\x00", 0x2BA3E8E9A71148CA),
    (0, 0x4EC57F76EB9F068F),
    (7, 0x18733D77B7F7E614),
    (-1, 0xA8AF2AA0D217952E),
    (2**63 - 1, 0xB7D6F42C6F58A11A),
    (-(2**63), 0x8D0253062F70D479),
    ("\U0001f600" * 3, 0x30E6AE00A2AC99B0),
]


def test_hashes_identical_to_the_previous_implementation():
    items = [x for x, _ in PINNED]
    want = [h for _, h in PINNED]
    assert vector_hashes(items) == want
    assert [int(h) for h in siphash24(KEY, *encode_items(items))] == want
    assert scalar_hashes(items) == want


@pytest.mark.parametrize("scalar_rows", [0, 3, hashing._SCALAR_ROWS, 10**9])
def test_numpy_steps_and_python_tail_agree_with_scalar(monkeypatch, scalar_rows):
    # 0: every word through numpy steps; 10**9: every row word by word in Python
    monkeypatch.setattr(hashing, "_SCALAR_ROWS", scalar_rows)
    items = (
        [bytes(j % 255 + 1 for j in range(i)) for i in range(300)]
        + [b"\xff" * i for i in range(40)]
        + [x for x, _ in PINNED] * 3
    )
    want = scalar_hashes(items)
    assert vector_hashes(items) == want
    assert [int(h) for h in siphash24(KEY, *encode_items(items))] == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=20))
def test_vector_path_matches_scalar_on_text(texts):
    mat, lengths = encode_items(texts)
    got = siphash24(KEY, mat, lengths)
    assert [int(g) for g in got] == scalar_hashes(texts)
    assert vector_hashes(texts) == scalar_hashes(texts)


ITEMS = st.one_of(
    st.text(max_size=300), st.binary(max_size=300), st.integers(), st.integers(-(2**63), 2**64 - 1)
)


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
    assert np.array_equal(
        bucket_of(np.array([b"a\x00", b"\x00b"]), KEY, 97), bucket_of([b"a", b"\x00b"], KEY, 97)
    )
    nul_items = ["a\x00", "\x00", "é\x00", b"\x00a\x00", "x" * 9 + "\x00" * 9]
    assert vector_hashes(nul_items) == scalar_hashes(nul_items)
    assert vector_hashes(nul_items) == [
        siphash24_scalar(
            KEY, s.rstrip("\x00").encode() if isinstance(s, str) else s.rstrip(b"\x00")
        )
        for s in nul_items
    ]


def test_int_str_bytes_encode_alike_and_arrays_work():
    b = bucket_of([7, "7", b"7"], KEY, 10**9)
    assert b[0] == b[1] == b[2]
    assert np.array_equal(
        bucket_of(np.array([1, 2, 3]), KEY, 97), bucket_of(["1", "2", "3"], KEY, 97)
    )
    assert np.array_equal(bucket_of(np.array(["x", "y"]), KEY, 97), bucket_of(["x", "y"], KEY, 97))
    assert np.array_equal(
        bucket_of(np.array([b"x", "é"], dtype=object), KEY, 97), bucket_of([b"x", "é"], KEY, 97)
    )
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


def test_work_grows_with_each_items_own_length_not_the_longest(monkeypatch):
    """Counts the row-words each SipHash step processes (no clock): one long item must add about
    its own words, not (batch size) x (its words) as when every row ran to the longest row."""
    vector_rows, python_words = [], []
    compress, compress_py = hashing._compress, hashing._compress_py

    def counting(*args):
        vector_rows.append(len(args[4]))
        return compress(*args)

    def counting_py(*args):
        python_words.append(1)
        return compress_py(*args)

    monkeypatch.setattr(hashing, "_compress", counting)
    monkeypatch.setattr(hashing, "_compress_py", counting_py)

    def work(items):
        vector_rows.clear()
        python_words.clear()
        bucket_of(items, KEY, 64)
        return sum(vector_rows), len(python_words)

    plain = [f"user-{i}" for i in range(10_000, 11_000)]  # 10 bytes: 2 words each
    assert work(plain) == (2000, 0)
    for odd in ("u" * 1024, "é" * 512, "user\x00-1", "usér-1"):
        batch = plain[:-1] + [odd]
        own = len(odd.encode()) // 8 + 1
        vec, py = work(batch)
        assert vec + py == 999 * 2 + own  # each row exactly its own words
        assert vec <= 2000 + own
    many = plain[:-20] + ["u" * 1024] * 20  # 20 long rows: numpy steps, still only their words
    assert sum(work(many)) == 980 * 2 + 20 * 129
