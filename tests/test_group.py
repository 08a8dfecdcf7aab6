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
from aggregator.service.partitioned import _value_counts, merge_summaries, partition_summary
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
        s["split"] = True
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
    assert release["domain"]["empty_counters_removed"] == 0


def test_slices_and_copies_do_not_mix():
    st = PanPrivateHistogram(1.0, size=4)
    info = {"kind": "time", "size": 2.0, "events": 0, "started_unix": 0.0, "ended_unix": 2.0}
    a = partition_summary(st, model="state-only", window=1, partition=0, partitions=2,
                          window_info=info)
    b = dict(partition_summary(st, model="state-only", window=1, partition=1, partitions=2,
                               window_info=info), split=True)
    with pytest.raises(ValueError, match="mix domain slices and copies"):
        merge_summaries([a, b], error_bar_reps=0)


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
    (["checkpoint.snapshots_per_window=2"], "checkpoint.snapshots_per_window = 0"),
    (["source.kind=file", "source.path=x"], "needs source.kind = kafka"),
    (["source.start=latest"], "source.start is not supported"),
    (["state.model=shuffle"], "does not apply to state.model = shuffle"),
])
def test_what_the_kafka_store_cannot_do_is_refused_in_one_line(extra, said):
    with pytest.raises(ConfigError) as err:
        _cfg(*extra)
    msg = str(err.value)
    assert said in msg and "scale.store = kafka" in msg and "\n" not in msg


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


def test_a_shared_directory_group_is_never_taken_over_by_a_kafka_member(tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    svc = GroupService(_cfg(f"checkpoint.dir={tmp_path}", "source.bootstrap=127.0.0.1:1"),
                       Metrics())
    with pytest.raises(ServiceError) as err:
        svc.start()
    assert "scale.store = directory" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.jsonl"]   # nothing written
