"""Per-key breakdowns with parallel composition (issue 50): ``breakdown.field`` and
``breakdown.keys`` run one aggregation per key of a public key domain (and ``other``), each
filtered to its key; an event is in one key's state only, so the keys' releases are one parallel
composition, charged once per event (docs/privacy.md section 24)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from aggregator.noise import p_from_epsilon
from aggregator.service.charges import ChargeBook
from aggregator.service.config import ConfigError, aggregation_configs, load_config
from aggregator.service.multi import MultiAggregator
from aggregator.state import NEIGHBOR_RELATIONS, PanPrivateHistogram
from consumers.decode import FILTERED, Decoder, ItemSpec
from consumers.file_source import FileSource
from tests.lr_audit import Look, lr_epsilon

EPS = 1.0
KEYS50 = [f"k{i:02d}" for i in range(50)]


def _cfg(tmp_path, *sets, keys=("de", "fr", "it")):
    return load_config(
        None,
        [
            "source.kind=file",
            f"source.path={tmp_path / 'ev.jsonl'}",
            "source.format=json",
            "state.domain_size=20",
            "item.field=item",
            "breakdown.field=country",
            f"breakdown.keys={','.join(keys)}",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.error_bar_reps=0",
            "release.plan_errors=false",
            "release.estimator=deconvolution",
            *sets,
        ],
        env={},
    )


# -- the config: one aggregation per key, one parallel group ----------------------------------


def test_a_breakdown_is_one_aggregation_per_key_charged_as_one(tmp_path):
    cfg = _cfg(tmp_path)
    several = dict(aggregation_configs(cfg))
    assert sorted(several) == ["de", "fr", "it", "other"]
    de, other = several["de"], several["other"]
    assert (de.item.filter_field, de.item.filter_value) == ("country", "de")
    assert other.item.filter_field == "country" and set(other.item.filter_exclude) == {
        "de",
        "fr",
        "it",
    }
    # four aggregations at eps 1 each, and each event spends 1 eps over them, not 4
    assert cfg.ledger.budget_per_event == EPS
    for one in several.values():
        assert one.aggregation.epsilon_per_event == EPS
        assert one.aggregation.parallel["group"].startswith("breakdown:country#")
        assert not one.breakdown.field  # a key's own config does not expand again
    without_other = dict(aggregation_configs(_cfg(tmp_path, "breakdown.other=false")))
    assert sorted(without_other) == ["de", "fr", "it"]
    # another key domain is another group: its charges add to the old one's (a new key may
    # count records the old `other` already released)
    assert without_other["de"].aggregation.parallel["group"] != de.aggregation.parallel["group"]
    again = dict(aggregation_configs(_cfg(tmp_path, keys=("it", "fr", "de"))))
    assert again["de"].aggregation.parallel == de.aggregation.parallel


@pytest.mark.parametrize(
    "sets, says",
    [
        (["window.rollups=1000x", "state.model=joint"], "not built with window.rollups"),
        (["aggregations.ip.item.field=ip"], "not built with [aggregations]"),
        (
            ["item.filter_field=event", "item.filter_value=login"],
            "not built with item.filter_field",
        ),
        (["breakdown.keys=DE,fr"], "'DE' cannot name its aggregation"),
        (["breakdown.keys=other,fr"], "'other' cannot name its aggregation"),
        (["breakdown.keys=de,de"], "lists a key twice"),
        (["state.model=shuffle"], "state.model = shuffle"),
    ],
)
def test_what_a_breakdown_does_not_support_is_refused_in_one_line(tmp_path, sets, says):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, *sets)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_other_key_counts_what_no_key_does(tmp_path):
    recs = [
        json.dumps(r).encode()
        for r in (
            {"item": 1, "country": "de"},
            {"item": 2, "country": "es"},
            {"item": 3},
            {"item": 4, "country": "fr"},
        )
    ]
    seen = {}
    for name, one in aggregation_configs(_cfg(tmp_path, keys=("de", "fr"))):
        dec = Decoder("json", domain_size=20, spec=ItemSpec.from_config(one.item))
        one_by_one = [dec.decode_one(r) for r in recs]
        batch = dec.decode(recs)  # the batch path agrees
        assert list(batch.items) == [i for i, why in one_by_one if why is None]
        seen[name] = [i for i, why in one_by_one if why is None]
        assert all(why in (None, FILTERED) for _, why in one_by_one)
    assert seen == {"de": [1], "fr": [4], "other": [2, 3]}


# -- the ledger: 50 keys cost one aggregation's budget per event -----------------------------


def _write(path, n, keys, seed=1):
    r = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            ev = {"item": r.randrange(20), "country": r.choice(keys)}
            if i % 97 == 0:
                ev["country"] = "zz"  # outside the key domain: the other key
            f.write(json.dumps(ev) + "\n")


def _ledgers(state):
    return {
        d.name: [json.loads(x) for x in (d / "ledger.jsonl").read_text().splitlines()]
        for d in sorted(state.iterdir())
        if (d / "ledger.jsonl").exists()
    }


def test_fifty_keys_cost_the_budget_of_one_aggregation_per_event(tmp_path):
    _write(tmp_path / "ev.jsonl", 5000, KEYS50)
    cfg = _cfg(tmp_path, "window.size=100000", keys=KEYS50)
    MultiAggregator(cfg, FileSource(cfg.source.path, fmt="json", batch=1000)).run()
    ledgers = _ledgers(tmp_path / "state")
    assert len(ledgers) == 51
    rel = [e for es in ledgers.values() for e in es if e["kind"] == "release"]
    refused = [e for es in ledgers.values() for e in es if e["kind"] == "refused"]
    assert not refused and len(rel) == 51  # one release per key (and other), none refused
    assert sum(e["n"] for e in rel) == 5000  # every event in exactly one key's release
    assert all(
        e["epsilon_spent"] == EPS and e["parallel"]["group"].startswith("breakdown:country#")
        for e in rel
    )
    assert {e["parallel"]["member"] for e in rel} == {*KEYS50, "other"}
    # the per-event charge over every key's release: eps, not 51 eps
    book = ChargeBook(rel)
    (part,) = book.charged_partitions()
    assert book.peak({part: [0, 5000]}, 0.0) == EPS
    unmarked = ChargeBook([{k: v for k, v in e.items() if k != "parallel"} for e in rel])
    assert unmarked.peak({part: [0, 5000]}, 0.0) == 51 * EPS  # as 51 aggregations would
    comp = [e for e in ledgers["k07"] if e["kind"] == "composition"]
    assert comp[-1]["composition"]["epsilon_per_event"] == EPS
    assert "one parallel composition" in comp[-1]["note"] and "51 keys" in comp[-1]["note"]
    # a second pass over the same positions in a key would be a second charge: refused
    docs = [
        json.loads(p.read_text()) for p in (tmp_path / "releases" / "other").glob("release-*.json")
    ]
    assert len(docs) == 1 and docs[0]["n"] == len(range(0, 5000, 97))


# -- the audit: an event's presence across every key's state and release ----------------------

RUNS = 120_000


def _key_views(events_by_key: dict, keys, D: int, runs: int):
    """(state view, release view), each (runs, len(keys) * D): every key's real state
    (production noise: PanPrivateHistogram with runs copies of its counters) holding its
    events, and that state with the joint model's fresh release layer."""
    states, releases = [], []
    for k in keys:
        s = PanPrivateHistogram(EPS, size=runs * D)
        items = np.asarray(events_by_key.get(k, []), dtype=np.int64)
        if len(items):
            s.add_indices((D * np.arange(runs)[:, None] + items[None, :]).ravel())
        states.append(s.counts.reshape(runs, D).copy())
        s.rerandomize()
        releases.append(s.counts.reshape(runs, D).copy())
    return np.concatenate(states, axis=1), np.concatenate(releases, axis=1)


def _means(events_by_key, keys, D):
    return np.concatenate(
        [
            np.bincount(np.asarray(events_by_key.get(k, []), dtype=np.int64), minlength=D)
            for k in keys
        ]
    )


def _route(stream, keys, broken=False):
    """Each record to its key's state (the decoders' filters); ``broken``: to every key whose
    name is in the record's list of keys (as if one event touched two keys' states)."""
    out: dict = {k: [] for k in keys}
    for key, item in stream:
        for k in key if broken else [key]:
            out[k].append(item)
    return out


def _audit(x_stream, y_stream, keys, D, broken=False):
    p = p_from_epsilon(EPS, NEIGHBOR_RELATIONS["replace-one"])
    bx, by = _route(x_stream, keys, broken), _route(y_stream, keys, broken)
    vx, vy = _key_views(bx, keys, D, RUNS), _key_views(by, keys, D, RUNS)
    mx, my = _means(bx, keys, D), _means(by, keys, D)
    looks = [Look.of(mx, my, 1), Look.of(mx, my, 2)]  # the state, then the release (+1 layer)
    exact = float(np.abs(mx - my).sum()) * -math.log(p)  # the joint view's largest log-ratio
    return lr_epsilon(list(vx), list(vy), looks, p), exact


def test_an_events_presence_across_all_keys_reads_at_most_eps():
    keys, D = ["de", "fr", "it"], 3
    base = [("de", 0), ("fr", 1), ("it", 2), ("de", 1)]
    # the service's neighbours (replace-one, the key kept: each key's n is public, as n is):
    # (de, item 1) in x, (de, item 2) in y, seen through every key's state and release
    res, exact = _audit(base + [("de", 1)], base + [("de", 2)], keys, D)
    assert exact == pytest.approx(EPS)
    assert res.eps <= EPS * 1.05, res
    assert res.eps >= 0.75 * EPS, res  # the audit sees the event's loss (it is not blind)
    # the counters hide a change of key as well: (de, 1) in x, (fr, 2) in y moves one counter
    # in each of two keys' states, eps / 2 each (the n of de and fr differ: section 24)
    moved, exact_moved = _audit(base + [("de", 1)], base + [("fr", 2)], keys, D)
    assert exact_moved == pytest.approx(EPS) and moved.eps <= EPS * 1.05, moved
    # the negative control: the event touches two keys' states (counted in de and in fr)
    bad_base = [([k], i) for k, i in base]
    bad, exact_bad = _audit(
        bad_base + [(["de", "fr"], 1)], bad_base + [(["de", "fr"], 2)], keys, D, broken=True
    )
    assert exact_bad == pytest.approx(2 * EPS)
    assert bad.eps > 1.5 * EPS, bad
    print(
        f"breakdown audit: eps {EPS:g}, parallel {res.eps:.3f} (exact {exact:.3f}), key "
        f"changed {moved.eps:.3f}; "
        f"an event in two keys' states {bad.eps:.3f} (exact {exact_bad:.3f})"
    )


def test_plan_says_the_breakdown_is_charged_once(tmp_path):
    import subprocess
    import sys

    (tmp_path / "ev.jsonl").write_text("")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "plan",
            "--set",
            "source.kind=file",
            "--set",
            f"source.path={tmp_path / 'ev.jsonl'}",
            "--set",
            "state.domain_size=20",
            "--set",
            "window.size=20000",
            "--set",
            "breakdown.field=country",
            "--set",
            "breakdown.keys=de,fr",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split("]")[0] for ln in lines[:3]] == ["[de", "[fr", "[other"]
    assert lines[-1] == (
        "breakdown by country over 3 keys, one parallel composition: each event "
        "spends 1 eps (its key's window) over all of them "
        "(ledger.budget_per_event 1)"
    )
