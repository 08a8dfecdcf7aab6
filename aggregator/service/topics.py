"""Create the shuffle model's topics with what panagg ships: kafka-python's admin client
(``panagg shuffle-topics``; docs/shuffle.md, "Deployment"). No ``kafka-topics.sh`` needed.

Three topics, from the configuration every party shares:

* ``shuffle.client_topic``: clients produce sealed events there (``client_partitions``,
  default 6: the shuffler reads every partition);
* the analyzer topic (``shuffle.analyzer_topic``, else ``source.topic``): **one** partition, the
  shuffler's windows in order;
* ``source.dead_letter_topic`` (if set): one partition, the records the shuffler and the
  analyzer did not count.

A topic that already exists is kept (it is checked: the analyzer topic must have exactly one
partition, else :class:`TopicError`). Replication factor: ``replication_factor`` (default 1, a
single-node broker; use 3 on a production cluster).
"""

from __future__ import annotations

from consumers.kafka_security import client_options

from .settings import Config

__all__ = ["TopicError", "shuffle_topics", "create_topics"]


class TopicError(RuntimeError):
    """Topics that cannot be created or are unfit (one line naming the fix)."""


def shuffle_topics(cfg: Config, client_partitions: int = 6) -> dict[str, int]:
    """``{topic: partitions}`` the shuffle deployment of ``cfg`` needs."""
    sh, src = cfg.shuffle, cfg.source
    client = sh.get("client_topic") or ""
    analyzer = sh.get("analyzer_topic") or src.get("topic") or ""
    if not client:
        raise TopicError("shuffle.client_topic is not set (the topic clients produce to)")
    if not analyzer:
        raise TopicError(
            "set shuffle.analyzer_topic (or source.topic): the topic the analyzer reads"
        )
    if client == analyzer:
        raise TopicError("shuffle.analyzer_topic must differ from shuffle.client_topic")
    if client_partitions < 1:
        raise TopicError("--client-partitions must be at least 1")
    out = {client: int(client_partitions), analyzer: 1}
    dead = src.get("dead_letter_topic") or ""
    if dead:
        if dead in out:
            raise TopicError(
                "source.dead_letter_topic must differ from the client and analyzer topics"
            )
        out[dead] = 1
    return out


def create_topics(
    cfg: Config, wanted: dict[str, int], replication_factor: int = 1, timeout_s: float = 30.0
) -> list[tuple[str, int, str]]:
    """Create each topic of ``wanted`` that does not exist; ``[(topic, partitions, "created" |
    "exists")]``. Raises TopicError (one line) if Kafka is unreachable, a creation fails, or the
    analyzer topic (the one wanted with one partition) exists with another partition count."""
    # a Kafka client is loaded by a Kafka run only
    from kafka.admin import KafkaAdminClient, NewTopic  # noqa: PLC0415
    from kafka.errors import KafkaError, TopicAlreadyExistsError  # noqa: PLC0415

    boot = cfg.source.bootstrap
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=boot,
            request_timeout_ms=int(timeout_s * 1000),
            **client_options(cfg.security),
        )
    except KafkaError as exc:
        raise TopicError(
            f"cannot reach Kafka at {boot} ({type(exc).__name__}); check "
            "source.bootstrap and that the broker runs"
        ) from None
    try:
        existing = set(admin.list_topics())
        todo = [
            NewTopic(t, num_partitions=p, replication_factor=int(replication_factor))
            for t, p in wanted.items()
            if t not in existing
        ]
        created = set()
        for topic in todo:  # one at a time: the error names the topic
            try:
                admin.create_topics([topic], timeout_ms=int(timeout_s * 1000))
                created.add(topic.name)
            except TopicAlreadyExistsError:
                pass
            except KafkaError as exc:
                raise TopicError(
                    f"creating topic {topic.name!r} on {boot} failed: "
                    f"{type(exc).__name__} {exc}".strip()
                ) from None
        out = []
        described = {
            d.get("name", d.get("topic")): len(d.get("partitions") or [])
            for d in admin.describe_topics(list(wanted))
        }
        analyzer = cfg.shuffle.analyzer_topic or cfg.source.topic
        for t, p in wanted.items():
            have = described.get(t, 0)
            if t == analyzer and have not in (0, 1):
                raise TopicError(
                    f"the analyzer topic {t!r} exists with {have} partitions; it "
                    "needs exactly 1 (the shuffler writes each window in order): "
                    "choose another name (shuffle.analyzer_topic)"
                )
            out.append((t, have or p, "created" if t in created else "exists"))
        return out
    finally:
        admin.close()
