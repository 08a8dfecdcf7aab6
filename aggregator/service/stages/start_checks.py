"""The checks of a start, before anything is written: is this state directory's lineage the one
the settings, the anchors and the source say it is?

A start asks, in this order (:meth:`aggregator.service.process.Aggregator.check_start`): the
ledger's anchors (:meth:`StartChecks.check_anchors`: a ledger older than a head recorded outside
it is refused), the directory's identity (:meth:`StartChecks.check_identity`: other settings
are refused, or recorded with ``--accept-change``), the checkpoint's place in the lineage
(:meth:`StartChecks.check_start_policy`, :meth:`StartChecks.check_not_rolled_back`, the restored
state's settings) and whether the source can replay the open window
(:meth:`StartChecks.check_replayable`).

Invariant: a refused start writes nothing. The ledger entries the checks decide on (an identity,
a recorded change) go through ``append``, which the service defers until every check passed.
Durable writes here: ``config.json`` (:func:`save_effective_config`, no secrets), and only once
the start succeeded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from consumers.kafka_security import redacted
from state_store.local import atomic_write
from state_store.registry import ledger_id

from ...state import PanPrivateHistogram
from ..anchor import parse_kafka_metadata, release_dir_anchor
from ..config import DEFAULTS, parse_start
from ..errors import ServiceError
from ..identity import IDENTITY_DEFAULTS, directory_identity, identity_of
from ..ledger import Ledger
from ..settings import Config

__all__ = ["StartChecks", "keep_processing_time", "save_effective_config", "saved_config"]

log = logging.getLogger("panagg.service")


def keep_processing_time(cfg: Config, ledger: Ledger, directory: Path) -> Config:
    """``cfg``, or (``window.kind = time`` on Kafka windows by the records' timestamps,
    ``window.clock = auto``) a state directory started before that, with windows by this
    process's clock, keeps them (its checkpoints and ledger are processing-time windows)."""
    if not cfg.window.auto_event_time:
        return cfg
    started = (ledger.identity() or {}).get("window", "")
    if not started.startswith("time:"):
        return cfg
    log.info(
        "%s counts time windows by this process's clock (it was started so): it "
        "keeps them; for windows by the records' Kafka timestamps use a new "
        "checkpoint.dir (or set window.clock = process to say so)",
        directory,
    )
    return cfg.updated(
        {"window": {"kind": "time", "auto_event_time": False, "idle_partition_timeout_s": 0.0}}
    )


def saved_config(directory: Path) -> dict:
    """The config the last start saved in the state directory ({} if none or unreadable)."""
    try:
        saved = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def save_effective_config(directory: Path, cfg: Config) -> None:
    """Keep the running config next to the checkpoints, for offline release/export. A
    setting that changed since the last start (those not in the identity are safe to
    change: docs/configuration.md) is logged once, here."""
    # (scale-out members share the directory, each with its own instance id and port)
    old, new = saved_config(directory), redacted(cfg)
    for section in DEFAULTS:
        for key in DEFAULTS[section]:
            was = (old.get(section) or {}).get(key, new[section][key])
            if was != new[section][key] and (section, key) != ("security", "password"):
                log.info(
                    "setting %s.%s changed from %r to %r", section, key, was, new[section][key]
                )
    atomic_write(
        Path(directory) / "config.json",  # no secrets
        json.dumps(redacted(cfg), indent=1, sort_keys=True),
        mode=None,
    )


class StartChecks:
    """The lineage checks of one state directory's start.

    Parameters
    ----------
    cfg
        The service's settings (after :func:`keep_processing_time`).
    ledger
        The directory's privacy ledger (read here; written only through ``append``).
    directory
        ``checkpoint.dir``.
    source
        The event source (``committed_metadata``, ``committed_offsets``, ``initial_offsets``,
        ``replay_problem`` where it has them).
    append
        Records a ledger entry of the start (deferred while the start is checking).
    accept_change, fresh_start, same_records_as
        The operator's flags (``--accept-change``, ``--fresh-start``, ``--same-records-as``).
    anchor_name
        This aggregation's name in anchors ("" when it is the only one).
    """

    def __init__(
        self,
        cfg: Config,
        ledger: Ledger,
        directory: Path,
        source,
        *,
        append: Callable[..., None],
        accept_change: bool = False,
        fresh_start: bool = False,
        same_records_as: str | None = None,
        anchor_name: str = "",
    ):
        self.cfg, self.ledger, self.dir, self.source = cfg, ledger, Path(directory), source
        self.append = append
        self.accept_change, self.fresh_start = accept_change, fresh_start
        self.same_records_as, self.anchor_name = same_records_as, anchor_name
        self._anchor_note_logged = False

    # -- identity ------------------------------------------------------------------------------
    def check_identity(self) -> dict:
        """Record the state directory's identity at its first start; refuse (or, with
        ``accept_change``, ledger) a later start with other settings."""
        if not self.cfg.aggregation and (self.dir / "aggregations.json").exists():
            # its aggregations' ledgers below hold charges this one would not see
            raise ServiceError(
                f"checkpoint.dir {self.dir} holds several aggregations (also what "
                "window.rollup_design = tree or hybrid runs); use their config (the same "
                "[aggregations] or rollup design) or a new checkpoint.dir"
            )
        mine = dict(identity_of(self.cfg), **directory_identity(self.cfg))
        recorded = self.ledger.identity()
        if recorded is None:
            first = dict(mine, run=os.urandom(8).hex(), first_window=0, start=self.cfg.source.start)
            self.append(entry_id=f"identity-{os.urandom(6).hex()}", kind="identity", identity=first)
            return first
        # a ledger from before a key was in the identity: the last start's saved config says
        saved = directory_identity(saved_config(self.dir))
        had: dict = {
            k: recorded.get(k, saved.get(k, IDENTITY_DEFAULTS.get(k, mine[k]))) for k in mine
        }
        changed = [k for k in mine if had[k] != mine[k]]
        same = self._same_records_entry(had, mine, changed)
        if not changed:
            return recorded
        what = ", ".join(f"{k} {had[k]!r} -> {mine[k]!r}" for k in changed)
        if not self.accept_change:
            where = ""
            if "release_dir" in changed:
                done = [
                    e["window"] for e in self.ledger.releases() if isinstance(e.get("window"), int)
                ]
                where = (
                    f"; the releases so far ({len(done)}, up to window {max(done)}) are in "
                    f"{had['release_dir']}: a new release.dir would leave a gap there"
                    if done
                    else ""
                )
            raise ServiceError(
                f"checkpoint.dir {self.dir} belongs to other settings ({what}); "
                "use the original settings, a new checkpoint.dir, or "
                f"--accept-change to record the change in the ledger{where}"
            )
        self.append(
            entry_id=f"identity-{os.urandom(6).hex()}",
            kind="identity",
            identity=dict(recorded, **mine),
            previous=recorded,
            note=f"settings changed: {what}",
            **same,
        )
        log.warning("settings of %s changed and recorded in the ledger: %s", self.dir, what)
        if "stream" in changed:
            self._say_stream_changed(had["stream"], mine["stream"], same)
        return dict(recorded, **mine)

    def _same_records_entry(self, had: dict, mine: dict, changed: list) -> dict:
        """``--same-records-as OLD`` checked against the change (one line if it does not fit),
        as the identity entry's field: the new topic's records are copies of OLD's."""
        old = self.same_records_as
        if not old:
            return {}
        if self.cfg.source.kind != "kafka":
            raise ServiceError(
                "--same-records-as applies to a Kafka source.topic only; a file "
                "source is recognised by its content (ledger.file_registry)"
            )
        if "stream" not in changed:
            raise ServiceError(
                f"--same-records-as {old}: source.topic did not change "
                f"({mine['stream'][6:]}); give it with --accept-change when "
                "source.topic changes from that topic"
            )
        if had["stream"] != f"kafka:{old}":
            counted = had["stream"].removeprefix("kafka:")
            raise ServiceError(
                f"--same-records-as {old}: {self.dir} counted topic {counted}, "
                f"not {old}; name the topic it counted"
            )
        return {"same_records_as": {"from": old, "to": self.cfg.source.topic}}

    def _say_stream_changed(self, was: str, now: str, same: dict) -> None:
        """The warning line of a changed source: what the new records are charged as."""
        if same:
            log.warning(
                "source.topic changed (%s -> %s) with --same-records-as %s: every "
                "record of %s is charged as the most-charged record of %s (the copy's "
                "offsets need not match), so copies of released records are refused, "
                "not released again",
                was[6:],
                now[6:],
                same["same_records_as"]["from"],
                now[6:],
                was[6:],
            )
        elif self.cfg.source.kind == "kafka":
            log.warning(
                "source.topic changed (%s -> %s) without --same-records-as: its "
                "records count as new data, and copies of released records in it are "
                "released again (the ledger and the budget registry know positions, not "
                "contents); if it holds the same records, stop and start again with "
                "--accept-change --same-records-as %s",
                was[6:],
                now[6:],
                was[6:],
            )
        elif self.cfg.source.kind == "file" and self.cfg.ledger.file_registry:
            log.warning(
                "source.path changed (%s -> %s): its records are charged by the "
                "file's content (ledger.file_registry), so a renamed or moved copy of "
                "the file read before keeps its charges",
                was[5:],
                now[5:],
            )
        else:
            log.warning(
                "the counted stream changed (%s -> %s): its positions are new ones, so "
                "records it holds that are copies of released ones count as new data "
                'and are released again (ledger.file_registry = "": nothing knows '
                "the file's content; docs/privacy.md section 22)",
                was,
                now,
            )

    def composition_entry(self, window: int) -> dict | None:
        """With several aggregations: the ledger entry of the set this one is part of, if it
        differs from the last one recorded (docs/privacy.md, section 19); else None."""
        agg = self.cfg.aggregation
        if not agg:
            return None
        # as the ledger's JSON has it (a list), so that the same set compares equal
        mine: dict = {
            "of": list(agg.of),
            "budget_per_event": agg.budget_per_event,
            "epsilon_per_event": agg.epsilon_per_event,
        }
        note = (
            f"aggregation {agg.name!r} of {', '.join(agg.of)}: each event spends up to "
            f"{agg.epsilon_per_event:g} eps over them"
        )
        if agg.parallel:  # a breakdown's key: one parallel composition with the other keys
            mine["parallel"] = dict(agg.parallel)
            note = (
                f"key {agg.name!r} of {agg.parallel['group']} ({len(agg.of)} keys), one "
                "parallel composition: an event is in its key's state only, so each event "
                f"spends {agg.epsilon_per_event:g} eps over all keys' releases, not one "
                "charge per key (docs/privacy.md section 24)"
            )
        last = [e for e in self.ledger.entries if e["kind"] == "composition"]
        if last and last[-1].get("composition") == mine:
            return None
        return dict(
            entry_id=f"composition-{os.urandom(6).hex()}",
            kind="composition",
            window=window,
            composition=mine,
            note=note,
        )

    # -- anchors, the checkpoint's place, the source -------------------------------------------
    def check_anchors(self, ckpt) -> None:
        """Refuse a ledger older than a head recorded outside it: in the checkpoint, in the
        release directory, in the Kafka group's committed offsets (:mod:`..anchor`)."""
        anchors = []
        if ckpt is not None and ckpt.ledger_head:
            anchors.append((f"checkpoint {ckpt.seq}", ckpt.ledger_head))
        rel = release_dir_anchor(
            self.cfg.release.dir, self.ledger.path, ledger_id(self.ledger.entries)
        )
        if rel is not None and rel.get("unreadable"):
            raise ServiceError(
                f"the ledger anchor {rel['where']} is unreadable; restore it "
                "from a backup (it records how far the ledger had come)"
            )
        if rel is not None:
            anchors.append((rel["where"], rel))
        probe = getattr(self.source, "committed_metadata", None)
        metadata = [
            parse_kafka_metadata(m).get(self.anchor_name) for m in (probe() if probe else [])
        ]
        kafka: list[dict] = [h for h in metadata if h]
        if kafka:
            anchors.append(
                (
                    f"the committed offsets of group {self.cfg.source.group!r}",
                    max(kafka, key=lambda h: h["seq"]),
                )
            )
        elif probe is None and not self._anchor_note_logged:
            self._anchor_note_logged = True
            log.info(
                "the privacy ledger is anchored in the checkpoint and in release.dir only "
                "(no Kafka group): a state directory restored together with release.dir "
                "from one backup cannot be detected"
            )
        for where, head in anchors:
            problem = self.ledger.anchor_problem(head)
            if (
                problem
                and ckpt is None
                and not self.ledger.path.exists()
                and where.startswith("the committed offsets of group")
            ):
                # a new directory on a group another one used: not only a lost ledger
                raise ServiceError(
                    f"checkpoint.dir {self.dir} is new, but consumer group "
                    f"{self.cfg.source.group!r} has committed offsets of a state directory "
                    f"whose ledger had {head['seq']} entries: another state directory (or a lost "
                    "one) counted this topic. Use that state directory (restore it from a backup "
                    "if it was lost), or another source.group to count the topic anew"
                )
            if problem:
                raise ServiceError(
                    f"{problem} (its head, entry {head['seq']}, is recorded in {where}); the "
                    "ledger is the record of privacy spent: restore the latest ledger and state "
                    "directory; without them the events it charged would be released again"
                )

    def check_replayable(self, offsets: dict) -> None:
        """Refuse to start if the source could not replay the open window from ``offsets``
        after a crash (the checkpoint holds no counters: the source is its only copy)."""
        probe = getattr(self.source, "replay_problem", None)
        if probe is None:
            return
        w = self.cfg.window
        problem = probe(dict(offsets), w.size if w.kind in ("time", "event_time") else None)
        if problem:
            raise ServiceError(problem)

    def start_offsets(self, committed: bool) -> tuple[dict[str, int], str]:
        """Where a new state directory starts (``source.start``), and that in words."""
        src = self.cfg.source
        start = parse_start(src.start) if src.kind == "kafka" else "earliest"
        probe = getattr(self.source, "initial_offsets", None)
        if start == "earliest":
            if committed and self.fresh_start:
                return {}, "the group's committed offsets (--fresh-start)"
            # a Kafka topic's first retained records, as offsets: records its retention deletes
            # before they are read are then seen as deleted (stages/retention.py), not skipped
            offsets = probe("earliest") if probe is not None else None
            if not offsets:
                return {}, (
                    "the earliest retained records"
                    if src.kind == "kafka"
                    else "the start of the input"
                )
            where = ", ".join(f"{k} at {v}" for k, v in sorted(offsets.items()))
            return offsets, f"the earliest retained records: {where}"
        offsets = probe(start) if probe is not None else None
        if not offsets:
            raise ServiceError(
                f"source.start = {src.start}: the partitions of topic "
                f"{src.topic!r} are not known (does it exist?); create the "
                "topic, or start from earliest"
            )
        where = ", ".join(f"{k} at {v}" for k, v in sorted(offsets.items()))
        what = (
            "the latest offsets"
            if start == "latest"
            else f"the first records at or after {src.start}"
        )
        return offsets, f"{what} (source.start): {where}"

    def check_start_policy(self, where: str) -> None:
        """``source.start`` only places a new state directory; refuse one that asks for another
        start than the directory had (it resumes from its checkpoint: the setting would be
        silently ignored)."""
        wanted = self.cfg.source.start
        if parse_start(wanted) == "earliest":
            return
        had = (self.ledger.identity() or {}).get("start", "earliest")
        if parse_start(had) != parse_start(wanted):
            raise ServiceError(
                f"source.start = {wanted} only places a new state directory, but "
                f"{where} has a checkpoint (this directory started at {had}) and "
                "resumes from its offsets; for a new start at "
                f"{wanted} use a new checkpoint.dir, or remove source.start"
            )

    def check_not_rolled_back(self, window: dict, where: str) -> None:
        """Refuse a checkpoint older than the ledger (it would re-release windows)."""
        uid = window.get("uid")
        later = [
            e
            for e in self.ledger.releases()
            if isinstance(e.get("window"), int)
            and e["window"] >= window["id"]
            and e.get("window_uid") != uid
        ]
        if later:
            raise ServiceError(
                f"the checkpoint in {where} is older than the ledger: it is at window "
                f"{window['id']}, the ledger has window {later[-1]['window']} released. Restore "
                "the latest checkpoint (a rolled-back one would re-release windows), or start "
                "with --fresh-start after moving it away"
            )

    def check_state_matches_config(
        self, state: PanPrivateHistogram, where: str, *, direct: bool, size: int, epsilon: float
    ) -> None:
        """Refuse a restored state built with other settings than ``direct``, ``size`` (the
        configured D or B) and ``epsilon``."""
        if state.neighbor != "replace-one":
            raise ServiceError(
                f"{where} holds an {state.neighbor} state; the service counts "
                "under replace-one neighbours only (its offsets, metrics and count "
                "windows reveal n)"
            )
        mode = "direct" if direct else "hashed"
        if (state.mode, state.size, state.epsilon) != (mode, size, epsilon):
            raise ServiceError(
                f"{where} holds a {state.mode} state of size {state.size} at epsilon "
                f"{state.epsilon}, but the config asks for {mode}, size {size}, epsilon "
                f"{epsilon}; use the original settings or a new checkpoint.dir"
            )
