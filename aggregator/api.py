"""panagg as a library: feed your own records, get eps-DP releases (``aggregator.api``).

The service (``panagg run``) reads Kafka, files or the generator. This module puts the same
aggregator inside your own code (a consumer loop, a batch job, a notebook): you hand it records,
it counts them into the pan-private state, closes windows and returns each window's release.

It is not a second implementation. :class:`Aggregation` drives the service's own
:class:`aggregator.service.process.Aggregator` over an in-memory source: the same config
(:func:`settings` is :func:`aggregator.service.config.load_config`), the same decoder, the same
ledger (budget checked before any release noise is drawn, every release ledgered with its
document), the same checkpoints in ``checkpoint.dir``, the same release files in ``release.dir``
(and ``release.topic`` when set).

Exactly once, by offsets. Every record has an offset in its partition, as in Kafka: the ones you
pass (``feed_records(..., partition="logins:3", offsets=[...])``: your consumer's offsets), or by
default the count of records fed to that partition so far. The aggregator keeps the next offset
of each partition in its checkpoint; a record at an offset below it is already counted and is
skipped. The open window's counters live only in memory (a checkpoint holding them would let one
intrusion read the recent events exactly: docs/privacy.md), so after :meth:`Aggregation.close`
or a crash, the next :class:`Aggregation` on the same ``checkpoint.dir`` resumes at
:attr:`Aggregation.resume_offsets`: the open window's first records. Feed again from there
(a Kafka consumer seeks there; the example in docs/api.md does).

What leaves it is noised. An :class:`Aggregation` shows its stream, window number and positions,
never a count of the open window; a :class:`Release` holds a release document (computed from
noisy counters and public quantities, docs/release-schema.md) and its ledger entry.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> cfg = settings(settings={"checkpoint.dir": d / "state", "release.dir": d / "releases",
...                          "state.domain_size": 1000, "window.kind": "count",
...                          "window.size": 5000, "release.plan_errors": False})
>>> with Aggregation(cfg) as agg:
...     releases = agg.feed([i % 300 for i in range(6000)])    # window 0 fills at 5,000
...     last = agg.release()                                     # window 1 now: 1,000 events
>>> [r.window for r in releases], last.window, last.n, last.epsilon, last.privacy_unit
([0], 1, 1000, 1.0, 'event')
>>> lo, hi = releases[0].distinct_items.interval
>>> lo <= hi and releases[0].ledger["kind"] == "release"
True
>>> Release.read(d / "releases" / "release-0.json") == releases[0].without_ledger()
True
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from consumers.base import Segment, Source

from .release import headline
from .service.config import ConfigError, load_config
from .service.identity import identity_of
from .service.process import Aggregator
from .service.settings import Config

__all__ = ["Aggregation", "Figure", "Release", "ReleaseRefused", "settings"]

#: the partition of records fed without one
DEFAULT_PARTITION = "api"


def settings(
    path: str | os.PathLike | None = None,
    settings: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Any:
    """The service's configuration (:class:`aggregator.service.settings.Config`): the defaults,
    then the TOML file ``path``, then ``PANAGG_<SECTION>_<KEY>`` variables of ``env`` (the
    process environment if None), then ``settings`` as ``{"section.key": value}`` (what
    ``--set section.key=value`` does). Every value is checked as for the service: a bad one raises
    :class:`aggregator.service.config.ConfigError` with one line. docs/configuration.md lists
    every key.

    >>> settings(settings={"state.epsilon": 0.5}).state.epsilon
    0.5
    """

    sets = [f"{key}={_text(value)}" for key, value in (settings or {}).items()]
    return load_config(
        str(path) if path is not None else None, sets, env=dict(os.environ if env is None else env)
    )


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


@dataclass(frozen=True)
class Figure:
    """One headline statistic: the released ``value``, its ``interval`` [lo, hi] at the
    release's ``interval_level`` and its ``expected_relative_error`` (None where the release
    has no intervals: ``release.error_bar_reps = 0``, loss ``l2``)."""

    value: float | None
    interval: tuple[float, float] | None
    expected_relative_error: float | None

    @classmethod
    def from_block(cls, block: Mapping[str, Any] | None) -> Figure:
        block = block or {}
        iv = block.get("interval")
        return cls(
            block.get("value"),
            (float(iv[0]), float(iv[1])) if iv else None,
            block.get("expected_relative_error"),
        )


@dataclass(frozen=True, eq=False)
class Release:
    """One window's release: the document's headline as attributes, the whole document in
    :attr:`document` and, for a release this process made or read from a ledger, the ledger entry
    that charged it (:attr:`ledger`: its ``epsilon_spent``, the source ``ranges`` it covers, the
    ledger's hash chain fields; the document itself is :attr:`document`, not repeated there).

    Two releases are equal when their documents and ledger entries are.
    """

    document: Mapping[str, Any] = field(repr=False)
    ledger: Mapping[str, Any] | None = field(default=None, repr=False)

    # -- reading -------------------------------------------------------------------------------
    @classmethod
    def from_document(
        cls, document: Mapping[str, Any] | str | bytes, ledger: Mapping[str, Any] | None = None
    ) -> Release:
        """A release from its document (a dict, or its JSON text)."""
        doc = json.loads(document) if isinstance(document, (str, bytes)) else dict(document)
        if doc.get("format") != "panagg.release":
            raise ValueError(f"not a panagg release document (format {doc.get('format')!r})")
        if ledger is not None:
            ledger = {k: v for k, v in ledger.items() if k != "document"}
        return cls(doc, ledger)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Release:
        """A release document as written to ``release.dir`` (``release-<window>.json``) or sent
        to ``release.topic`` (the message value, saved to a file). No ledger entry: use
        :meth:`from_ledger` for that."""
        return cls.from_document(Path(path).read_text())

    @classmethod
    def from_ledger(cls, ledger_path: str | os.PathLike) -> list[Release]:
        """Every release a ledger (``checkpoint.dir/ledger.jsonl``) holds, in order, each with
        its entry."""
        out = []
        for line in Path(ledger_path).read_text().splitlines():
            entry = json.loads(line) if line.strip() else {}
            if entry.get("kind") == "release" and entry.get("document"):
                out.append(cls.from_document(entry["document"], entry))
        return out

    def without_ledger(self) -> Release:
        """The same release without its ledger entry (as :meth:`read` gives it)."""
        return Release(self.document)

    # -- the headline --------------------------------------------------------------------------
    @property
    def headline(self) -> Mapping[str, Any]:
        """The document's ``headline`` block (computed from its detail for documents older
        than the block: :func:`aggregator.release.headline`)."""
        head = self.document.get("headline")
        if head is None:
            head = headline(dict(self.document))
        return head

    @property
    def window(self) -> int | str:
        return self.document["window"]

    @property
    def n(self) -> int | None:
        """Events in the window (public under replace-one neighbours; None otherwise)."""
        return self.document.get("n")

    @property
    def epsilon(self) -> float:
        """The window's eps (per release; the ledger entry says what it charged)."""
        return float(self.document["epsilon"])

    @property
    def epsilon_spent(self) -> float | None:
        """What the ledger charged for this release (0 for an empty window), if known."""
        return None if self.ledger is None else float(self.ledger["epsilon_spent"])

    @property
    def privacy_unit(self) -> str:
        """What neighbours differ in: ``"event"``."""
        return str(self.headline["privacy_unit"])

    @property
    def privacy_unit_consequence(self) -> str:
        return str(self.headline["privacy_unit_consequence"])

    @property
    def distinct_items(self) -> Figure:
        return Figure.from_block(self.headline.get("distinct_items"))

    @property
    def entropy_nats(self) -> Figure:
        return Figure.from_block(self.headline.get("entropy_nats"))

    @property
    def interval_level(self) -> float | None:
        return self.headline.get("interval_level")

    @property
    def signal_below_noise(self) -> bool | None:
        """Read first: True means the figures are mostly noise, however normal they look."""
        return self.headline.get("signal_below_noise")

    @property
    def signal_to_noise(self) -> float | None:
        return self.headline.get("signal_to_noise")

    @property
    def histogram(self) -> list[tuple[int, int]]:
        """The anonymized histogram: (r, phi_r) pairs, phi_r items seen r times, r descending."""
        return [(int(r), int(phi)) for r, phi in self.document["histogram"]["pairs"]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Release):
            return NotImplemented
        return dict(self.document) == dict(other.document) and (
            dict(self.ledger) if self.ledger is not None else None
        ) == (dict(other.ledger) if other.ledger is not None else None)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        d = self.distinct_items
        return (
            f"Release(window={self.window!r}, n={self.n}, epsilon={self.epsilon:g}, "
            f"distinct_items={d.value} {list(d.interval) if d.interval else ''}, "
            f"signal_below_noise={self.signal_below_noise})"
        )


def _not_yet(cfg: Any) -> str | None:
    """What the API does not drive (one phrase), or None."""
    if cfg.window.kind == "event_time":
        return (
            "windows by record timestamps (window.kind = event_time, or time windows of "
            "a Kafka source with window.clock = auto): set window.clock = process"
        )
    if cfg.aggregations:
        return "several aggregations of one stream ([aggregations.NAME])"
    if cfg.scale.partitioned:
        return "a scale-out group (scale.partitioned)"
    if cfg.state.model == "shuffle":
        return "the shuffle model's analyzer (state.model = shuffle)"
    return None


class ReleaseRefused(RuntimeError):
    """The ledger refused a window's release (the budget is spent); the refusal is in the
    ledger, the window's counters are gone and nothing about it is released."""


class Aggregation:
    """One pan-private aggregation you feed: the service's aggregator in your process.

    Parameters
    ----------
    config
        From :func:`settings` (or :func:`aggregator.service.config.load_config`): the service's
        settings, ``checkpoint.dir`` (state, ledger, checkpoints) and ``release.dir`` included.
        ``source.kind`` and ``source.topic`` (or ``source.path``) name the stream in the ledger
        and in every release (``counted.stream``); nothing is read from them. Releases are
        computed in the caller's thread (``release.workers`` is taken as 0).
    fresh_start, accept_change
        As ``panagg run --fresh-start`` / ``--accept-change``.

    The directory is locked while the aggregation is open (one process per ``checkpoint.dir``,
    as for the service). Close it (:meth:`close`, or ``with``) to release the lock.
    """

    def __init__(self, config: Any, *, fresh_start: bool = False, accept_change: bool = False):
        cfg = Config.from_mapping(config).updated({"release": {"workers": 0}})
        why = _not_yet(cfg)
        if why:
            raise ConfigError(f"aggregator.api does not run {why} yet; use panagg run for it")

        class FedSource(Source):
            """The caller's records: nothing to poll. :meth:`seek` says where to resume; a
            partition the service holds (a replay that reached its end in one partition before
            the others: :meth:`~aggregator.service.stages.intake.Intake.hold`) keeps its later
            records back until the window closes (:meth:`Aggregation._turn`)."""

            def __init__(self) -> None:
                self.resumed_at: dict[str, int] = {}
                self.held: set[str] = set()

            def seek(self, offsets: dict[str, int]) -> None:
                self.resumed_at = {str(p): int(o) for p, o in offsets.items()}

            def poll(self, timeout_s: float = 1.0) -> list:
                return []

            def seek_partition(self, partition: str, offset: int) -> None:
                pass  # the records from ``offset`` on are kept back: Aggregation._turn

            def pause(self, partitions: list[str]) -> None:
                self.held.update(partitions)

            def resume(self, partitions: list[str]) -> None:
                self.held.difference_update(partitions)

        self._source = FedSource()
        #: records of held partitions not counted yet, fed once the hold ends
        self._backlog: dict[str, list] = {}
        self._agg = Aggregator(
            cfg, self._source, fresh_start=fresh_start, accept_change=accept_change
        )
        self._open = False
        agg = self._agg
        agg._lock()
        try:
            agg.start()
        except BaseException:
            agg.close()
            agg.claim.remove_created()
            raise
        self._open = True
        #: ledger entries already looked at (releases before this start are not returned)
        self._seen = len(agg.ledger.entries)

    # -- what it shows -------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        """The effective configuration (:class:`aggregator.service.settings.Config`)."""
        return self._agg.cfg

    @property
    def stream(self) -> str:
        """The stream as the ledger and every release name it (``counted.stream``)."""
        return str(identity_of(self._agg.cfg)["stream"])

    @property
    def window(self) -> int:
        """The open window's number."""
        return int(self._agg.task.window["id"])

    @property
    def resume_offsets(self) -> dict[str, int]:
        """Where this start resumed: per partition, the offset of the first record not in the
        last checkpoint's totals (the open window's start). Feed from there after a restart;
        records below are skipped either way."""
        return dict(self._source.resumed_at)

    def position(self, partition: str = DEFAULT_PARTITION) -> int:
        """The next offset ``partition`` expects (0 for one never fed)."""
        return int(self._agg.task.offsets.get(partition, 0))

    def __repr__(self) -> str:
        state = f"window {self.window}" if self._open else "closed"
        return (
            f"Aggregation(stream={self.stream!r}, epsilon={self._agg.epsilon:g}, "
            f"checkpoint_dir={str(self._agg.dir)!r}, {state})"
        )

    # -- feeding -------------------------------------------------------------------------------
    def feed_records(
        self,
        values: Iterable[bytes],
        *,
        partition: str = DEFAULT_PARTITION,
        offsets: Sequence[int] | None = None,
        keys: Sequence | None = None,
        headers: Sequence | None = None,
        timestamps: Sequence | None = None,
    ) -> list[Release]:
        """Count raw records (message values, decoded as the service decodes ``source.format``
        with ``[item]``; a bad record is a reject with a reason, and a dead letter with
        ``source.dead_letter_topic``, never an exception).

        ``offsets`` (increasing) are the records' offsets in ``partition``; by default they
        follow on from :meth:`position`. Records below the partition's position are already
        counted and are skipped. ``keys``, ``headers`` (``[(name, bytes), ...]`` each) and
        ``timestamps`` (ms) as Kafka has them, where ``[item]`` or event-time windows use them.

        Returns the releases of the windows that closed meanwhile (count windows that filled;
        time windows whose time is up), in window order.
        """

        self._check_open()
        vals = list(values)
        start = self.position(partition)
        if offsets is None:
            offs: Sequence[int] = range(start, start + len(vals))
        else:
            offs = [int(o) for o in offsets]
            if len(offs) != len(vals):
                raise ValueError(f"{len(vals)} values but {len(offs)} offsets")
            if any(b <= a for a, b in zip(offs, offs[1:])):
                raise ValueError("offsets must increase")
        skip = next((i for i, o in enumerate(offs) if o >= start), len(offs))

        def tail(seq: Sequence | None) -> Sequence | None:
            if seq is None:
                return None
            seq = list(seq)
            if len(seq) != len(vals):
                raise ValueError(f"{len(vals)} values but {len(seq)} keys/headers/timestamps")
            return seq[skip:]

        seg = Segment(
            partition,
            offs[skip:],
            vals[skip:],
            keys=tail(keys),
            headers=tail(headers),
            timestamps=tail(timestamps),
        )
        return self._turn([seg] if len(seg) else [])

    def feed(
        self, items: Iterable[int | str | bytes], *, partition: str = DEFAULT_PARTITION
    ) -> list[Release]:
        """Count items: each becomes one record ``{item.field: item}`` in ``source.format``
        (``item.source = "key"``: a record keyed by the item), decoded and counted as the
        service counts records (:meth:`feed_records`, offsets following on)."""
        cfg = self._agg.cfg
        it = cfg.item
        if it.filter_field or it.source == "header":
            raise ValueError(
                "feed() makes records of bare items; with item.filter_field or "
                "item.source = header, build the records and use feed_records()"
            )
        items = list(items)
        if it.source == "key":
            keys = [i if isinstance(i, bytes) else str(i).encode() for i in items]
            return self.feed_records([b""] * len(items), partition=partition, keys=keys)
        path = it.field.split(".")
        if any(seg.isdigit() for seg in path):
            raise ValueError(
                f"feed() cannot build item.field = {it.field!r} (a list index); "
                "build the records and use feed_records()"
            )
        if cfg.source.format == "json":

            def encode(doc: dict) -> bytes:
                return json.dumps(doc).encode()
        else:
            encode = msgpack.Packer().pack

        def record(item: Any) -> bytes:
            doc: Any = (
                item.decode() if isinstance(item, bytes) and cfg.source.format == "json" else item
            )
            for seg in reversed(path):
                doc = {seg: doc}
            return encode(doc)

        return self.feed_records([record(i) for i in items], partition=partition)

    def tick(self) -> list[Release]:
        """A turn without records: closes a time window whose time is up, retries publishing.
        Returns the releases made."""
        self._check_open()
        return self._turn([])

    # -- releases ------------------------------------------------------------------------------
    def release(self) -> Release:
        """Close the open window now (as ``panagg release``) and return its release; the next
        window opens. Raises :class:`ReleaseRefused` when the ledger refuses it."""
        self._check_open()
        wid = self.window
        seen = self._seen
        self._agg.close_window()
        refused = [
            e
            for e in self._agg.ledger.entries[seen:]
            if e.get("kind") == "refused" and e.get("window") == wid
        ]
        mine = [r for r in self._new_releases() if r.window == wid]
        if not mine:
            why = refused[-1].get("note") if refused else None
            raise ReleaseRefused(
                f"the release of window {wid} was refused by the ledger"
                + (f": {why}" if why else "")
            )
        return mine[0]

    close_window = release

    def releases(self) -> list[Release]:
        """Every release in this aggregation's ledger (earlier starts included), in order."""
        return Release.from_ledger(self._agg.ledger.path)

    # -- the loop ------------------------------------------------------------------------------
    def _turn(self, segments: list) -> list[Release]:
        agg, src = self._agg, self._source
        queue: list = list(segments) or [None]  # (None: a turn without records)
        while queue:
            seg = queue.pop(0)
            if seg is not None and seg.partition in src.held:
                self._backlog.setdefault(seg.partition, []).append(seg)
                continue
            agg.turn([] if seg is None else [seg])
            if seg is not None and seg.partition in src.held:
                rest = self._rest(seg)  # what the hold left of it waits for the hold's end
                if rest is not None:
                    self._backlog.setdefault(seg.partition, []).append(rest)
            for p in [p for p in self._backlog if p not in src.held]:
                queue += self._backlog.pop(p)
        return self._new_releases()

    def _rest(self, seg: Any) -> Any:
        """The records of ``seg`` the aggregator did not take in (its partition held), or None."""

        pos = self.position(seg.partition)
        offs = list(seg.offsets)
        i = next((k for k, o in enumerate(offs) if o >= pos), len(offs))
        if i == len(offs):
            return None

        def cut(seq: Any) -> Any:
            return None if seq is None else list(seq)[i:]

        return Segment(
            seg.partition,
            offs[i:],
            seg.values[i:],
            keys=cut(seg.keys),
            headers=cut(seg.headers),
            timestamps=cut(seg.timestamps),
        )

    def _new_releases(self) -> list[Release]:
        entries = self._agg.ledger.entries
        new, self._seen = entries[self._seen :], len(entries)
        return [
            Release.from_document(e["document"], e)
            for e in new
            if e.get("kind") == "release" and e.get("document")
        ]

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                "this Aggregation is closed; open a new one on the same checkpoint.dir to go on"
            )

    def close(self) -> None:
        """Publish what is pending, stop, unlock the directory. The open window is not
        released: the next :class:`Aggregation` on this ``checkpoint.dir`` replays it from
        :attr:`resume_offsets` (call :meth:`release` first to release it now)."""
        if not self._open:
            return
        self._open = False
        try:
            self._agg.finish()
        finally:
            self._agg.close()

    def __enter__(self) -> Aggregation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
