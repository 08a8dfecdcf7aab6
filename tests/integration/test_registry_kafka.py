"""The budget registry on a real broker (state_store/registry.py, issue 48): deployments that
share no state directory, no consumer group and no ledger still charge each event once."""

from __future__ import annotations

import json
import shutil

from tests.helpers.kafka import count_window_args as _args
from tests.helpers.kafka import make_topic, run_service
from tests.helpers.kafka import produce_items as _produce
from tests.helpers.kafka import release_entries as _releases


def _charges(state_dir, part, n):
    import numpy as np

    charge = np.zeros(n)
    for e in (json.loads(x) for x in (state_dir / "ledger.jsonl").read_text().splitlines()):
        if e["kind"] == "release":
            lo, hi = e["ranges"].get(part, [0, 0])
            charge[lo:hi] += e["epsilon_spent"]
    return charge


def _with(args, **sets):
    out = list(args)
    for k, v in sets.items():
        out += ["--set", f"{k.replace('__', '.')}={v}"]
    return out


def _commit_without_metadata(bootstrap, group, topic):
    """An operator's --reset-offsets --to-earliest --execute on the stopped group."""
    import time

    from kafka import TopicPartition
    from kafka.admin import KafkaAdminClient
    from kafka.structs import OffsetAndMetadata

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        deadline = time.monotonic() + 120  # offsets of a group change only while it is empty
        while admin.describe_groups([group])[group]["group_state"] not in ("Empty", "Dead"):
            assert time.monotonic() < deadline, admin.describe_groups([group])
            time.sleep(0.5)
        admin.alter_group_offsets(group, {TopicPartition(topic, 0): OffsetAndMetadata(0, "", -1)})
    finally:
        admin.close()


def test_a_second_deployment_on_the_same_records_is_refused_naming_the_first(
    kafka_broker, tmp_path
):
    """A new state directory with a new source.group over a topic another deployment released
    (the audit's 800 of 400): its windows are refused in one line naming the first deployment's
    state directory; every position is charged once over both ledgers. Without the registry
    (ledger.registry_topic = "") the same second run releases them again: the control."""
    topic = make_topic(kafka_broker, partitions=1)
    registry = f"reg-{topic}"
    _produce(kafka_broker, topic, 2500, 11)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = run_service(_with(_args(kafka_broker, topic, a), ledger__registry_topic=registry))
    assert first.returncode == 0, first.stderr[-2000:]
    part = f"{topic}:0"
    assert _charges(a / "state", part, 2500)[:2000].min() == 1.0
    second = run_service(
        _with(
            _args(kafka_broker, topic, b),
            source__group=f"other-{topic}",
            ledger__registry_topic=registry,
        )
    )
    assert second.returncode == 0, second.stderr[-2000:]
    said = [ln for ln in second.stderr.splitlines() if "budget registry" in ln and "refused" in ln]
    assert said and all(str(a / "state") in ln for ln in said), second.stderr[-3000:]
    both = _charges(a / "state", part, 2500) + _charges(b / "state", part, 2500)
    assert both.max() == 1.0 and both[:2000].min() == 1.0
    # the control: the same second deployment without a registry releases the events again
    shutil.rmtree(b)
    control = run_service(
        _with(
            _args(kafka_broker, topic, c), source__group=f"third-{topic}", ledger__registry_topic=""
        )
    )
    assert control.returncode == 0, control.stderr[-2000:]
    assert (_charges(a / "state", part, 2500) + _charges(c / "state", part, 2500)).max() == 2.0


def test_a_directory_restored_without_its_anchor_cannot_release_its_events_again(
    kafka_broker, tmp_path
):
    """The state and release directories restored from a backup, and the group's offsets
    committed again without metadata (what `kafka-consumer-groups --reset-offsets --execute`
    writes: the ledger's anchor is gone): the restored ledger lacks the later releases, which the
    registry holds under the same ledger id; the replayed windows are refused."""
    topic = make_topic(kafka_broker, partitions=1)
    registry = f"reg-{topic}"
    _produce(kafka_broker, topic, 1500, 12)
    args = _with(_args(kafka_broker, topic, tmp_path), ledger__registry_topic=registry)
    assert run_service(args).returncode == 0
    backup = tmp_path / "backup"
    for name in ("state", "releases"):
        shutil.copytree(tmp_path / name, backup / name)
    _produce(kafka_broker, topic, 2000, 13)
    assert run_service(args).returncode == 0
    part = f"{topic}:0"
    assert _charges(tmp_path / "state", part, 3500)[:3000].min() == 1.0
    for name in ("state", "releases"):
        shutil.rmtree(tmp_path / name)
        shutil.copytree(backup / name, tmp_path / name)
    _commit_without_metadata(kafka_broker, f"g-{topic}", topic)
    again = run_service(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "budget registry" in again.stderr, again.stderr[-3000:]
    charge = _charges(tmp_path / "state", part, 3500)
    # the restored ledger charges [0, 1000) and nothing of [1000, 3000) again
    assert charge[1000:3000].max() == 0.0, charge[990:1010]


def test_the_registry_waits_for_a_cluster_that_comes_back(restartable_broker, caplog):
    """A start while the broker restarts waits for the registry as for the source
    (source.connect_timeout_s) instead of failing at once; a cluster that stays away is named in
    one line after the wait."""
    import logging
    import threading
    import time

    from state_store.registry import KafkaBudgetRegistry, RegistryError

    bootstrap = restartable_broker.bootstrap
    restartable_broker.stop()
    back = threading.Timer(6.0, restartable_broker.start)
    back.start()
    reg = KafkaBudgetRegistry(bootstrap, "panagg.budget.wait", {"state_dir": "/x"}, timeout_s=120)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="panagg.registry"):
            reg.open()
        waited = time.monotonic() - t0
    finally:
        back.join()
        reg.close()
    assert waited > 5.0, "open() returned before the broker was back"
    assert any("waiting up to 120 s" in r.getMessage() for r in caplog.records)

    restartable_broker.stop()
    reg = KafkaBudgetRegistry(bootstrap, "panagg.budget.wait", {"state_dir": "/x"}, timeout_s=4)
    t0 = time.monotonic()
    try:
        reg.open()
        raise AssertionError("open() succeeded with the broker stopped")
    except RegistryError as exc:
        msg = str(exc)
    finally:
        reg.close()
        restartable_broker.start()
    assert "\n" not in msg and "could not be reached within 4 s" in msg
    assert time.monotonic() - t0 >= 4.0


def test_the_registry_is_on_by_default(kafka_broker, tmp_path):
    """Without ledger.registry_topic set anywhere, a Kafka deployment records its charges in
    panagg.budget, and a second deployment over the same records is refused."""
    import os
    import subprocess
    import sys

    def run(args):
        env = {k: v for k, v in os.environ.items() if k != "PANAGG_LEDGER_REGISTRY_TOPIC"}
        return subprocess.run(
            [sys.executable, "-m", "aggregator.service.cli", *args],
            capture_output=True,
            text=True,
            timeout=240,
            env=dict(env, PANAGG_TESTING="1"),
        )

    topic = make_topic(kafka_broker, partitions=1)
    _produce(kafka_broker, topic, 2000, 3)
    a, b = tmp_path / "a", tmp_path / "b"
    first = run(_args(kafka_broker, topic, a))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(_with(_args(kafka_broker, topic, b), source__group=f"other-{topic}"))
    assert "the budget registry panagg.budget" in second.stderr, second.stderr[-3000:]
    assert _charges(a / "state", f"{topic}:0", 2000).max() > 0.0
    assert _charges(b / "state", f"{topic}:0", 2000).max() == 0.0


def _produce_logins(bootstrap, topic, n, seed):
    import msgpack
    import numpy as np

    from tests.helpers.kafka import produce

    users = np.random.default_rng(seed).integers(0, 1500, n)
    produce(
        bootstrap, topic, [msgpack.packb({"user": f"u{u}"}) for u in users], key_of=lambda i: b"k"
    )


def test_another_deployments_user_charges_count_against_the_per_user_budget(kafka_broker, tmp_path):
    """Issue 50 on a real broker: deployment A (user unit) releases two windows of a topic, so
    every user is charged 2 eps in the cluster's registry. Deployment B (new state directory, new
    group) over the same topic may charge an event twice (ledger.budget_per_event = 2), but its
    per-user budget of 3 pays for one window only: after it the intake pauses, in one line
    counting A's user charges, and the run exits when idle. The control without the registry
    releases both."""
    topic = make_topic(kafka_broker, partitions=1)
    registry = f"reg-{topic}"
    _produce_logins(kafka_broker, topic, 2500, 21)
    user = {
        "item__field": "user",
        "state__privacy_unit": "user",
        "state__expected_users": 2000,
        "ledger__budget_per_user": 3,
    }

    def deployment(name, **sets):
        return _with(
            _args(kafka_broker, topic, tmp_path / name),
            source__group=f"{name}-{topic}",
            **user,
            **sets,
        )

    a = run_service(deployment("a", ledger__registry_topic=registry))
    assert a.returncode == 0, a.stderr[-2000:]
    assert [e["user_epsilon"] for e in _releases(tmp_path / "a")] == [1.0, 1.0]
    b = run_service(deployment("b", ledger__registry_topic=registry, ledger__budget_per_event=2))
    assert b.returncode == 0, b.stderr[-2000:]
    assert [e["window"] for e in _releases(tmp_path / "b")] == [0], b.stderr[-3000:]
    said = [ln for ln in b.stderr.splitlines() if "per-user budget spent" in ln]
    assert len(said) == 1 and "intake is paused" in said[0], b.stderr[-3000:]
    assert "spent: 3 (2 of it by other deployments on this stream" in said[0], said[0]
    # the control: the same deployment without the registry knows only its own ledger
    c = run_service(deployment("c", ledger__registry_topic="", ledger__budget_per_event=2))
    assert c.returncode == 0, c.stderr[-2000:]
    assert [e["window"] for e in _releases(tmp_path / "c")] == [0, 1], c.stderr[-3000:]


def test_an_open_registry_reads_and_writes_again_soon_after_a_clean_broker_restart(
    restartable_broker,
):
    """The chaos matrix's count / broker_restart cell: after a clean broker restart every check
    and charge write of the registry timed out (3 s each, on the consume loop) for 50 s, because
    its clients backed off up to kafka-python's 30 s between reconnects while the broker was
    away. A registry that failed through an outage reads to its end and writes a charge within
    a few seconds of the broker's return (10 s here, a third of that backoff)."""
    import time

    from kafka.errors import KafkaError

    from state_store.registry import KafkaBudgetRegistry, RegistryError

    reg = KafkaBudgetRegistry(
        restartable_broker.bootstrap, "panagg.budget.restart", {"state_dir": "/x"}, timeout_s=30
    )
    entry = {
        "id": "release-1",
        "kind": "release",
        "epsilon_spent": 1.0,
        "ranges": {"t:0": [0, 10]},
        "hash": "ab" * 16,
    }
    try:
        reg.open()
        reg.record("lid", entry)
        restartable_broker.stop()
        away = time.monotonic() + 15.0
        k = 1
        while time.monotonic() < away:  # the windows that close while the broker is away
            k += 1
            try:
                reg.read_to_end(1.0)
            except (KafkaError, RegistryError):
                pass
            try:
                reg.record("lid", dict(entry, id=f"release-{k}"))
            except KafkaError:
                pass
        restartable_broker.start()
        deadline, last = time.monotonic() + 10.0, None
        while time.monotonic() < deadline:
            try:
                reg.read_to_end(2.0)
                reg.record("lid", dict(entry, id="release-back"))
                break
            except (KafkaError, RegistryError) as exc:
                last = exc
        else:
            raise AssertionError(
                f"the registry was not usable 10 s after the broker's return: {last!r}"
            )
        assert reg.has("lid", "release-back")
    finally:
        reg.close()
