"""Rollups (window.rollups, issue 30): longer releases summed from the base windows' release
views at no extra epsilon (docs/rollups.md, docs/privacy.md section 21).

The real service on real files, the production CSPRNG (no noise seed), kills by the project's
fault hook: a rollup's n is the sum of its base windows' n, its ledger entry charges 0 and names
them, it is the sum of the very views the base releases used, a crash anywhere between a base
window's ledger entry and the rollup's publication neither counts a window twice nor loses one
silently, and the refusals are one line.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.release import make_release
from aggregator.service.config import ConfigError, aggregation_configs, load_config, rollup_spans
from aggregator.service.ledger import BudgetExceeded, Ledger
from aggregator.service.rollup import RollupSum
from aggregator.state import PanPrivateHistogram

from tests.helpers.service import D, cli_sets, ledger_entries, run_cli, write_events


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def _args(tmp_path, n=6000, size=1000, rollups="3x,6x", **sets):
    items = np.random.default_rng().integers(0, D, n)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    return cli_sets(
        tmp_path,
        path,
        **{
            "window.size": size,
            "release.on_exhausted": "false",
            "window.rollups": rollups,
            "testing.noise_seed": -1,
            "window.rollup_design": "sum",
            "release.error_bar_reps": 0,
            # a rollup's 2k layers: threshold cannot take them
            "release.estimator": "default",
            **sets,
        },
    )


def _kind(tmp_path, kind):
    return [e for e in ledger_entries(tmp_path) if e["kind"] == kind]


def _published(tmp_path, name):
    return json.loads((tmp_path / "releases" / f"release-{name}.json").read_text())


def _histogram(doc):
    return [tuple(x) for x in doc["histogram"]["pairs"]]


# -- config: one line naming the fix -----------------------------------------------------------


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (
            ["window.kind=time", "window.size=3600", "window.clock=process", "window.rollups=90m"],
            'not a multiple of window.size = 3600 s; use a multiple such as "2h"',
        ),
        (["window.size=1000", "window.rollups=2500"], "not a multiple of window.size = 1000"),
        (["window.size=1000", "window.rollups=1x"], "a rollup covers at least 2"),
        (["window.size=1000", "window.rollups=3x,3000"], "names 3 base windows twice"),
        (
            ["window.kind=time", "window.size=3600", "window.clock=process", "window.rollups=soon"],
            "is not a duration",
        ),
        (
            ["window.size=1000", "window.rollups=5x,24x"],  # hybrid (the default): sums of 5x
            "window.rollups: '24x' is not a multiple of "
            "'5x' (hybrid: longer spans are sums of the 5x "
            "windows); use multiples of '5x' or window.rollup_design = tree",
        ),
        (
            ["window.size=1000", "window.rollups=3x", "state.model=state-only"],
            "window.rollups needs state.model = joint",
        ),
    ],
)
def test_bad_rollup_settings_are_refused_with_one_line(sets, fragment):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["source.kind=generator", *sets], env={})
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("kind", ["time", "event_time", "count"])
def test_sums_and_hybrid_spans_run_in_a_group(kind):
    """A group takes sum rollups (aggregator/service/group/rollups.py) of every window kind:
    plain sums, and a hybrid level's longer spans as sums of the level's windows."""
    group = [
        f"window.kind={kind}",
        "window.size=60",
        "scale.partitioned=true",
        "scale.exchange=items",
        "source.kind=kafka",
        "source.topic=t",
    ]
    cfg = load_config(
        None,
        ["source.kind=generator", *group, "window.rollups=3x", "window.rollup_design=sum"],
        env={},
    )
    assert rollup_spans(cfg) == {"3x": 3} and not cfg.aggregations
    if kind != "time":
        return
    cfg = load_config(None, ["source.kind=generator", *group, "window.rollups=3x,6x"], env={})
    assert cfg.aggregations["r3x"]["window"] == {
        "rollup_design": "sum",
        "size": 180,
        "rollups": ["2x"],
    }


def test_tree_and_one_span_hybrid_levels_run_in_a_group_and_name_themselves():
    """In a Kafka-only group every level is an aggregation of its own: tree and a one-span
    hybrid are allowed; each level's config says what it is (its releases' rollup_level)."""
    base = [
        "source.kind=kafka",
        "source.topic=t",
        "scale.partitioned=true",
        "scale.exchange=items",
        "window.kind=time",
        "window.size=60",
        "state.domain_size=100",
    ]
    for design, spans, levels in (
        ("hybrid", "3x", {"r3x": 3}),
        ("tree", "3x,6x", {"r3x": 3, "r6x": 6}),
    ):
        cfg = load_config(
            None, base + [f"window.rollups={spans}", f"window.rollup_design={design}"], env={}
        )
        got = {name: one for name, one in aggregation_configs(cfg)}
        assert set(got) == {"base", *levels}
        share = 1.0 / (1 + len(levels))
        for name, k in levels.items():
            level = got[name]["aggregation"]["rollup_level"]
            assert level == {
                "span": name[1:],
                "design": design,
                "base": "base",
                "base_windows": k,
                "epsilon": pytest.approx(share),
                "epsilon_per_event": 1.0,
                "sums": [],
            }
            assert got[name]["window"]["size"] == 60 * k
            assert got[name]["state"]["epsilon"] == pytest.approx(share)
        assert "rollup_level" not in got["base"]["aggregation"]


def test_rollup_spans_from_toml_env_and_flags(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[window]\nkind = "time"\nclock = "process"\nsize = 3600\nrollups = ["1d", "7d"]\n'
    )
    assert rollup_spans(load_config(str(toml), ["source.kind=generator"], env={})) == {
        "1d": 24,
        "7d": 168,
    }
    cfg = load_config(
        None,
        ["source.kind=generator", "window.size=1000"],
        env={"PANAGG_WINDOW_ROLLUPS": "24000, 5x", "PANAGG_WINDOW_ROLLUP_DESIGN": "sum"},
    )
    assert rollup_spans(cfg) == {"24000": 24, "5x": 5}


def test_the_cli_refusal_is_one_line_not_a_trace(tmp_path):
    args = _args(tmp_path, n=10, rollups="2500")
    out = run_cli(args)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "window.rollups: 2500 events is not a multiple of window.size = 1000" in out.stderr


# -- the view: the release's own counters, never a redraw ------------------------------------


def test_make_release_hands_out_the_exact_counters_it_estimated_from():
    state = PanPrivateHistogram(1.0, size=D)
    state.add_indices(np.random.default_rng().integers(0, D, 3000))
    view = []
    rel = make_release(state, window=0, error_bar_reps=0, view=view)
    ((counts, layers),) = view
    assert layers == state.layers + 1 == rel["layers"]
    assert not np.array_equal(counts, state.counts)  # the release layer is in it
    again = anonymized_histogram(counts, state.p, layers=layers, n=state.n)
    assert _histogram(rel) == [tuple(x) for x in _pairs(again)]


def _pairs(hist):
    vals, counts = np.unique(np.asarray(hist), return_counts=True)
    return [[int(v), int(c)] for v, c in zip(vals[::-1], counts[::-1])]


# -- the service ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_rollups_sum_their_base_windows_and_are_ledgered_at_zero_epsilon(tmp_path, workers):
    args = _args(tmp_path, **{"release.workers": workers})
    out = run_cli(args)
    assert out.returncode == 0, out.stderr
    releases = {e["window_uid"]: e for e in _kind(tmp_path, "release")}
    rollups = {e["window"]: e for e in _kind(tmp_path, "rollup")}
    assert sorted(rollups) == ["3x-0", "3x-1", "6x-0"]
    for name, first, k in (("3x-0", 0, 3), ("3x-1", 3, 3), ("6x-0", 0, 6)):
        entry = rollups[name]
        assert entry["epsilon_spent"] == 0.0 and "post-processing" in entry["note"]
        assert [b["window"] for b in entry["base_windows"]] == list(range(first, first + k))
        for b in entry["base_windows"]:  # each names a ledgered release, by uid, seq and hash
            base = releases[b["uid"]]
            assert (base["window"], base["seq"], base["hash"]) == (b["window"], b["seq"], b["hash"])
        doc = _published(tmp_path, name)
        assert doc == json.loads(entry["document"])
        assert (
            doc["n"]
            == entry["n"]
            == sum(releases[b["uid"]]["n"] for b in entry["base_windows"])
            == 1000 * k
        )
        assert doc["layers"] == 2 * k and doc["epsilon"] == 1.0
        assert doc["rollup"]["complete"] and doc["rollup"]["missing"] == []
        assert doc["rollup"]["windows"] == list(range(first, first + k))
        assert doc["window_info"]["kind"] == "rollup" and doc["window_info"]["events"] == 1000 * k
    # the ledger's spend is the base windows' only
    assert sum(e["epsilon_spent"] for e in ledger_entries(tmp_path)) == 6.0
    assert not list((tmp_path / "state" / "rollups").rglob("*.sum"))  # released sums are gone
    hist = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "history",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        env={"PANAGG_TESTING": "1", "PATH": ""},
    )
    assert hist.returncode == 0, hist.stderr
    assert "rollup 6x-0 (6 of 6 windows, 0 extra eps)" in hist.stdout


def test_a_rollup_sums_the_very_views_the_base_releases_used(tmp_path):
    """Stopped right after window 0's view is folded into rollup 3x-0: the sum on disk is
    exactly the counters window 0's ledgered release was estimated from."""
    args = _args(tmp_path, rollups="3x")
    out = run_cli(args, {"PANAGG_TEST_FAULT": "rollup-folded:1"})
    assert out.returncode == -9, out.stderr
    part = RollupSum.from_bytes((tmp_path / "state" / "rollups" / "3x" / "0.sum").read_bytes())
    assert part.covered() == [0] and part.layers == 2 and part.n == 1000
    published = json.loads(_kind(tmp_path, "release")[0]["document"])  # (not published yet)
    again = anonymized_histogram(part.counts, p_from_epsilon(1.0), layers=2, n=1000)
    assert _histogram(published) == [tuple(x) for x in _pairs(again)]


@pytest.mark.parametrize(
    "fault, workers",
    [
        ("rollup-view-kept:1", 0),  # window 0's view kept, not folded yet
        ("rollup-folded:1", 0),  # folded into 3x-0, the kept view not removed yet
        ("rollup-folded:2", 1),  # folded into 3x-0 and 6x-0 (release worker path)
        ("rollup-ledgered:1", 0),  # rollup 3x-0 ledgered, not published, its sum still on disk
        ("rollup-ledgered:2", 1),
    ],
)
def test_a_crash_in_the_rollup_path_counts_every_window_once(tmp_path, fault, workers):
    args = _args(tmp_path, **{"release.workers": workers})
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault})
    assert first.returncode == -9, first.stderr
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    rollups = {e["window"]: e for e in _kind(tmp_path, "rollup")}
    assert sorted(rollups) == ["3x-0", "3x-1", "6x-0"]  # each once
    for name, k in (("3x-0", 3), ("3x-1", 3), ("6x-0", 6)):
        doc = _published(tmp_path, name)
        assert doc == json.loads(rollups[name]["document"])
        assert doc["n"] == 1000 * k and doc["layers"] == 2 * k and doc["rollup"]["complete"]
    assert [e["window"] for e in _kind(tmp_path, "release")] == list(range(6))


def test_a_window_lost_between_its_ledger_entry_and_the_rollup_is_named_missing(tmp_path):
    """Killed after window 1's release is ledgered, before its view is kept: the window is
    not replayed (it is released), so it is not in its rollups, and they say so."""
    args = _args(tmp_path)
    first = run_cli(args, {"PANAGG_TEST_FAULT": "rollup-before-view:2"})
    assert first.returncode == -9, first.stderr
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    rollups = {e["window"]: e for e in _kind(tmp_path, "rollup")}
    for name, k in (("3x-0", 3), ("6x-0", 6)):
        doc = _published(tmp_path, name)
        assert rollups[name]["missing"] == [1] and not doc["rollup"]["complete"]
        assert doc["rollup"]["missing"][0]["window"] == 1
        assert "lost in a crash" in doc["rollup"]["missing"][0]["why"]
        assert doc["n"] == 1000 * (k - 1) and doc["layers"] == 2 * (k - 1)
        assert "holds" in doc["caveat"] and "missing: 1" in doc["caveat"]
    assert _published(tmp_path, "3x-1")["rollup"]["complete"]
    assert "rollup 3x-0 holds 2 of 3 base windows" in second.stderr


def test_the_ledger_refuses_a_rollup_over_anything_but_its_own_releases(tmp_path):
    led = Ledger(tmp_path / "ledger.jsonl", budget_per_window=1.0)
    led.append(
        entry_id="release-a",
        kind="release",
        window=0,
        window_uid="a",
        epsilon_spent=1.0,
        aggregation="",
    )
    led.append(entry_id="refused-b", kind="refused", window=1, window_uid="b")
    led.append(
        entry_id="release-c",
        kind="release",
        window=2,
        window_uid="c",
        epsilon_spent=1.0,
        aggregation="other",
    )
    assert [e["window"] for e in led.check_rollup("3x-0", ["a"])] == [0]
    for uids, fragment in (
        (["a", "b"], "base window b is not a ledgered release"),
        (["a", "zz"], "base window zz is not a ledgered release"),
        (["a", "c"], "was released by aggregation 'other'"),
    ):
        with pytest.raises(BudgetExceeded, match=fragment):
            led.check_rollup("3x-0", uids)


def test_several_aggregations_each_roll_up_their_own_windows(tmp_path):
    path = tmp_path / "events.jsonl"
    rng = np.random.default_rng()
    with open(path, "w") as f:
        for i in range(4000):
            f.write(
                json.dumps(
                    {"user": int(rng.integers(0, 200)), "device": f"d{int(rng.integers(0, 50))}"}
                )
                + "\n"
            )
    toml = tmp_path / "multi.toml"
    toml.write_text(f"""
[source]
kind = "file"
path = "{path}"
format = "json"
[release]
error_bar_reps = 0
workers = 1
on_exhausted = false
[window]
kind = "count"
size = 1000
rollup_design = "sum"
[ledger]
budget_per_event = 1.5
[aggregations.user]
item.field = "user"
state.domain_size = 200
window.rollups = ["2x"]
[aggregations.device]
item.field = "device"
state.mode = "hashed"
state.expected_n = 1000
state.epsilon = 0.5
window.size = 2000
window.rollups = ["2x"]
""")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--config",
            str(toml),
            "--set",
            f"checkpoint.dir={tmp_path / 'state'}",
            "--set",
            f"release.dir={tmp_path / 'releases'}",
            "--set",
            "metrics.port=-1",
        ],
        capture_output=True,
        text=True,
        env={"PANAGG_TESTING": "1", "PATH": ""},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for name, size, eps, rollups in (
        ("user", 1000, 1.0, ["2x-0", "2x-1"]),
        ("device", 2000, 0.5, ["2x-0"]),
    ):
        entries = [
            json.loads(x)
            for x in (tmp_path / "state" / name / "ledger.jsonl").read_text().splitlines()
        ]
        got = [e for e in entries if e["kind"] == "rollup"]
        assert [e["window"] for e in got] == rollups
        base = {e["window_uid"]: e for e in entries if e["kind"] == "release"}
        for e in got:
            assert e["aggregation"] == name and e["epsilon_spent"] == 0.0
            assert all(base[b["uid"]]["aggregation"] == name for b in e["base_windows"])
            doc = json.loads(
                (tmp_path / "releases" / name / f"release-{e['window']}.json").read_text()
            )
            assert doc["n"] == 2 * size and doc["epsilon"] == eps
            assert doc["aggregation"]["name"] == name and doc["rollup"]["complete"]


# -- the tree and hybrid designs: a live state per level, epsilon split ---------------------


def _ledger_of(tmp_path, name):
    return [
        json.loads(x) for x in (tmp_path / "state" / name / "ledger.jsonl").read_text().splitlines()
    ]


@pytest.mark.parametrize(
    "design, levels",
    [
        ("tree", {"base": (1000, 6, []), "r3x": (3000, 2, []), "r6x": (6000, 1, [])}),
        ("hybrid", {"base": (1000, 6, []), "r3x": (3000, 2, ["2x-0"])}),
    ],
)
def test_tree_and_hybrid_designs_split_epsilon_between_level_states(tmp_path, design, levels):
    args = _args(tmp_path, **{"window.rollup_design": design, "release.workers": 1})
    out = run_cli(args)
    assert out.returncode == 0, out.stderr
    share = 1.0 / len(levels)
    charged = 0.0
    for name, (size, windows, rollups) in levels.items():
        entries = _ledger_of(tmp_path, name)
        rel = [e for e in entries if e["kind"] == "release"]
        assert [e["n"] for e in rel] == [size] * windows  # a level's n: its base windows' sum
        assert all(e["epsilon_spent"] == pytest.approx(share) for e in rel)
        assert [e["window"] for e in entries if e["kind"] == "rollup"] == rollups
        charged += share  # every event is in one window of each level
        for e in rel:
            doc = json.loads(e["document"])
            assert doc["epsilon"] == pytest.approx(share) and doc["layers"] == 2
            if name == "base":
                assert "rollup_level" not in doc
            else:  # a level's release says which span of which design it is
                level = doc["rollup_level"]
                assert (level["span"], level["design"], level["base"]) == (name[1:], design, "base")
                assert level["base_windows"] * 1000 == size
                assert level["epsilon"] == pytest.approx(share)
    assert charged == pytest.approx(1.0)  # the per-event total is state.epsilon
    if design == "hybrid":
        doc = json.loads((tmp_path / "releases" / "r3x" / "release-2x-0.json").read_text())
        assert doc["n"] == 6000 and doc["layers"] == 4 and doc["rollup"]["complete"]


def test_a_directory_never_switches_between_one_state_and_level_states(tmp_path):
    """Switching a one-aggregation directory to level states (or back) would release its
    events again under ledgers that do not see each other: refused, one line."""
    args = _args(tmp_path, n=2000, **{"window.rollup_design": "sum"})
    assert run_cli(args).returncode == 0
    tree = _args(tmp_path, n=2000, **{"window.rollup_design": "tree"})
    out = run_cli(tree)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "holds one aggregation's state (ledger.jsonl at its top)" in out.stderr
    other = tmp_path / "other"
    other.mkdir()
    assert run_cli(_args(other, n=2000, **{"window.rollup_design": "tree"})).returncode == 0
    out = run_cli(_args(other, n=2000, **{"window.rollup_design": "sum"}))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "holds several aggregations" in out.stderr


# -- estimators on the layer counts rollups bring ------------------------------------------


@pytest.mark.parametrize("layers", [48, 336])
def test_estimators_take_the_layers_of_a_day_and_a_week(layers):
    from aggregator.estimators import phi_estimate
    from aggregator.release import estimate_with_accuracy

    p = p_from_epsilon(1.0)
    h = np.random.default_rng().integers(0, 300, 3000)
    noisy = h + sum(discrete_laplace(p, len(h)) for _ in range(layers))
    hist, acc = estimate_with_accuracy(noisy, p, layers=layers, n=int(h.sum()), reps=2)
    assert 0 < len(hist) <= len(h) and int(hist.sum()) <= int(h.sum())
    assert acc["intervals"]["distinct_items"][0] <= acc["intervals"]["distinct_items"][1]
    for method in ("threshold", "wupagh"):  # inverse filters: noise x 1e50 at these layers
        with pytest.raises(
            ValueError, match=f"the {method} estimator cannot run on {layers} noise layers"
        ):
            phi_estimate(noisy, p, layers=layers, method=method)


# -- the privacy argument, audited: the live window's read and the rollup that contains it ----


def _views(stream_delta, runs, redraw):
    """``runs`` independent runs of: an intrusion into window 0 before the replaced event
    (M = c_t + Z), window 0's release view (B = c_T + Z + W, the base release's input), and the
    rollup of windows 0..2 summed by the real accumulator from B (or, ``redraw``, from a second
    layer W' on the closed counters: the design the code must never have)."""
    p = p_from_epsilon(1.0)
    c_t = np.array([3, 1, 0])
    c_T = c_t + np.array([2, 0, 1]) + stream_delta  # the replaced event is after the read
    others = [np.array([1, 4, 2]), np.array([0, 2, 5])]
    Z = discrete_laplace(p, (runs, 3))
    M = c_t + Z
    B = c_T + Z + discrete_laplace(p, (runs, 3))
    base = c_T + Z + discrete_laplace(p, (runs, 3)) if redraw else B
    rollup = RollupSum("3x", 0, windows=3, p=p, mode="direct", size=3 * runs)
    rollup.update("w0", 0, base.ravel(), layers=2, n=None)
    for i, c in enumerate(others, 1):
        rollup.update(
            f"w{i}",
            i,
            (c + discrete_laplace(p, (runs, 3)) + discrete_laplace(p, (runs, 3))).ravel(),
            layers=2,
            n=None,
        )
    R = rollup.counts.reshape(runs, 3)
    return M, B, R


def test_audit_a_memory_read_and_the_rollup_stay_within_epsilon_a_redraw_does_not():
    from tests.lr_audit import Look, lr_epsilon

    p = p_from_epsilon(1.0)
    runs = 200_000
    x, y = np.array([1, 0, 0]), np.array([0, 1, 0])  # the replaced event: item 0 or item 1
    c_t = np.array([3, 1, 0])
    base = c_t + np.array([2, 0, 1])
    rest = np.array([1, 6, 7])
    # the rollup as built: the read, the base release's view and the rollup are nested (1, 2,
    # 6 layers): their blocks' ratios sum to the exact joint log-ratio (tests/lr_audit.py)
    vx, vy = _views(x, runs, False), _views(y, runs, False)
    looks = [
        Look.of(c_t, c_t, 1),
        Look.of(base + x, base + y, 2),
        Look.of(base + x + rest, base + y + rest, 6),
    ]
    ok = lr_epsilon(list(vx), list(vy), looks, p)
    assert ok.eps <= 1.0, ok
    # negative control: a redrawn layer; the published base release's view B and the rollup
    # are two independent looks at the events after the read: (B - M, R' - M)
    rx, ry = _views(x, runs, True), _views(y, runs, True)
    looks = [
        Look.of(base + x - c_t, base + y - c_t, 1),
        Look.of(base + x - c_t + rest, base + y - c_t + rest, 5),
    ]
    bad = lr_epsilon([rx[1] - rx[0], rx[2] - rx[0]], [ry[1] - ry[0], ry[2] - ry[0]], looks, p)
    assert bad.eps > 1.0, bad


# -- panagg status on one level of a running rollup service ---------------------------------


def test_status_of_a_level_reads_the_running_services_metrics(tmp_path):
    """The levels' process serves one exposition and leaves its URL in checkpoint.dir, above
    the levels' directories: status of a level asks it for that level's series (issue 46: it
    said "metrics off" while metrics were on)."""
    import os
    import signal

    from tests.helpers.service import generator_service

    env = dict(os.environ, PANAGG_TESTING="1")
    # generator_service takes no extra settings: the rollup ones go in by the environment
    env.update({"PANAGG_WINDOW_KIND": "time", "PANAGG_WINDOW_ROLLUPS": '["2x"]'})
    with generator_service(
        tmp_path, env, events=10**6, rate=4000, metrics_port="0", ready="metrics.url"
    ) as proc:
        outs = {
            name: subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "aggregator.service.cli",
                    "status",
                    "--state-dir",
                    str(tmp_path / "state" / name),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            for name in ("base", "r2x")
        }
        proc.send_signal(signal.SIGTERM)  # asked while running; a stop is a clean exit
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    for name, res in outs.items():
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert "metrics off" not in res.stdout, res.stdout
        win = [ln for ln in lines if ln.startswith("window: 0 open since ")]
        assert len(win) == 1 and " events so far (" in win[0], res.stdout
        assert "health: ok; ready" in lines, res.stdout
