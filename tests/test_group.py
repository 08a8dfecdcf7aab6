"""Kafka-only scale-out (scale.store = kafka), the parts that need no broker: the domain split,
the merge of slice summaries, the identity check and the config's refusals. The real-broker
tests are in tests/integration/test_group_kafka.py."""

import numpy as np
import pytest

from aggregator.estimate import noisy_value_counts
from aggregator.service.config import ConfigError, load_config
from aggregator.service.group.repartition import slice_size
from aggregator.service.group.service import GroupService
from aggregator.service.group.topics import GroupTopics
from aggregator.service.metrics import Metrics
from aggregator.service.group.summary import _value_counts, merge_summaries, partition_summary
from aggregator.service.process import ServiceError
from aggregator.state import PanPrivateHistogram


@pytest.mark.parametrize("D,P", [(1, 1), (10, 3), (1000, 6), (1001, 12), (5, 8)])
def test_the_slices_cover_the_domain_once(D, P):
    sizes = [slice_size(D, P, p) for p in range(P)]
    assert sum(sizes) == D
    owners = np.arange(D) % P
    assert sizes == [int(np.count_nonzero(owners == p)) for p in range(P)]


def test_merged_slice_summaries_are_one_state_of_D_counters():
    D, P = 997, 6
    rng = np.random.default_rng()
    items = rng.integers(0, D, 5000)
    states = [PanPrivateHistogram(1.0, size=slice_size(D, P, p)) for p in range(P)]
    for p, st in enumerate(states):
        st.add_indices(items[items % P == p] // P)
    info = {"kind": "time", "size": 2.0, "events": 0, "started_unix": 0.0, "ended_unix": 2.0}
    summaries = []
    for p, st in enumerate(states):
        s = partition_summary(st, model="state-only", window=7, partition=p, partitions=P,
                              window_info=dict(info, events=st.n))
        summaries.append(s)
    # the value counts of the P slices are those of the one D-counter vector they form
    whole = np.concatenate([st.counts for st in states])
    assert len(whole) == D
    vc = _value_counts(summaries[0])
    for s in summaries[1:]:
        vc = vc.merge(_value_counts(s))
    one = noisy_value_counts(whole)
    assert vc.lo == one.lo and np.array_equal(vc.c, one.c)
    release = merge_summaries(summaries, error_bar_reps=0)
    assert release["n"] == len(items)
    assert release["domain"]["size"] == D and release["domain"]["counters"] == D


def test_internal_topic_names_follow_the_group():
    t = GroupTopics("logins")
    assert {t.repartition, t.summaries, t.ledger, t.releases} == {
        "logins.panagg.repartition", "logins.panagg.summaries", "logins.panagg.ledger",
        "logins.panagg.releases"}
    wanted = t.wanted(6, 3600_000)
    assert wanted[t.ledger][0] == 1 and wanted[t.ledger][1]["cleanup.policy"] == "compact"
    assert wanted[t.repartition] == (6, {"cleanup.policy": "delete", "retention.ms": "3600000"})


def _cfg(*extra):
    return load_config(None, overrides=["scale.partitioned=true", "scale.store=kafka",
                                        "window.kind=time", "window.size=60", *extra])


@pytest.mark.parametrize("extra,said", [
    (["window.kind=count"], "set window.kind = time"),
    (["source.kind=file", "source.path=x"], "needs source.kind = kafka"),
    (["state.model=shuffle"], "does not apply to state.model = shuffle"),
])
def test_what_the_kafka_store_cannot_do_is_refused_in_one_line(extra, said):
    with pytest.raises(ConfigError) as err:
        _cfg(*extra)
    msg = str(err.value)
    assert said in msg and "scale.store = kafka" in msg and "\n" not in msg


def test_source_start_only_places_a_new_group():
    """A member asking another source.start than the group started with is refused in one
    line (it would resume from the group's offsets: the setting silently ignored)."""
    pipe = GroupService(_cfg("source.start=latest"), Metrics()).pipelines[0]
    pipe.identity = dict(pipe.identity_of_config(6), start="earliest")
    with pytest.raises(ServiceError) as err:
        pipe._check_start()
    msg = str(err.value)
    assert "only places a new group" in msg and "another source.group" in msg
    assert "\n" not in msg
    pipe.identity["start"] = "latest"
    pipe._check_start()            # the group's own start: fine
    earliest = GroupService(_cfg(), Metrics()).pipelines[0]
    earliest.identity = dict(earliest.identity_of_config(6), start="latest")
    earliest._check_start()        # no source.start: resume wherever the group is


def test_a_member_with_other_settings_than_its_group_is_refused():
    pipe = GroupService(_cfg("state.epsilon=2"), Metrics()).pipelines[0]
    pipe.identity = dict(pipe.identity_of_config(6), epsilon=1.0)
    with pytest.raises(ServiceError) as err:
        pipe.check_identity(pipe.identity_of_config(6))
    assert "state.epsilon = 1.0" in str(err.value) and "another source.group" in str(err.value)
    pipe.identity = pipe.identity_of_config(6)
    with pytest.raises(ServiceError, match="scale.partitions = 6"):
        pipe.check_identity(pipe.identity_of_config(3))


def test_several_aggregations_are_one_pipeline_each_with_their_own_topics():
    svc = GroupService(_cfg("ledger.budget_per_event=2", "aggregations.user.item.field=user",
                            "aggregations.ip.item.field=ip", "aggregations.ip.state.mode=hashed"),
                       Metrics())
    assert [p.name for p in svc.pipelines] == ["ip", "user"]
    assert {p.topics.ledger for p in svc.pipelines} == {"panagg.panagg.ip.ledger",
                                                        "panagg.panagg.user.ledger"}
    assert [p.direct for p in svc.pipelines] == [False, True]


def test_fresh_start_does_not_apply_to_a_group():
    with pytest.raises(ServiceError, match="another source.group"):
        GroupService(_cfg(), Metrics(), fresh_start=True)


def test_a_state_directory_with_a_ledger_is_never_taken_over_by_a_member(tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    svc = GroupService(_cfg(f"checkpoint.dir={tmp_path}", "source.bootstrap=127.0.0.1:1"),
                       Metrics())
    with pytest.raises(ServiceError) as err:
        svc.start()
    assert "empty scratch checkpoint.dir" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.jsonl"]   # nothing written


# -- the summary and the merge (aggregator.service.group.summary) ---------------------------------
INFO = {"kind": "time", "size": 10, "events": 10, "started_unix": 1.0, "ended_unix": 2.0}


def _summaries(states, model="state-only", window=0):
    return [partition_summary(s, model=model, window=window, partition=i, partitions=len(states),
                              window_info=INFO, rng=np.random.default_rng([7, i]))
            for i, s in enumerate(states)]


def test_hashed_slices_merge_into_the_release_of_their_concatenation():
    from aggregator.estimate import anonymized_histogram
    rng = np.random.default_rng(1)
    states = []
    for i in range(3):
        s = PanPrivateHistogram(1.0, buckets=400, key=bytes([i + 1]) * 16,
                                rng=np.random.default_rng([5, i]))
        s.update([f"user-{k}" for k in rng.zipf(1.5, 500) if k < 10**6])
        states.append(s)
    rel = merge_summaries(_summaries(states))
    whole = np.concatenate([s.counts for s in states])
    n = sum(s.n for s in states)
    expect = anonymized_histogram(whole, states[0].p, n=n, buckets=1200)
    got = np.repeat(*np.array(rel["histogram"]["pairs"]).T)
    assert np.array_equal(np.sort(got)[::-1], expect)
    assert rel["n"] == n and rel["domain"] == {"mode": "hashed", "size": 1200, "counters": 1200,
                                               "partitions": 3}


def test_a_merged_release_is_the_one_state_release_whatever_P():
    """Zipf items over D counters split into P = 6 slices, joint model: the merged release equals
    the release of the one D-counter state the slices form (with the same release layers)."""
    from aggregator.estimate import anonymized_histogram
    Dz, P, eps = 20_000, 6, 1.0
    rng = np.random.default_rng(17)
    items = np.minimum(rng.zipf(1.1, 200_000) - 1, Dz - 1)
    parts = []
    for p in range(P):
        s = PanPrivateHistogram(eps, size=slice_size(Dz, P, p), rng=np.random.default_rng([2, p]))
        mine = items[items % P == p] // P
        s.add_indices(mine)
        parts.append(s)
    merged = merge_summaries(_summaries(parts, model="joint"))
    from aggregator.noise import discrete_laplace
    layered = np.concatenate([s.counts + discrete_laplace(s.p, s.size,
                                                          rng=np.random.default_rng([7, i]))
                              for i, s in enumerate(parts)])
    expect = anonymized_histogram(noisy_value_counts(layered), parts[0].p, layers=2, n=200_000)
    got = np.repeat(*np.array(merged["histogram"]["pairs"]).T)
    assert np.array_equal(np.sort(got)[::-1], expect) and merged["n"] == 200_000


def test_merge_refuses_incomplete_or_inconsistent_windows():
    a = PanPrivateHistogram(1.0, size=50, rng=np.random.default_rng(1))
    b = PanPrivateHistogram(2.0, size=50, rng=np.random.default_rng(2))
    both = _summaries([a, a])
    with pytest.raises(ValueError, match="partitions 0..1"):
        merge_summaries(both[:1])
    with pytest.raises(ValueError, match="disagree"):
        merge_summaries(_summaries([a, b]))
    with pytest.raises(ValueError, match="no summaries"):
        merge_summaries([])


def test_the_removed_shared_directory_store_is_refused_with_the_way_on():
    with pytest.raises(ConfigError) as err:
        _cfg("scale.store=directory")
    msg = str(err.value)
    assert "was removed" in msg and "same source.group" in msg and "\n" not in msg


def test_a_forced_release_closes_the_clock_window_or_the_next_undecided_one():
    """panagg release closes the window open now; asked twice within one window (the first
    forced close already decided it), it closes the next one, never a decided window again."""
    from aggregator.service.group.forced import forced_window

    assert forced_window(60.0, next_undecided=10, now=60.0 * 20 + 5) == 20
    assert forced_window(60.0, next_undecided=21, now=60.0 * 20 + 5) == 21
    assert forced_window(2.5, next_undecided=0, now=10.0) == 4


def test_an_export_slice_set_is_one_state_in_the_intakes_counter_order():
    """Counter i of the group is slice i mod P's counter i div P: the assembled export holds
    each counter where one process would, every slice at the same layer count, n summed."""
    from aggregator.service.group.export import assemble
    from aggregator.service.group.repartition import slice_size
    from aggregator.state import PanPrivateHistogram

    D, P = 11, 3
    truth = np.arange(D) * 100          # far above the noise: each counter recognisable
    slices = []
    for p in range(P):
        st = PanPrivateHistogram(1.0, size=slice_size(D, P, p))
        mine = truth[p::P]
        st.add_indices(np.repeat(np.arange(len(mine)), mine))
        st.rerandomize()
        slices.append({"state": st.serialize(), "partition": p})
    whole = assemble(slices)
    assert whole.size == D and whole.layers == 2 and whole.n == int(truth.sum())
    assert np.all(np.abs(whole.counts - truth) < 50)


def test_a_window_merges_partitions_at_different_layer_counts_at_the_most():
    """A partition that exported its window holds two more layers; the merge adds fresh
    layers to the others (never refuses the window) and states the count it used."""
    from aggregator.service.group.summary import merge_summaries, partition_summary
    from aggregator.state import PanPrivateHistogram

    info = {"kind": "time", "size": 60.0, "events": 0, "started_unix": 0.0, "ended_unix": 60.0}
    parts = [PanPrivateHistogram(1.0, size=500) for _ in range(2)]
    parts[0].add_indices(np.repeat(np.arange(50), 20))
    parts[1].rerandomize()
    parts[1].rerandomize()                       # as an export leaves it
    summaries = [partition_summary(s, model="joint", window=3, partition=p, partitions=2,
                                   window_info=info) for p, s in enumerate(parts)]
    assert [s["layers"] for s in summaries] == [2, 4]
    release = merge_summaries(summaries, error_bar_reps=0)
    assert release["layers"] == 4 and release["n"] == 1000
    assert release["domain"]["counters"] == 1000
