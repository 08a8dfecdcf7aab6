"""The budget registry: one event, one charge, across every deployment that reads a Kafka cluster.

A ledger records what its own lineage released, keyed by source positions (``<topic>:<partition>``
offsets). It cannot see another ledger: a second state directory, a new ``source.group``, a
restored directory whose group offsets were re-committed without their anchor, or a second
Kafka-only group each start their own, and the same records would be released again. The
registry is a compacted topic on the cluster itself (``ledger.registry_topic``, default
``panagg.budget``, one partition) that every deployment writes each charge to and reads before it
draws a release:

* **Key** ``<ledger id>/<entry id>``: the ledger's id is the hash of its first entry (a restored
  copy of a ledger keeps it; another ledger never has it), the entry's id is unique in its ledger,
  so compaction keeps every charge and a charge written twice is one record.
* **Value** (JSON): the charged ranges of source positions with the epsilon, lineage and window
  kind the ledger recorded (so overlapping event-time windows of one lineage count as the ledger
  counts them: :mod:`aggregator.service.charges`), and who charged them (``deployment``: host,
  state directory or group, consumer group) for the refusal's one line. A user-level release
  adds what it charged every user and the stream it did so on (``user_epsilon``,
  ``user_stream``: :mod:`aggregator.service.user_budget`).
* **Reading.** A deployment counts every registry charge its own ledgers do not hold, by (ledger
  id, entry id): a charge of another deployment, or one of its own that its ledger lost (a
  directory restored from a backup holds the same ledger id without its later entries). What the
  ledgers hold is counted by them, never twice.
* **Writing.** One process: right after the ledger entry (a crash between the two is caught up
  at the next start and before every release: :meth:`KafkaBudgetRegistry.catch_up`). A Kafka-only
  group's leader: in the transaction of its ledger entry.

What it cannot see: records copied where no panagg deployment on this cluster read them (another
cluster, a topic copied and never released here, a file): docs/privacy.md section 22.

>>> reg = MemoryRegistry(deployment={"state_dir": "/srv/a"})
>>> reg.record("L1", {"id": "release-w0", "kind": "release", "epsilon_spent": 1.0,
...                   "ranges": {"t:0": [0, 100]}, "lineage": "x"})
>>> [c["ranges"] for c in reg.charges(known={("L2", "release-w0")})]
[{'t:0': [0, 100]}]
>>> reg.charges(known={("L1", "release-w0")})
[]
>>> reg.who({"t:0": [50, 60]}, reg.charges(known=set()))
'state dir /srv/a'
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path

__all__ = [
    "ledger_id",
    "charge_of",
    "MemoryRegistry",
    "KafkaBudgetRegistry",
    "RegistryError",
    "deployment_name",
    "FileBudgetRegistry",
    "default_file_registry",
]

log = logging.getLogger("panagg.registry")


#: bound on one read or write of the registry at a release (the cluster away: the release goes on
#: checked against this deployment's ledgers, and the charge is written before the next one)
CHECK_S = 3.0


def _cluster_away(exc) -> bool:
    """Whether a kafka-python error means the cluster did not answer (wait for it), not that it
    refused (fail at once)."""
    # the Kafka registry loads a client; a file registry does not
    from kafka.errors import (  # noqa: PLC0415
        BrokerNotAvailableError,
        KafkaConnectionError,
        KafkaTimeoutError,
        NodeNotReadyError,
        RequestTimedOutError,
    )

    return isinstance(
        exc,
        (
            BrokerNotAvailableError,
            KafkaConnectionError,
            KafkaTimeoutError,
            NodeNotReadyError,
            RequestTimedOutError,
        ),
    ) or bool(getattr(exc, "retriable", False))


class RegistryError(RuntimeError):
    """The registry topic cannot be created, read or written (one line naming the fix)."""


def ledger_id(entries: list[dict]) -> str | None:
    """The id of a ledger: its first entry's hash (None: an empty ledger)."""
    return str(entries[0]["hash"])[:32] if entries and entries[0].get("hash") else None


def charge_of(entry: dict) -> bool:
    """Whether a ledger entry charges source positions (the registry holds those only)."""
    return bool(entry.get("ranges")) and float(entry.get("epsilon_spent") or 0.0) > 0.0


def deployment_name(dep: dict) -> str:
    """One line naming a deployment: its group (a Kafka-only group) or its state directory."""
    if dep.get("group"):
        return f"group {dep['group']}"
    where = f"state dir {dep.get('state_dir', '?')}"
    where += f" on {dep['host']}" if dep.get("host") and dep.get("host") != _HOST else ""
    return where + (f" reading {dep['file']}" if dep.get("file") else "")


_HOST = socket.gethostname()


def _value(lid: str, entry: dict, deployment: dict) -> dict:
    return {
        "format": "panagg.charge",
        "version": 1,
        "ledger": lid,
        "entry": entry["id"],
        "kind": entry.get("kind"),
        "window": entry.get("window"),
        "epsilon_spent": float(entry.get("epsilon_spent") or 0.0),
        "ranges": entry.get("ranges") or {},
        "lineage": entry.get("lineage"),
        "window_kind": entry.get("window_kind"),
        "deployment": dict(deployment),
        "time_unix": time.time(),
        **({"parallel": entry["parallel"]} if entry.get("parallel") else {}),
        # the user unit: what the release charged every user of the stream it names
        # (aggregator/service/user_budget.py)
        **(
            {k: entry[k] for k in ("user_epsilon", "user_stream")}
            if entry.get("user_epsilon")
            else {}
        ),
    }


class MemoryRegistry:
    """The registry's logic over records held in memory (tests, and the topic's cache)."""

    def __init__(self, deployment: dict):
        self.deployment = dict(deployment, host=deployment.get("host", _HOST))
        #: key -> value, as the compacted topic holds them
        self.records: dict[str, dict] = {}

    def record(self, lid: str, entry: dict) -> None:
        if charge_of(entry):
            self.records[f"{lid}/{entry['id']}"] = _value(lid, entry, self.deployment)

    def has(self, lid: str, entry_id: str) -> bool:
        return f"{lid}/{entry_id}" in self.records

    def catch_up(self, lid: str | None, entries: list[dict]) -> int:
        """Write the charges of ``entries`` (one ledger) the registry does not hold yet (a crash
        between a ledger entry and its charge, a broker away then); returns how many."""
        if lid is None:
            return 0
        missing = [e for e in entries if charge_of(e) and not self.has(lid, e["id"])]
        for e in missing:
            self.record(lid, e)
        return len(missing)

    def charges(self, known: set[tuple[str, str]]) -> list[dict]:
        """The registry's charges the ledgers in ``known`` ((ledger id, entry id) pairs) do not
        hold, as ledger-like entries (``kind = release``) for the charge book."""
        return [
            {
                "kind": "release",
                "epsilon_spent": v["epsilon_spent"],
                "ranges": v["ranges"],
                "lineage": v.get("lineage"),
                "window_kind": v.get("window_kind"),
                "parallel": v.get("parallel"),
                "deployment": v.get("deployment") or {},
            }
            for v in self.records.values()
            if (v["ledger"], v["entry"]) not in known
        ]

    @staticmethod
    def who(ranges: dict, charges: list[dict]) -> str:
        """The deployments among ``charges`` whose ranges meet ``ranges`` (one line)."""
        names = []
        for c in charges:
            meets = any(
                part in ranges and c_ab[0] < ranges[part][1] and c_ab[1] > ranges[part][0]
                for part, c_ab in c["ranges"].items()
            )
            if meets:
                name = deployment_name(c["deployment"])
                if name not in names:
                    names.append(name)
        return ", ".join(names) or "another deployment"


class KafkaBudgetRegistry(MemoryRegistry):
    """The registry kept in a compacted one-partition topic of the cluster the source is on.

    Parameters
    ----------
    bootstrap, security
        The cluster (``source.bootstrap``) and kafka-python client options (SASL, TLS).
    topic
        ``ledger.registry_topic``; created compacted with one partition if missing.
    deployment
        What names this deployment in another's refusal (state dir or group, consumer group).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        deployment: dict,
        *,
        security: dict | None = None,
        timeout_s: float = 30.0,
    ):
        super().__init__(deployment)
        self.topic = topic
        # a broker that comes back is found within a second, as by the source's consumer
        # (kafka-python backs off up to 30 s between reconnects: after a clean broker restart
        # every check and charge write timed out for 50 s, each stalling the loop 3 s)
        self._opts = dict(
            bootstrap_servers=bootstrap, reconnect_backoff_max_ms=1000, **(security or {})
        )
        self.timeout_s = float(timeout_s)
        self._consumer = None
        self._producer = None
        self._tp = None

    # -- the topic -----------------------------------------------------------------------------
    def open(self) -> None:
        """Create the topic if missing (compacted, one partition), then read it to its end.

        A cluster that does not answer (yet) is waited for up to ``timeout_s`` (the service
        passes ``source.connect_timeout_s``, as for its source), with one WARNING when the wait
        starts: a service restarted while its broker restarts starts when the broker is back. A
        refusal (authorization, a topic that cannot be made) fails at once, in one line."""
        # the Kafka registry loads a client; a file registry does not
        from kafka.errors import KafkaError  # noqa: PLC0415

        deadline = time.monotonic() + self.timeout_s
        said = False
        while True:
            try:
                self._open_once()
                return
            except KafkaError as exc:
                self.close()
                if not _cluster_away(exc) or time.monotonic() >= deadline:
                    raise RegistryError(self._unusable(exc)) from None
                if not said:
                    said = True
                    log.warning(
                        "the budget registry topic %s cannot be reached (%s); waiting "
                        "up to %g s for the cluster (source.connect_timeout_s)",
                        self.topic,
                        type(exc).__name__,
                        self.timeout_s,
                    )
                time.sleep(1.0)

    def _unusable(self, exc) -> str:
        if _cluster_away(exc):
            return (
                f"the budget registry topic {self.topic} could not be reached within "
                f"{self.timeout_s:g} s (source.connect_timeout_s; {type(exc).__name__}): is "
                'the cluster at source.bootstrap up? Or set ledger.registry_topic = "" to '
                "go without one (charges across deployments are then not checked)"
            )
        return (
            f"the budget registry topic {self.topic} cannot be used ({type(exc).__name__}); "
            "create it (kafka-topics.sh --create --topic "
            f"{self.topic} --partitions 1 --config cleanup.policy=compact) and grant this "
            'client read and write on it, or set ledger.registry_topic = "" to go '
            "without one (charges across deployments are then not checked)"
        )

    def _open_once(self) -> None:
        # the Kafka registry loads a client; a file registry does not
        from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415

        # the Kafka registry loads a client; a file registry does not
        from kafka.admin import KafkaAdminClient, NewTopic  # noqa: PLC0415

        # the Kafka registry loads a client; a file registry does not
        from kafka.errors import KafkaTimeoutError, TopicAlreadyExistsError  # noqa: PLC0415

        step_ms = int(min(self.timeout_s, 5.0) * 1000)
        admin = KafkaAdminClient(
            **self._opts, request_timeout_ms=step_ms, bootstrap_timeout_ms=step_ms
        )
        try:
            if self.topic not in set(admin.list_topics()):
                try:
                    admin.create_topics(
                        [
                            NewTopic(
                                self.topic,
                                num_partitions=1,
                                replication_factor=1,
                                topic_configs={"cleanup.policy": "compact"},
                            )
                        ]
                    )
                    log.info(
                        "created the budget registry topic %s (compacted): every "
                        "deployment on this cluster records its charges there",
                        self.topic,
                    )
                except TopicAlreadyExistsError:
                    pass
        finally:
            admin.close()
        self._consumer = KafkaConsumer(
            **self._opts,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
            bootstrap_timeout_ms=step_ms,
        )
        self._tp = TopicPartition(self.topic, 0)
        deadline = time.monotonic() + step_ms / 1000
        while not (self._consumer.partitions_for_topic(self.topic) or set()):
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(f"the topic {self.topic} has no partition yet")
            time.sleep(0.2)
        self._consumer.assign([self._tp])
        self._consumer.seek_to_beginning(self._tp)
        self.read_to_end(self.timeout_s)

    def read_to_end(self, timeout_s: float | None = None) -> None:
        """Every record committed to the topic so far (the charges other deployments wrote),
        within ``timeout_s`` (default :data:`CHECK_S`: a check before a release must not stall
        the service's loop for long while the cluster is away)."""
        if self._consumer is None:
            return
        timeout_s = CHECK_S if timeout_s is None else timeout_s
        end = self._consumer.end_offsets([self._tp], timeout_ms=int(timeout_s * 1000))
        end_at = end[self._tp]
        deadline = time.monotonic() + timeout_s
        while self._consumer.position(self._tp) < end_at:
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"the budget registry topic {self.topic} was not read to its "
                    f"end within {timeout_s:g} s"
                )
            for recs in self._consumer.poll(timeout_ms=200).values():
                for r in recs:
                    key = r.key.decode() if r.key else ""
                    if r.value is None:
                        self.records.pop(key, None)
                        continue
                    try:
                        value = json.loads(r.value)
                    except ValueError:
                        continue
                    if isinstance(value, dict) and value.get("format") == "panagg.charge":
                        self.records[key] = value

    # -- writing -------------------------------------------------------------------------------
    def message(self, lid: str, entry: dict) -> tuple[bytes, bytes] | None:
        """(key, value) of ``entry``'s charge (None: it charges nothing)."""
        if not charge_of(entry):
            return None
        value = _value(lid, entry, self.deployment)
        return f"{lid}/{entry['id']}".encode(), json.dumps(value, sort_keys=True).encode()

    def record(self, lid: str, entry: dict) -> None:
        """Write one charge (one process: after its ledger entry) and wait for it."""
        msg = self.message(lid, entry)
        if msg is None:
            return
        if self._producer is None:
            # the Kafka registry loads a client; a file registry does not
            from kafka import KafkaProducer  # noqa: PLC0415

            self._producer = KafkaProducer(
                **self._opts, acks="all", linger_ms=0, max_block_ms=int(CHECK_S * 1000)
            )
        self._producer.send(self.topic, key=msg[0], value=msg[1], partition=0).get(timeout=CHECK_S)
        super().record(lid, entry)

    def close(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                try:
                    client.close()
                except Exception:
                    pass
        self._consumer = self._producer = None


# -- file sources: the registry in a file, keyed by content ---------------------------------------

#: how many leading bytes of a file name its content (at most): enough to tell files apart, cheap
#: to read at every start
CONTENT_PREFIX = 1 << 20


def default_file_registry() -> str:
    """Where ``ledger.file_registry = "auto"`` keeps the registry: one per user."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "panagg", "budget-registry.jsonl")


def _prefix_digest(path, length: int) -> str | None:
    """SHA-256 of the first ``length`` bytes of ``path`` (None: the file is shorter)."""
    h = hashlib.sha256()
    left = length
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 16))
            if not chunk:
                return None
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()[:32]


def content_id(length: int, digest: str) -> str:
    return f"content:{digest}@{length}"


def _content_length(cid: str) -> int | None:
    if not cid.startswith("content:") or "@" not in cid:
        return None
    try:
        return int(cid.rsplit("@", 1)[1])
    except ValueError:
        return None


class FileBudgetRegistry(MemoryRegistry):
    """The budget registry of file sources: a JSON-lines file (one charge a line, appended under
    an exclusive lock), its ranges keyed by the *content* of the file they were read from, not
    its name.

    **Identity of a file.** ``content:<sha256 of its first L bytes>@L``, where L is the file's
    size when a run first met it, capped at :data:`CONTENT_PREFIX` (1 MiB). A file matches a
    known identity when it is at least L bytes long and its first L bytes hash the same, so a
    renamed or moved copy keeps its identity, and so does a log file that grew by appends (its
    first L bytes do not change). A record's position is its index in the file, so the charged
    positions of an identity are records inside those first L bytes, or records after them that
    the earlier run read; a different file that shares the first L bytes (a copy then edited
    further down) is taken as the same one: its positions are charged as the earlier file's
    (a refusal too many, never a release too many).

    Charges are written with their ranges re-keyed (``file:<name>`` -> the content identity) and
    read back by content, so every charge counts: those of this state directory's own ledger
    are under other keys in the ledger's own check, never counted twice.
    """

    def __init__(self, path, deployment: dict):
        super().__init__(deployment)
        self.path = Path(path).expanduser()
        self.topic = str(self.path)  # (named in the refusal's line, as the Kafka topic is)
        #: partition name -> content identity of this run's source
        self.sources: dict[str, str] = {}
        #: content identities taken as the same content as this run's source (prefixes of it)
        self._aliases: set[str] = set()

    def open(self) -> None:
        """Read the file (nothing is written: a start refused later leaves no trace here; the
        file and its directory are made at the first charge)."""
        try:
            self.read_to_end()
        except OSError as exc:
            raise RegistryError(
                f"the budget registry file {self.path} cannot be used ({exc.strerror or exc}); "
                'set ledger.file_registry to a file this user can write, or to "" to go '
                "without one (a renamed input or a new checkpoint.dir is then not checked "
                "against earlier runs)"
            ) from None

    def read_to_end(self, timeout_s: float | None = None) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        for line in text.splitlines():
            try:
                value = json.loads(line)
                key = f"{value['ledger']}/{value['entry']}"
            except (ValueError, KeyError, TypeError):
                continue  # (a torn last line of a crashed writer)
            if isinstance(value, dict) and value.get("format") == "panagg.charge":
                self.records[key] = value

    def identify(self, partition: str, file_path) -> str | None:
        """The content identity of ``file_path`` (read as ``partition``): a known identity it
        matches, or a new one of its first min(size, 1 MiB) bytes (None: an empty file)."""
        size = os.path.getsize(file_path)
        known = {}
        for v in self.records.values():
            for part in v.get("ranges") or {}:
                n = _content_length(part)
                if n is not None:
                    known.setdefault(n, set()).add(part)
        matches = []
        for n in sorted(known):
            if 0 < n <= size:
                cid = content_id(n, _prefix_digest(file_path, n))
                if cid in known[n]:
                    matches.append(cid)
        if matches:
            # the longest prefix names it; the others (an earlier, shorter look at the same
            # file) are the same content too
            cid = matches[-1]
            self._aliases = set(matches)
        else:
            n = min(size, CONTENT_PREFIX)
            if n == 0:
                return None
            cid = content_id(n, _prefix_digest(file_path, n))
            self._aliases = {cid}
        self.sources = {partition: cid}  # (one file a run)
        return cid

    def content_ids(self) -> set[str]:
        """The content identities taken as this run's source: its own and those of earlier,
        shorter looks at the same file (empty before :meth:`identify`)."""
        return set(self._aliases)

    def translate(self, ranges: dict, sources: dict | None = None) -> dict:
        """``ranges`` with each file partition re-keyed by its content identity (``sources``:
        the entry's own mapping; default: this run's)."""
        names = dict(self.sources, **(sources or {}))
        return {names.get(p, p): list(ab) for p, ab in ranges.items()}

    def record(self, lid: str, entry: dict) -> None:
        if not charge_of(entry):
            return
        entry = dict(entry, ranges=self.translate(entry["ranges"], entry.get("sources")))
        value = _value(lid, entry, self.deployment)
        line = json.dumps(value, sort_keys=True) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)  # (and the lock with it)
        self.records[f"{lid}/{entry['id']}"] = value

    def charges(self, known: set[tuple[str, str]]) -> list[dict]:
        """Every charge (``known`` is not needed: the ledgers key theirs by file name, these
        are keyed by content, so none is counted twice), earlier looks at this run's content
        re-keyed to its identity."""
        out = super().charges(set())
        if len(self._aliases) > 1:
            cid = self.sources and next(iter(self.sources.values()))
            for c in out:
                c["ranges"] = {
                    (cid if p in self._aliases else p): ab for p, ab in c["ranges"].items()
                }
        return out

    def resume_offsets(self, epsilon: float, budget: float) -> dict[str, int]:
        """Per file partition of this run, the first position after which a release of
        ``epsilon`` fits ``budget`` given every charge here (a new state directory over a file
        read before starts there)."""
        # the service imports this module: a cycle at import
        from aggregator.service.charges import ChargeBook  # noqa: PLC0415

        book = ChargeBook(self.charges(set()))
        by_content = book.resume_offsets(epsilon, budget=budget)
        return {part: by_content[cid] for part, cid in self.sources.items() if cid in by_content}

    def close(self) -> None:
        pass
