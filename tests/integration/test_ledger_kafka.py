"""The ledger on a real broker: the Kafka group's committed offsets anchor its head, so a state
directory restored from an older backup (together with the release directory) and a deleted
ledger are refused; a fresh start resumes after the last released position."""

import json
import shutil


from tests.helpers.service import charge_by_position
from tests.helpers.kafka import (
    D,
    count_window_args,
    make_topic,
    produce_items,
    release_entries,
    run_service,
)


def test_a_restored_state_and_release_directory_is_refused_by_the_kafka_anchor(
    kafka_broker, tmp_path
):
    topic = make_topic(kafka_broker, partitions=1)
    produce_items(kafka_broker, topic, 2500, 1)
    args = count_window_args(kafka_broker, topic, tmp_path)
    first = run_service(args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(release_entries(tmp_path)) == 2
    backup = tmp_path / "backup"
    shutil.copytree(tmp_path / "state", backup / "state")
    shutil.copytree(tmp_path / "releases", backup / "releases")
    produce_items(kafka_broker, topic, 2000, 2)
    second = run_service(args)
    assert second.returncode == 0, second.stderr[-2000:]
    assert len(release_entries(tmp_path)) == 4
    # both directories back from one backup: checkpoint, ledger and release.dir agree; only the
    # group's committed offsets have seen entries 5-8
    for name in ("state", "releases"):
        shutil.rmtree(tmp_path / name)
        shutil.copytree(backup / name, tmp_path / name)
    res = run_service(args)
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "truncated or rolled back" in line and "committed offsets of group" in line, line
    assert len(release_entries(tmp_path)) == 2  # nothing ledgered twice
    assert sorted(p.name for p in (tmp_path / "releases").glob("*.json")) == [
        "release-0.json",
        "release-1.json",
    ]
    # the ledger deleted (the directory otherwise as it was): refused the same way
    (tmp_path / "state" / "ledger.jsonl").unlink()
    res = run_service(args)
    assert res.returncode == 2 and "is missing, but it had" in res.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "state" / "ledger.jsonl").exists()


def test_fresh_start_on_kafka_never_releases_an_event_twice(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, partitions=1)
    produce_items(kafka_broker, topic, 2500, 3)
    args = count_window_args(kafka_broker, topic, tmp_path)
    assert run_service(args).returncode == 0
    shutil.rmtree(tmp_path / "state" / "checkpoints")  # the checkpoint is lost
    refused = run_service(args)
    assert refused.returncode == 2 and "--fresh-start" in refused.stderr.strip().splitlines()[-1]
    produce_items(kafka_broker, topic, 1500, 4)
    res = run_service(args + ["--fresh-start"])
    assert res.returncode == 0, res.stderr[-2000:]
    part = f"{topic}:0"
    ranges = [e["ranges"][part] for e in release_entries(tmp_path)]
    assert ranges == [[0, 1000], [1000, 2000], [2000, 3000], [3000, 4000]]
    fresh = [
        json.loads(x)
        for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "fresh-start"
    ]
    assert len(fresh) == 1 and fresh[0]["resume_offsets"][part] >= 2000


def test_a_renamed_aggregation_on_kafka_never_puts_an_event_over_budget(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, partitions=1)
    produce_items(kafka_broker, topic, 2500, 5)

    def args(names):
        out = [
            "run",
            "--bootstrap",
            kafka_broker,
            "--topic",
            topic,
            "--state-dir",
            str(tmp_path / "state"),
            "--release-dir",
            str(tmp_path / "releases"),
            "--metrics-port",
            "-1",
            "--exit-when-idle",
            "3",
        ]
        sets = [
            "window.size=1000",
            "release.on_exhausted=false",
            f"source.group=g-{topic}",
            "ledger.budget_per_event=1.5",
        ]
        eps = {"a": 1.0, "b": 0.5, "c": 1.0}
        for name in names:
            sets += [
                f"aggregations.{name}.item.field=item",
                f"aggregations.{name}.state.domain_size={D}",
                f"aggregations.{name}.state.epsilon={eps[name]}",
            ]
        for s in sets:
            out += ["--set", s]
        return out

    first = run_service(args(["a", "b"]))
    assert first.returncode == 0, first.stderr[-2000:]
    refused = run_service(args(["c", "b"]))  # another set: refused unless accepted
    assert refused.returncode == 2
    renamed = run_service(args(["c", "b"]) + ["--accept-change"])
    assert renamed.returncode == 0, renamed.stderr[-2000:]
    part = f"{topic}:0"
    charge = charge_by_position(tmp_path / "state", part, 2500)
    assert charge.max() <= 1.5  # a's 1 + b's 0.5: c never counted what a released
    assert charge[:2000].min() == 1.5
