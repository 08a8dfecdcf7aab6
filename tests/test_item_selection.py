"""Choosing the item ([item]): a field path, the record key or a header; numeric strings in direct
mode; NFC and case folding in hashed mode; a filter whose left-out records are neither events nor
rejects. The msgpack batch fast path must agree with the per-message path on every case."""

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.service import Aggregator
from aggregator.service.config import ConfigError, load_config
from consumers.base import Segment, Source
from consumers.decode import FILTERED, REASONS, Decoder, ItemSpec

pack = msgpack.packb


def both_paths(decoder, values, keys=None, headers=None):
    """The batch result, checked against per-message decoding (and the fast path taken for 64+
    msgpack records when they are all fine)."""
    batch = decoder.decode(values, keys, headers)
    items, rejected = [], []
    for i, v in enumerate(values):
        item, reason = decoder.decode_one(
            v, None if keys is None else keys[i], None if headers is None else headers[i]
        )
        if reason is None:
            items.append(item)
        else:
            rejected.append((i, reason))
    assert list(batch.items) == items and batch.rejected == rejected
    return batch


def test_field_path_nested_and_list_index():
    dec = Decoder("msgpack", domain_size=100, spec=ItemSpec(path=("user", "id")))
    values = [pack({"user": {"id": i % 100, "name": "x"}, "event": "login"}) for i in range(200)]
    batch = both_paths(dec, values)
    assert list(batch.items) == [i % 100 for i in range(200)] and not batch.rejected
    values[5] = pack({"user": {"name": "no id"}})
    values[6] = pack({"user": "not a map"})
    values[7] = pack({"item": 3})
    values[8] = pack({"user": {"id": "7"}})  # a string in direct mode without coerce
    batch = both_paths(dec, values)
    assert batch.rejected == [
        (5, "missing_item"),
        (6, "missing_item"),
        (7, "missing_item"),
        (8, "wrong_type"),
    ]
    dec = Decoder("json", spec=ItemSpec(path=("ids", "1")))
    assert dec.decode_one(b'{"ids": ["a", "b"]}') == ("b", None)
    assert dec.decode_one(b'{"ids": ["a"]}') == (None, "missing_item")


def test_coerce_numeric_strings_in_direct_mode():
    dec = Decoder("msgpack", domain_size=1000, spec=ItemSpec(coerce=True))
    values = [pack({"item": str(i)}) for i in range(100)] + [pack({"item": i}) for i in range(100)]
    batch = both_paths(dec, values)
    assert list(batch.items) == list(range(100)) * 2
    for raw, want in [
        ("00042", (42, None)),
        ("-1", (None, "wrong_type")),
        ("4 2", (None, "wrong_type")),
        ("٤٢", (None, "wrong_type")),  # Arabic-Indic digits are not ASCII digits
        ("1_0", (None, "wrong_type")),
        ("", (None, "wrong_type")),
        ("5000", (None, "out_of_range")),
        (b"17", (17, None)),
        ("1" * 41, (None, "wrong_type")),
    ]:
        assert dec.decode_one(pack({"item": raw})) == want, raw
    values[150] = pack({"item": "x1"})
    assert both_paths(dec, values).rejected == [(150, "wrong_type")]


def test_record_key_and_header_items():
    n = 100
    keys = [f"acct-{i % 7}".encode() for i in range(n)]
    headers = [[("trace", b"t"), ("device", f"dev-{i % 3}".encode())] for i in range(n)]
    values = [b"anything, even not msgpack"] * n
    dec = Decoder("msgpack", spec=ItemSpec(source="key"))
    assert list(both_paths(dec, values, keys, headers).items) == keys
    dec = Decoder("msgpack", spec=ItemSpec(source="header", header="device"))
    assert list(both_paths(dec, values, keys, headers).items) == [
        f"dev-{i % 3}".encode() for i in range(n)
    ]
    keys[3], headers[4] = None, [("trace", b"t")]
    headers[5] = [("device", b"first"), ("device", b"last")]  # the last one wins
    b_key = both_paths(Decoder(spec=ItemSpec(source="key")), values, keys, headers)
    assert b_key.rejected == [(3, "missing_item")]
    b_hdr = both_paths(
        Decoder(spec=ItemSpec(source="header", header="device")), values, keys, headers
    )
    assert b_hdr.rejected == [(4, "missing_item")] and b_hdr.items[4] == b"last"
    # direct mode: a key is text; its digits are the int
    dec = Decoder(domain_size=50, spec=ItemSpec(source="key"))
    assert dec.decode_one(b"", key=b"42") == (42, None)
    assert dec.decode_one(b"", key=b"abc") == (None, "wrong_type")
    assert dec.decode_one(b"", key=b"99") == (None, "out_of_range")


def test_nfc_and_casefold_make_one_item():
    forms = ["Zoë", "Zoe\u0308", "ZOË", "zoë", "ZOE\u0308"]  # composed, decomposed, upper case
    dec = Decoder("msgpack", spec=ItemSpec(nfc=True, casefold=True))
    values = [pack({"item": f}) for f in forms] * 20
    assert set(both_paths(dec, values).items) == {"zoë"}
    nfc_only = Decoder("msgpack", spec=ItemSpec(nfc=True))
    assert set(both_paths(nfc_only, values).items) == {"Zoë", "ZOË", "zoë"}
    plain = Decoder("msgpack")
    assert len(set(both_paths(plain, values).items)) == 5
    # a key is normalised as text when it is UTF-8, as bytes otherwise
    kdec = Decoder(spec=ItemSpec(source="key", casefold=True))
    assert kdec.decode_one(b"", key="ABC".encode()) == ("abc", None)
    assert kdec.decode_one(b"", key=b"\xff\xfe") == (b"\xff\xfe", None)
    # folding can lengthen: the limit applies to the folded item
    short = Decoder(max_item_bytes=4, spec=ItemSpec(casefold=True))
    assert short.decode_one(pack({"item": "ßßß"})) == (None, "oversized")  # -> "ssssss"


def test_filter_leaves_records_out_without_rejecting_them():
    spec = ItemSpec(path=("user", "id"), filter_path=("event",), filter_value="login")
    dec = Decoder("msgpack", domain_size=100, spec=spec)
    values = [
        pack({"event": "login" if i % 3 else "logout", "user": {"id": i % 100}}) for i in range(300)
    ]
    values[10] = pack({"user": {"id": 1}})  # no event field: left out
    values[11] = pack({"event": "login", "user": {"id": 500}})  # counted, but out of range
    values[12] = pack({"event": "logout", "user": {"id": 500}})  # left out before its item
    values[13] = b"\xc1"  # not msgpack: rejected
    batch = both_paths(dec, values)
    reasons = dict(batch.rejected)
    assert reasons[10] == reasons[12] == FILTERED and reasons[11] == "out_of_range"
    assert reasons[13] == "undecodable"
    assert {i for i, r in reasons.items() if r == FILTERED} == {
        i for i in range(300) if i % 3 == 0
    } | {10}
    # the fast path handles a batch where nothing is wrong but some records are left out
    good = [pack({"event": "login" if i % 2 else "x", "user": {"id": i % 100}}) for i in range(200)]
    batch = both_paths(dec, good)
    assert [i for i, r in batch.rejected] == list(range(0, 200, 2))
    assert list(batch.items) == [i % 100 for i in range(1, 200, 2)]
    # ints and booleans compare as text
    assert Decoder("json", spec=ItemSpec(filter_path=("v",), filter_value="2")).decode_one(
        b'{"v": 2, "item": "a"}'
    ) == ("a", None)
    assert Decoder("json", spec=ItemSpec(filter_path=("ok",), filter_value="true")).decode_one(
        b'{"ok": true, "item": "a"}'
    ) == ("a", None)
    assert Decoder("json", spec=ItemSpec(filter_path=("v",), filter_value="--5")).decode_one(
        b'{"v": -5, "item": "a"}'
    ) == (None, FILTERED)
    assert Decoder("json", spec=ItemSpec(filter_path=("v",), filter_value="1")).decode_one(
        b'{"v": true, "item": "a"}'
    ) == (None, FILTERED)  # true is "true", not 1
    assert FILTERED not in REASONS


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["item.source=header"], "needs item.header"),
        (["item.header=x"], "item.source is not header"),
        (["item.normalize=nfc"], "apply to text items"),
        (["state.mode=hashed", "item.coerce=true"], "hashed mode already counts"),
        (["item.field=user..id"], "empty segment"),
        (["item.filter_value=login"], "without item.filter_field"),
        (["source.kind=generator", "item.source=key"], "needs Kafka records"),
        (["item.source=key", "item.field=user.id"], "remove item.field"),
        (["item.source=body"], "item.source must be one of"),
    ],
)
def test_bad_item_config_is_one_line(sets, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, sets, env={})


class _Records(Source):
    """Kafka-like records with keys and headers, in segments."""

    def __init__(self, segments):
        self.segments, self.offset = list(segments), 0

    def poll(self, timeout_s=1.0):
        if not self.segments:
            self.exhausted = True
            return []
        values, keys, headers = self.segments.pop(0)
        offsets = list(range(self.offset, self.offset + len(values)))
        self.offset += len(values)
        return [Segment("t:0", offsets, values, keys, headers)]


def _run(tmp_path, segments, *sets):
    cfg = load_config(
        None,
        [
            f"checkpoint.dir={tmp_path / 'state'}",
            "metrics.port=-1",
            f"release.dir={tmp_path / 'releases'}",
            "release.error_bar_reps=0",
            "state.domain_size=100",
            "window.size=1000000",
            *sets,
        ],
        env={},
    )
    agg = Aggregator(cfg, _Records(segments))
    agg.run()
    return agg


def test_service_counts_filtered_apart_from_events_and_rejects(tmp_path):
    values = [
        json.dumps({"event": "login" if i % 4 else "view", "user": {"id": i % 100}}).encode()
        for i in range(1000)
    ]
    values[1] = b'{"event": "login", "user": {}}'
    keys = [str(i).encode() for i in range(1000)]
    agg = _run(
        tmp_path,
        [(values[:500], keys[:500], None), (values[500:], keys[500:], None)],
        "source.format=json",
        "item.field=user.id",
        "item.filter_field=event",
        "item.filter_value=login",
    )
    release = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert release["n"] == 749  # 750 logins, one without an id
    totals = agg.task.totals
    assert totals["filtered"] == 250 and totals["rejects"] == {"missing_item": 1}
    assert agg.metrics.filtered._value.get() == 250
    assert agg.metrics.events._value.get() == 749


def test_service_counts_header_items_in_hashed_mode(tmp_path):
    n = 600
    values = [b"\x00opaque"] * n
    headers = [[("device", ["Pixel", "PIXEL", "iPhone"][i % 3].encode())] for i in range(n)]
    _run(
        tmp_path,
        [(values, [None] * n, headers)],
        "state.mode=hashed",
        "state.buckets=64",
        "item.source=header",
        "item.header=device",
        "item.casefold=true",
    )
    release = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert release["n"] == n


def test_item_choice_is_part_of_the_state_dirs_identity(tmp_path):
    from aggregator.service.process import ServiceError

    _run(tmp_path, [([pack({"item": 1})] * 10, None, None)])
    with pytest.raises(ServiceError, match="item 'value:item' -> 'value:user.id'"):
        _run(tmp_path, [([pack({"user": {"id": 1}})] * 10, None, None)], "item.field=user.id")


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-5, 2**64 - 1)
    | st.sampled_from(["login", "x", "7", "Zoë"])
    | st.binary(max_size=4)
    | st.floats(allow_nan=False)
)
_record = st.one_of(
    st.fixed_dictionaries(
        {
            "event": _leaf,
            "user": st.one_of(_leaf, st.fixed_dictionaries({"id": _leaf})),
            "item": _leaf,
        }
    ),
    _leaf,
    st.lists(_leaf, max_size=2),
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(_record, min_size=64, max_size=90),
    st.sampled_from(
        [
            ItemSpec(),
            ItemSpec(path=("user", "id")),
            ItemSpec(path=("user", "id"), coerce=True),
            ItemSpec(filter_path=("event",), filter_value="login"),
            ItemSpec(
                path=("user", "id"),
                filter_path=("event",),
                filter_value="7",
                nfc=True,
                casefold=True,
            ),
            ItemSpec(filter_path=("user", "id"), filter_value="true"),
        ]
    ),
    st.booleans(),
)
def test_fast_path_agrees_with_per_message_decoding(docs, spec, direct):
    if direct and (spec.nfc or spec.casefold):
        spec = ItemSpec(
            path=spec.path, filter_path=spec.filter_path, filter_value=spec.filter_value
        )
    if not direct and spec.coerce:
        spec = ItemSpec(path=spec.path)
    values = [pack(d) for d in docs]
    both_paths(Decoder("msgpack", domain_size=100 if direct else None, spec=spec), values)
