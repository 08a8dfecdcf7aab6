"""Issue 54: ``panagg history`` for a Kafka-only group.

A group's ledger and release documents are in Kafka (``<group>.panagg.ledger`` and
``<group>.panagg.releases``, written by the leader in one transaction), not in any member's
directory. ``panagg history --group G --bootstrap B`` reads them there; ``--state-dir`` of a
member's scratch directory says so in one line instead of "holds no panagg state".
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from aggregator.release import stamp_window
from aggregator.service.group.ledger_topic import TopicLedger
from aggregator.service.group.summary import merge_summaries, partition_summary
from aggregator.service.group.topics import GroupTopics
from aggregator.state import PanPrivateHistogram

SIZE = 60.0
FIRST = 29_000_000


def _release(w: int, n: int) -> dict:
    P, D = 2, 400
    rng = np.random.default_rng(w)
    items = rng.zipf(1.5, n) % D
    summaries = []
    for p in range(P):
        st = PanPrivateHistogram(1.0, size=D // P)
        st.add_indices(items[items % P == p] // P)
        summaries.append(
            partition_summary(
                st,
                model="joint",
                window=w,
                partition=p,
                partitions=P,
                window_info={
                    "kind": "time",
                    "size": SIZE,
                    "events": st.n,
                    "started_unix": w * SIZE,
                    "ended_unix": (w + 1) * SIZE,
                },
            )
        )
    return stamp_window(merge_summaries(summaries, error_bar_reps=20))


def _panagg(*args):
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_history_reads_a_groups_releases_from_kafka(kafka_broker, tmp_path):
    group = f"h-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics(
        [
            NewTopic(t, num_partitions=1, replication_factor=1)
            for t in (topics.ledger, topics.releases)
        ]
    )
    admin.close()
    producer = KafkaProducer(bootstrap_servers=kafka_broker, transactional_id=f"{group}.leader")
    producer.init_transactions()
    consumer = KafkaConsumer(
        bootstrap_servers=kafka_broker,
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
    ledger = TopicLedger(consumer, topics.ledger, budget_per_window=1.0)
    ledger.read_to_end()
    windows = [FIRST, FIRST + 1, FIRST + 2, FIRST + 3]
    for w, n in zip(windows, (3000, 3000, 0, 9000)):
        producer.begin_transaction()
        if w == FIRST + 2:  # withheld: a ledger entry, no document
            ledger.append(
                entry_id=f"L/{w}",
                kind="release",
                window=w,
                epsilon_spent=1.0,
                window_uid=f"L/{w}",
                withheld="budget spent",
                producer=producer,
            )
        else:
            doc = json.dumps(_release(w, n), allow_nan=False, sort_keys=True)
            ledger.append(
                entry_id=f"L/{w}",
                kind="release",
                window=w,
                epsilon_spent=1.0,
                window_uid=f"L/{w}",
                n=n,
                producer=producer,
                document_sha256=hashlib.sha256(doc.encode()).hexdigest(),
            )
            producer.send(topics.releases, partition=0, key=str(w).encode(), value=doc.encode())
        producer.commit_transaction()
        ledger.committed()
    producer.close()
    consumer.close()

    res = _panagg("history", "--group", group, "--bootstrap", kafka_broker, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert [r["window"] for r in rows] == [FIRST, FIRST + 1, FIRST + 3]
    assert [r["n"] for r in rows] == [3000, 3000, 9000]
    assert rows[0]["window_start"] == "2025-02-19T21:20:00.000Z"
    assert rows[0]["change"] is None
    assert rows[2]["change"]["versus_window"] == FIRST + 1
    table = _panagg("history", "--group", group, "--bootstrap", kafka_broker)
    assert table.returncode == 0 and str(FIRST + 3) in table.stdout, table.stderr[-3000:]

    # a group that is not there: one line naming the fix
    res = _panagg("history", "--group", "no-such-group", "--bootstrap", kafka_broker)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"panagg: error: no Kafka-only group 'no-such-group' on {kafka_broker} (its topic "
        "no-such-group.panagg.ledger does not exist); check --group (source.group)"
    )
