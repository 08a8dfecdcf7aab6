"""The service's settings as typed, read-only objects: one frozen dataclass per config section
(its keys, their types and defaults, what each means), and :class:`Config`, the whole validated
configuration.

:func:`aggregator.service.config.load_config` merges the defaults, a TOML file, the environment
and ``--set`` flags, validates them once and returns a :class:`Config`. Code reads it by
attribute (``cfg.state.epsilon``); a changed setting is a new object (:meth:`Config.updated`),
never an edit in place, so every component that holds the config sees the same one.

Each section is also a read-only mapping of its keys (``dict(cfg.state)``, ``cfg.to_dict()``):
the effective config a service saves, the ledger's identity and the Kafka client options are
built from it.

>>> cfg = Config()
>>> cfg.state.epsilon, cfg.window.kind
(1.0, 'count')
>>> cfg.updated({"state": {"epsilon": 0.5}}).state.epsilon
0.5
>>> cfg.state.epsilon = 2
Traceback (most recent call last):
...
dataclasses.FrozenInstanceError: cannot assign to field 'epsilon'

Declared once
-------------

Every setting is declared here and nowhere else: its field says its type and default, and
:func:`setting` puts beside them in the field's metadata all that is known of it (a
:class:`Setting`): what it means (``doc``, the reference in docs/configuration.md; ``brief``,
the comment in deploy/panagg.example.toml), the values it takes (``choices``, ``bounds``),
whether a state directory is tied to it (``identity``: the key of the ledger's identity it
enters, aggregator/service/identity.py), whether every member of a scale-out group must have
the same (``agree``: the key of the group's identity, aggregator/service/group/pipeline.py),
and whether it is a test hook (``test_only``) or a secret (``secret``). The loader checks choices
and bounds from it, the identity and the group's check are computed from it, and
``python -m aggregator.service.settings_doc --write`` writes the tables of
docs/configuration.md and deploy/panagg.example.toml from it (tests/test_settings_doc.py fails
when they differ).

>>> SETTINGS["state.epsilon"].identity, SETTINGS["state.epsilon"].agree
('epsilon', 'epsilon')
>>> SETTINGS["window.late"].choices
('next', 'dead_letter')
>>> [str(b) for b in SETTINGS["state.epsilon"].bounds]
['> 0', '>= 0.001']

Why dataclass field metadata and not pydantic-settings: the sections already are frozen
dataclasses that the whole service reads, the metadata is the standard library's own place for
facts about a field, and the loader's one-line errors (tests/test_operator_mistakes.py) are the
house's; a validation library would add a dependency and a second error format for what is a
dict of facts and a loop.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..estimators import METHODS

__all__ = [
    "Section",
    "Config",
    "AggregationSettings",
    "SECTIONS",
    "SETTINGS",
    "Setting",
    "Bound",
    "setting",
    "settings_by",
    "defaults",
]


@dataclass(frozen=True)
class Bound:
    """A range a number setting must be in, and how an error says it (``says``: "must be ...").

    >>> Bound(0, open_low=True).holds(0), str(Bound(0, 1, open_low=True, open_high=True))
    (False, 'in (0, 1)')
    """

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    says: str = ""

    def holds(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def __str__(self) -> str:
        """The range in the reference's notation: ``> 0``, ``>= 0``, ``in (0, 1)``."""
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        return (
            f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}"
            f"{')' if self.open_high else ']'}"
        )

    @property
    def message(self) -> str:
        return self.says or str(self)


POSITIVE = Bound(0, open_low=True, says="positive")
NON_NEGATIVE = Bound(0, says=">= 0")


@dataclass(frozen=True)
class Setting:
    """What is declared of one setting (:func:`setting`); ``section`` and ``key`` are filled in
    once the sections are known (:data:`SETTINGS`)."""

    default: object
    doc: str
    brief: str = ""
    choices: tuple = ()
    bounds: tuple[Bound, ...] = ()
    #: the key of the ledger's identity this setting enters (identity.py), None: none
    identity: str | None = None
    #: the key of a scale-out group's identity every member must agree on (group/pipeline.py;
    #: a key added later needs what older groups meant in pipeline._IDENTITY_DEFAULTS)
    agree: str | None = None
    test_only: bool = False
    secret: bool = False
    #: the value deploy/panagg.example.toml shows (None: the default)
    example: object = None
    #: how the reference shows the default, where the value alone does not say it
    shown_default: str | None = None
    #: how a state directory treats it, where that is not its identity (the reference's table)
    note: str = ""
    section: str = ""
    key: str = ""

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def example_value(self):
        return self.default if self.example is None else self.example

    def problem(self, value) -> str | None:
        """Why ``value`` (already of the setting's type) is not allowed: the middle of the
        loader's one-line error, "must be ..., got ...", or None. A secret is never echoed."""
        got = f"a {type(value).__name__}" if self.secret else repr(value)
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, got {got}"
        for bound in self.bounds:
            if not bound.holds(value):
                return f"must be {bound.message}, got {got}"
        return None


def setting(default, *, doc: str, **facts):
    """A section's field: ``default`` and the :class:`Setting` that declares it (its other
    keyword arguments), kept in the field's metadata."""
    return field(default=default, metadata={"setting": Setting(default, doc, **facts)})


class _Fields(Mapping):
    """A frozen dataclass's fields as a read-only mapping: those :meth:`_keys` shows."""

    def __getitem__(self, key):
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    def _keys(self) -> tuple[str, ...]:
        raise NotImplementedError


@functools.cache
def _field_defaults(cls) -> tuple[tuple[str, bool, object], ...]:
    """Each field of a section class as (name, derived, default), in order: computed once per
    class, as the mapping view reads them at every lookup."""
    return tuple(
        (f.name, bool(f.metadata.get("derived")), f.default) for f in dataclasses.fields(cls)
    )


class Section(_Fields):
    """A config section: attributes for code, a read-only mapping of its keys for serialization.

    A field whose metadata says ``derived`` is set by validation, not by the user: it is left
    out of :func:`defaults` (so no file or flag can set it) and out of the mapping while it holds
    its default (the saved effective config is what the user's settings resolved to).
    """

    def _keys(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, derived, default in _field_defaults(type(self))
            if not (derived and getattr(self, name) == default)
        )

    @classmethod
    def from_mapping(cls, values: Mapping | None):
        """The section from a mapping of its keys (missing keys take their defaults); a list
        becomes a tuple, so the object stays read-only."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {
            k: (tuple(v) if isinstance(v, list) else v)
            for k, v in (values or {}).items()
            if k in known
        }
        return cls(**given)

    def to_dict(self) -> dict:
        """A plain dict copy (tuples as lists, as TOML and JSON have them)."""
        return {k: list(v) if isinstance(v, tuple) else copy.deepcopy(v) for k, v in self.items()}


@dataclass(frozen=True, eq=False)
class SourceSettings(Section):
    """[source]: where the records come from and how they are read"""

    kind: str = setting(
        "kafka",
        choices=("kafka", "file", "generator"),
        identity="stream",
        brief="kafka | file | generator",
        doc="`kafka`, `file` (JSON lines or msgpack stream; `-` = stdin) or `generator` "
        "(synthetic Zipf logins)",
    )
    client: str = setting(
        "kafka-python",
        choices=("kafka-python", "confluent"),
        brief="kafka-python | confluent (librdkafka: pip install 'panagg[confluent]')",
        doc="the Kafka client the source reads with: `kafka-python` (the default, pure Python) "
        "or `confluent` (confluent-kafka on librdkafka, parsing records in C: several times "
        'the events/s on one core, docs/e2e.md "Which Kafka client"; install it with '
        "`pip install 'panagg[confluent]'`). The same exactly-once contract either way. A "
        "scale-out group's members and the shuffler run on kafka-python for now",
    )
    bootstrap: str = setting(
        "127.0.0.1:9092", brief="Kafka bootstrap servers", doc="Kafka bootstrap servers"
    )
    topic: str = setting(
        "events",
        identity="stream",
        example="logins",
        brief="key records by the counted item (needed for scale-out)",
        doc="topic to count; key it by the counted item if you scale out",
    )
    group: str = setting(
        "panagg",
        identity="group",
        brief="committed offsets are for lag monitoring only",
        doc="consumer group (committed offsets are for lag monitoring only)",
    )
    instance_id: str = setting(
        "",
        shown_default="empty (derived)",
        brief="static membership id; empty: derived from checkpoint.dir (scale.partitioned: give "
        "every member its own, e.g. the host)",
        doc="Kafka static membership id; default: a hash of `checkpoint.dir`, so a restarted "
        "process takes its partitions back at once. With `scale.partitioned` each member has "
        "its own local `checkpoint.dir`; give each its own id (empty = dynamic membership)",
    )
    start: str = setting(
        "earliest",
        note="checked apart: it places a new directory only; a different start on a directory "
        "with a checkpoint is refused",
        brief='a new state dir starts at: earliest | latest | a time ("2026-11-20T00:00:00Z"); an'
        " existing one resumes from its checkpoint",
        doc="where a **new** state directory starts in the topic: `earliest` (the earliest "
        "retained records; with `--fresh-start`, the group's committed offsets), `latest` "
        "(the end of every partition now: only records produced from now on) or a time in ISO"
        " 8601 with its zone, e.g. `2026-11-20T00:00:00Z` (per partition the first record "
        "whose timestamp is at or after it, Kafka's offsetsForTimes; the end where there is "
        "none). The start line says where it started (`no checkpoint in ...: starting window "
        "0 at the latest offsets (source.start): logins:0 at 1234, ...`) and the first "
        "checkpoint holds those offsets, so a crash before the first window closes replays "
        "from the same place. A directory with a checkpoint resumes from it; `latest` or a "
        "time other than the one the directory started with is then refused with one line (it"
        " would be silently ignored): use a new `checkpoint.dir`. Kafka only. In a scale-out "
        "group it places a **new group**: the first member to write the group's identity "
        "commits the source group's offsets and the intake's marks at that start in the "
        "identity's transaction (`new group G starts at ...`); a member asking another start "
        "of an existing group is refused with one line",
    )
    connect_timeout_s: float = setting(
        30.0,
        bounds=(POSITIVE,),
        brief="stop with one clear line if no broker answers in time",
        doc="stop with one clear line if no broker answers within this time",
    )
    session_timeout_s: float = setting(
        45.0,
        bounds=(POSITIVE,),
        brief="a dead member's partitions move to the others after this",
        doc="Kafka group session timeout: a dead member's partitions move to the others after "
        "this (broker minimum 6)",
    )
    stall_timeout_s: float = setting(
        30.0,
        bounds=(NON_NEGATIVE,),
        brief="rebuild a Kafka consumer that delivers nothing this long while records wait; 0: off",
        doc="intake stall: when the Kafka consumer holds partitions that have records waiting "
        "(the broker's end offsets past the service's positions) and delivers none for this "
        "long, the service says so once (WARNING `Kafka intake stalled`), is not ready "
        "(/ready 503), counts it in `panagg_consumer_rebuilds_total` and replaces the "
        "consumer with a new one that resumes at the service's own offsets (nothing lost or "
        "counted twice); seen with `source.client = confluent` after a clean broker restart "
        '(docs/operations.md, "Intake stalled"). 0: off',
    )
    format: str = setting(
        "msgpack",
        choices=("msgpack", "json"),
        identity="format",
        brief='msgpack | json; schema {"item": <str|bytes|int>, ...}',
        doc='message encoding: `msgpack` or `json`; by default the schema is `{"item": <str, '
        "bytes or int>, ...}` (other schemas: the `[item]` section below)",
    )
    max_records: int = setting(
        20000,
        bounds=(POSITIVE,),
        brief="records per poll, counted as one batch (in flight)",
        doc="records per poll (the batch counted at once; plaintext in memory until counted)",
    )
    fetch_max_bytes: int = setting(
        16777216,
        bounds=(POSITIVE,),
        shown_default="16777216 (16 MiB)",
        brief="Kafka fetch buffer: plaintext records not yet counted",
        doc="Kafka client fetch buffer: records fetched but not yet counted are plaintext in "
        'memory (docs/privacy.md, "In flight"); lower it (and '
        "`source.max_partition_fetch_bytes`) to shrink that exposure",
    )
    max_partition_fetch_bytes: int = setting(
        4194304,
        bounds=(POSITIVE,),
        shown_default="4194304 (4 MiB)",
        brief="per partition, within fetch_max_bytes",
        doc="the same per partition, within `source.fetch_max_bytes`",
    )
    dead_letter_topic: str = setting(
        "",
        brief="topic for rejected messages; empty: none",
        doc="Kafka topic for rejected messages (key = `<partition>@<offset>` of the source "
        "record, headers `reason`, `source`, `key` = the source record's own key when it had "
        "one, and `truncated` = original length for a value too large for one request, sent "
        "empty); at least once: acknowledged before every checkpoint, re-sent (same key) when"
        " a window is replayed; empty: none. Records left out by `item.filter_field` are not "
        "rejects and are not sent",
    )
    path: str = setting(
        "",
        identity="stream",
        brief='file source only: a path, or "-" for stdin',
        doc="file source: path, or `-` for stdin",
    )
    max_message_bytes: int = setting(
        65536,
        bounds=(POSITIVE,),
        brief='longer messages are rejected as "oversized"',
        doc="longer messages are rejected as `oversized`",
    )
    max_item_bytes: int = setting(
        1024,
        bounds=(POSITIVE,),
        brief='longer str/bytes items are rejected as "oversized"',
        doc="longer str/bytes items are rejected as `oversized`",
    )
    generator_events: int = setting(
        1000000,
        bounds=(NON_NEGATIVE,),
        brief="generator source only (synthetic Zipf logins)",
        doc="generator source (synthetic Zipf logins): events to generate",
    )
    generator_zipf: float = setting(
        1.1,
        brief="generator source: Zipf exponent",
        doc="generator source: the Zipf exponent of the items",
    )
    generator_rate: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        brief="events/s; 0 = as fast as possible",
        doc="generator source: events per second (0 = unthrottled)",
    )
    generator_seed: int = setting(
        -1, brief="-1: fresh", doc="generator source: the data's seed (-1: fresh)"
    )


@dataclass(frozen=True, eq=False)
class ItemSettings(Section):
    """[item]: which part of a record is the counted item"""

    source: str = setting(
        "value",
        choices=("value", "key", "header"),
        identity="item",
        brief="value | key (record key) | header",
        doc="where the item is: `value` (a field of the message, `item.field`), `key` (the Kafka "
        "record key) or `header` (a Kafka header, `item.header`). `key` and `header` need "
        "`source.kind = kafka`; without a filter the value is then not decoded at all",
    )
    field: str = setting(
        "item",
        identity="item",
        brief='value: dotted path, e.g. "user.id"',
        doc="dotted field path in the value, e.g. `user.id`; a segment of digits indexes a list "
        "(`ids.0`). A record without it is rejected as `missing_item`",
    )
    header: str = setting(
        "",
        identity="item",
        brief='source = "header": the header\'s name',
        doc="`item.source = header`: the header's name; if a record repeats it, the last one wins",
    )
    coerce: bool = setting(
        False,
        identity="item",
        brief='direct mode: "00042" counts as 42',
        doc='direct mode: a string of ASCII digits (`"00042"`, at most 40 digits) counts as that '
        "int; signs, spaces, `_` and non-ASCII digits stay `wrong_type`. Keys and headers are"
        " always read this way in direct mode (bytes are no int). Hashed mode needs no "
        'coercion: `42`, `"42"` and `b"42"` already hash as one item',
    )
    normalize: str = setting(
        "none",
        choices=("none", "nfc"),
        identity="item",
        brief="hashed mode: none | nfc",
        doc="hashed mode, text items: `nfc` applies Unicode NFC, so composed and decomposed "
        'spellings (`"é"`, `"e\\u0301"`) are one item. Keys and headers are normalised when '
        "they are UTF-8, counted as bytes otherwise",
    )
    casefold: bool = setting(
        False,
        identity="item",
        brief="hashed mode: Unicode case folding",
        doc='hashed mode, text items: Unicode case folding (`"ZOË"`, `"zoë"` one item; `"ß"` '
        'becomes `"ss"`). With `nfc` the folded text is NFC again. `source.max_item_bytes` '
        "applies to the normalised item",
    )
    filter_field: str = setting(
        "",
        identity="item",
        brief='e.g. "event": only records with ...',
        doc="only records whose value has `filter_value` at the dotted path `filter_field` are "
        "events; the field is compared as text (strings as they are, ints in decimal, "
        "booleans `true`/`false`). The others, the field missing included, are *filtered*: "
        "not events, not rejects, no dead letter, counted by `panagg_filtered_records_total` "
        "(exactly once across restarts, like rejects). What a filter means for privacy: "
        "docs/privacy.md, section 17",
    )
    filter_value: str = setting(
        "",
        identity="item",
        brief='... e.g. "login" are events; the rest are filtered (not rejects)',
        doc="the value `item.filter_field` must have for a record to be an event (compared as "
        "text; see there)",
    )
    filter_exclude: tuple[str, ...] = setting(
        (),
        identity="item",
        brief="with filter_field and no filter_value: records with one of these are filtered",
        doc="with `item.filter_field` and an empty `filter_value`: the records whose field is one "
        "of these (compared as text) are filtered, all others are events (the field missing "
        "included). A `[breakdown]` sets it for its `other` key",
    )


@dataclass(frozen=True, eq=False)
class SecuritySettings(Section):
    """[security]: every Kafka client (consumer, admin, producers); secrets are read from a file
    or the environment, never logged."""

    protocol: str = setting(
        "PLAINTEXT",
        choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
        brief="PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL (production: SASL_SSL)",
        doc="Kafka security protocol for every client panagg makes (source consumer and admin, "
        "dead-letter and release producers): `PLAINTEXT`, `SSL`, `SASL_PLAINTEXT` or "
        "`SASL_SSL`",
    )
    sasl_mechanism: str = setting(
        "",
        brief="SASL_*: PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512",
        doc="`SASL_*`: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (required)",
    )
    username: str = setting("", brief="the SASL user", doc="the SASL user (required for `SASL_*`)")
    password_file: str = setting(
        "",
        brief='e.g. "/etc/panagg/kafka.password" (mode 0600; trailing newline dropped)',
        doc="a file holding the SASL password (one trailing newline dropped); keep it mode 0600, "
        "readable by the service user",
    )
    password_env: str = setting(
        "",
        brief="or the NAME of an environment variable holding the password",
        doc="or: the *name* of an environment variable holding the password (e.g. "
        "`KAFKA_PASSWORD`, set by systemd `EnvironmentFile=`). There is deliberately no "
        "`PANAGG_SECURITY_PASSWORD`: secrets come in by name only",
    )
    password: str = setting(
        "",
        secret=True,
        brief="inline: refused unless allow_inline_password (never saved)",
        doc="the password inline in the config is refused (config files and shell history get "
        "copied) unless `allow_inline_password = true`; then it is used with a warning and "
        "blanked in the saved `config.json` (so `panagg release` / `audit export` need it "
        "again: prefer a file)",
    )
    allow_inline_password: bool = setting(
        False,
        brief="accept security.password inline (warned)",
        doc="`true`: accept `security.password` inline, with a warning (prefer a file)",
    )
    ca_file: str = setting(
        "",
        brief="PEM CA of the brokers' certificates; empty: system CAs",
        doc="PEM CA bundle that signed the brokers' certificates; empty: the system's CAs",
    )
    cert_file: str = setting(
        "",
        brief="mutual TLS: client certificate (PEM)",
        doc="mutual TLS: the client certificate (PEM)",
    )
    key_file: str = setting(
        "",
        brief="mutual TLS: its private key (PEM)",
        doc="mutual TLS: the client certificate's private key (PEM)",
    )
    key_password_file: str = setting(
        "",
        brief="a file holding the key's password, if it is encrypted",
        doc="mutual TLS: a file holding the private key's password, if it is encrypted",
    )
    check_hostname: bool = setting(
        True,
        brief="the broker's certificate must name the host connected to",
        doc="the broker's certificate must name the host in `source.bootstrap` (and the "
        "advertised broker addresses); `false` is accepted with a warning",
    )


@dataclass(frozen=True, eq=False)
class StateSettings(Section):
    """[state]: the counters and their noise"""

    mode: str = setting(
        "direct",
        choices=("direct", "hashed"),
        identity="mode",
        agree="mode",
        brief="direct: int items in [0, domain_size); hashed: any item",
        doc="`direct`: items are ints in `[0, domain_size)`; `hashed`: any item, SipHash into "
        "buckets",
    )
    domain_size: int = setting(
        100000,
        bounds=(POSITIVE,),
        identity="domain",
        agree="size",
        example=1000000,
        brief="direct mode: items are ints in [0, domain_size)",
        doc="D for direct mode",
    )
    buckets: int = setting(
        0,
        bounds=(NON_NEGATIVE,),
        identity="domain",
        agree="size",
        brief="hashed mode: 0 = 2 * expected_n (docs/large_domains.md)",
        doc="B for hashed mode; 0 = `largedomain.choose_buckets(expected_n, epsilon)`, whose "
        'default rule is B = 2 * expected_n (docs/large_domains.md, "Choosing B"). Scale-out:'
        " the total over all partitions",
    )
    expected_n: int = setting(
        1000000,
        bounds=(POSITIVE,),
        identity="domain",
        agree="size",
        brief="hashed mode: events expected per window; err on the high side",
        doc="hashed mode: events expected per window (B must be fixed before data arrives). Err "
        "on the high side: many more events than expected fill most buckets (at 10x, about 3x"
        " the error of the right B); fewer cost less (1.8-2.5x at worst)",
    )
    epsilon: float = setting(
        1.0,
        bounds=(POSITIVE, Bound(0.001, says=">= 0.001 (below that the noise drowns every count)")),
        identity="epsilon",
        agree="epsilon",
        brief="each window's state and release are epsilon-DP",
        doc="each window's state and release are epsilon-DP (replace-one neighbors; >= 0.001)",
    )
    model: str = setting(
        "joint",
        choices=("joint", "state-only", "shuffle"),
        identity="model",
        agree="model",
        brief="joint | state-only (better accuracy, weaker model; see docs/privacy.md) | shuffle "
        "([shuffle])",
        doc="`joint`: the release adds a fresh noise layer, so an intrusion, audit exports and "
        "the release are jointly epsilon-DP; `state-only`: better accuracy, caveat printed in"
        " each release; `shuffle`: the shuffle model's analyzer, reading the shuffler's "
        "analyzer topic (`[shuffle]` below, docs/shuffle.md)",
    )
    privacy_unit: str = setting(
        "event",
        choices=("event", "user"),
        identity="unit",
        brief="event (each window is eps-DP per event) | user (distinct users per window, each "
        "user protected however often: docs/privacy_unit.md)",
        doc="what one neighbour differs in: `event` (the histograms: each window is eps-DP for "
        "one event changed, so a source that contributes g events is protected at g x eps). "
        "`user`: each window keeps a user-level pan-private density state instead of the "
        'counters (the item is the user, e.g. `item.field = "user"`) and releases its '
        "distinct users with a 90 % interval; all events of one user in a window, however "
        "many, are hidden at eps, and a user active in k windows spends k x eps, at most "
        "`ledger.budget_per_user` (docs/privacy_unit.md). Needs `state.expected_users` and "
        "`ledger.budget_per_user`; `window.rollups` run a density state per span beside the "
        "base windows (`state.rollup_expected_users`); event-time windows too (a crash's "
        "replays charged to every user); not yet with scale-out, "
        "snapshots, several aggregations, a breakdown, hashed "
        "mode or a model other than `joint` (each refused in one line)",
    )
    expected_users: int = setting(
        0,
        bounds=(NON_NEGATIVE,),
        identity="domain",
        example=10000,
        brief="privacy_unit = user: distinct users expected per window (sizes the state)",
        doc='`state.privacy_unit = "user"`: the distinct users a window is expected to hold; '
        "the density state has the cells that minimise the relative error there (about "
        "2.3 x, `aggregator.density.plan_cells`). The error stays within about 1.3x of that "
        "from 1x to 4x as many users, grows slowly below (like the root of the ratio) and "
        "fast past ~5x: err on the high side. Required with the user unit",
    )
    rollup_expected_users: tuple[str, ...] = setting(
        (),
        brief="privacy_unit = user with window.rollups: distinct users expected per rollup "
        "window, one per span",
        doc='`state.privacy_unit = "user"` with `window.rollups`: the distinct users one '
        "window of each span is expected to hold, in the order of `window.rollups` (a "
        "day's users, not the sum of its windows': a user active all day is one). Each "
        "span is a density state of its own, a window of the span's length at "
        "`state.epsilon`, sized from this as `state.expected_users` sizes the base windows "
        '(docs/privacy_unit.md, "Rollups"). Required there, one positive number per span',
    )
    user_universe: int = setting(
        0,
        bounds=(NON_NEGATIVE,),
        brief="privacy_unit = user: the public number of users (registered accounts); 0: none",
        doc='`state.privacy_unit = "user"`: a public universe size (e.g. registered '
        "accounts, known without the data); set, each release also gives the active "
        "fraction (distinct users / this) with its interval; 0: no fraction",
    )
    loss: str = setting(
        "l1",
        choices=("l1", "l2"),
        brief="l1 | l2",
        doc="`l1` (Algorithm 1) or `l2` (Algorithm 3: sum = n and a rank box)",
    )


@dataclass(frozen=True, eq=False)
class WindowSettings(Section):
    """[window]: tumbling windows, one release each"""

    kind: str = setting(
        "count",
        choices=("count", "time", "event_time"),
        identity="window",
        agree="window_kind",
        example="time",
        brief="count | time | event_time (record timestamps)",
        doc="tumbling windows by event `count`, by `time`, or `event_time` (the Kafka record "
        'timestamp; below, "Event-time windows"). `time` on a Kafka source is event time too '
        "unless `window.clock` says otherwise",
    )
    size: int = setting(
        1000000,
        bounds=(POSITIVE,),
        identity="window",
        agree="window_size",
        example=3600,
        brief='seconds per window (events, for kind = "count")',
        doc="events per window, or seconds per window (`event_time`: whole seconds, windows "
        "aligned to the epoch)",
    )
    clock: str = setting(
        "auto",
        choices=("auto", "record", "process"),
        identity="window",
        brief="time windows: auto (Kafka: by the records' timestamps, as event_time; else this "
        "process's clock) | record | process",
        doc='what `window.kind = "time"` windows follow. `auto`: on a Kafka source the records\' '
        "timestamps (the service runs them as `event_time` windows, with "
        "`window.idle_partition_timeout_s` = `window.size` unless set, and says so at start),"
        " so an event lands in the window of its timestamp, after a broker outage too; where "
        "record time cannot apply (file and generator sources, the shuffle model, in-window "
        "snapshots) this process's clock, and in scale-out the intake time (`record` or "
        '`window.kind = "event_time"` asks a group for the timestamps). `record`: the '
        "timestamps, refused where they cannot apply. `process`: this process's clock "
        "(windows close by the clock during an outage and the backlog lands in the window "
        "open at the broker's return). A state directory started with clock-time windows "
        "keeps them (logged)",
    )
    late: str = setting(
        "next",
        choices=("next", "dead_letter"),
        agree="late",
        brief="event_time: a record of a closed window: next | dead_letter",
        doc="`event_time`: a record whose window has closed (*late*) is counted in the open "
        "window (`next`: this shifts it into a later window than its timestamp says; the "
        "release's `window_info.late` says how many) or sent to dead letters with reason "
        "`late` (`dead_letter`; a reject, never counted)",
    )
    max_future_skew_s: float = setting(
        300.0,
        bounds=(NON_NEGATIVE,),
        brief="event_time: later timestamps than now + this are rejected",
        doc="`event_time`: a record stamped later than now + this is rejected as "
        "`future_timestamp` (a record with no timestamp as `no_timestamp`); the decision is "
        "kept in `checkpoint.dir/future_rejects` so that a replay after a crash, with a later"
        " clock, makes it again",
    )
    idle_partition_timeout_s: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        shown_default="0 (never)",
        brief="event_time: an idle partition stops holding the window (0: never)",
        doc="`event_time`: a partition read to its end stops holding the watermark after this "
        "many seconds while the others wait at a later window (logged); 0: an idle partition "
        "holds the open window until it gets a record",
    )
    allowed_lateness_s: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        agree="allowed_lateness_s",
        brief="event_time: a window keeps its records until the watermark passes its end + this "
        "(< size)",
        doc="`event_time`: a window keeps its records until every partition has passed its end + "
        "this many seconds, while the next window counts its own (two live states); must be <"
        " `window.size` (one line otherwise) and is refused for other window kinds; 0: one "
        "open window",
    )
    rollups: tuple[str, ...] = setting(
        (),
        brief='longer releases of the same stream, e.g. ["1d", "7d"] (multiples of size; '
        "docs/rollups.md)",
        doc="longer releases from one stream at no extra epsilon: each base window's release view"
        " is added into the open rollups, and a rollup is released (ledgered at 0 eps, "
        "published as `release-SPAN-INDEX.json`) with its last base window. Spans are "
        'multiples of the base window: time windows `"1h"`, `"1d"`, `"7d"` (units s m h d w; '
        "aligned to the epoch like the windows), count windows a number of events (`2400000`)"
        ' or `"24x"` (24 base windows, any kind). Refused with one line: not a multiple, '
        "fewer than 2 windows, a span twice, `state.model = state-only` (a group sums them "
        'per partition: docs/scale-out.md, "Rollups"). Safe to change between starts: a span '
        "added starts with the next base window (its first rollup names the windows it "
        "lacks), a span removed leaves its open sum in `checkpoint.dir/rollups/SPAN` (mode "
        "0600; delete it). docs/rollups.md; privacy: docs/privacy.md sections 20 and 21",
    )
    rollup_design: str = setting(
        "hybrid",
        choices=("sum", "tree", "hybrid"),
        brief="hybrid: a day state at eps/2 beside the base windows at eps/2, weeks summed from "
        "days; sum: 0 extra eps from the base views; tree: every span its own state",
        doc="how `window.rollups` are built (docs/rollups.md, where they are measured and "
        "chosen): `hybrid` (the first span its own live state, epsilon split in two, longer "
        "spans sums of its views), `sum` (0 extra epsilon: the base windows keep all of it "
        "and rollups are sums of their release views) or `tree` (every span its own state, "
        "epsilon split equally)",
    )
    #: set by validation: window.kind = time became event_time because window.clock = auto
    auto_event_time: bool = field(default=False, metadata={"derived": True})


@dataclass(frozen=True, eq=False)
class CheckpointSettings(Section):
    """[checkpoint]: the state directory"""

    dir: str = setting(
        "var/panagg",
        example="/var/lib/panagg/state",
        brief="under StateDirectory=panagg; checkpoints, ledger, exports",
        doc="checkpoints, ledger, control requests, exports. Its settings (stream, group, format,"
        " item, mode, domain, epsilon, model, window, snapshots, budget, release directory: "
        '"What a state directory depends on" above) are recorded in the ledger at the first '
        "start; a start with other settings is refused unless `panagg run --accept-change` "
        "records the change",
    )
    snapshots_per_window: int = setting(
        0,
        bounds=(NON_NEGATIVE,),
        identity="snapshots_per_window",
        brief="0: checkpoints only at window boundaries; a restart replays the open window from "
        "Kafka (keep retention > window.size). k > 0: k layered snapshots per window bound "
        "the replay to 1/(k+1) of a window, each costing 2 noise layers",
        doc="0: checkpoints only at window boundaries, with no counters; after a crash, stop or "
        "handover the open window is replayed from Kafka (the topic must keep two windows and"
        " not be compacted: checked at start). k > 0: k layered snapshots per window at "
        "public points (progress j/(k+1)) bound the replay to 1/(k+1) of a window, at 2 noise"
        " layers each in the release (docs/views.md). In a scale-out group each partition's "
        "(views: each member's window's) snapshots go to a Kafka topic with its committed "
        "offsets; time windows only there (docs/scale-out.md). "
        "Replaces `checkpoint.every_events` / `every_seconds`, which are refused with this "
        "explanation",
    )


@dataclass(frozen=True, eq=False)
class ReleaseSettings(Section):
    """[release]: how a window's release is computed and where it goes"""

    dir: str = setting(
        "out/releases",
        identity="release_dir",
        example="/var/lib/panagg/releases",
        brief="release-<window>.json + .png",
        doc="release JSON + PNG files",
    )
    plots: bool = setting(
        True,
        brief="draw release-<window>.png beside each JSON; false: JSON only",
        doc="draw each release's plot, `release-<window>.png`, beside its JSON (matplotlib, on a "
        "thread beside the consume loop: ~0.8 s of CPU to import at the first release, then"
        " a fraction of a second per plot). The JSON is the release; `false` on a headless "
        "deployment that reads the JSON or the topic only. The test suite sets it false for "
        "the services it starts (tests/conftest.py) except where a test looks at the plot",
    )
    topic: str = setting(
        "",
        brief="Kafka topic for release JSON (key = window id); empty: files only",
        doc="Kafka topic for release JSON (key = window id); empty: files only. A scale-out "
        "group writes each release there in the transaction that ledgers it, so its start "
        "refuses a topic that does not exist: create it once, compacted so that it keeps "
        "every release (`kafka-topics.sh --create --topic NAME --partitions 1 --config "
        "cleanup.policy=compact`). Keys are unique per release: the window number, a "
        "rollup's `<span>-<index>`, prefixed `NAME/` with several aggregations (one process "
        "and a group alike)",
    )
    on_exhausted: bool = setting(
        True,
        brief="finite sources: release the partial last window",
        doc="finite sources: release the partial last window when the input ends",
    )
    error_bar_reps: int = setting(
        10,
        bounds=(NON_NEGATIVE,),
        brief="bootstrap repetitions for the release's intervals; 0: none",
        doc="bootstrap repetitions behind each release's `accuracy.intervals` "
        "(docs/release-schema.md), for each of two stand-in truths; 0: no intervals (the "
        "signal-to-noise fields stay). The release is computed by the release worker beside "
        "the consume loop (`release.workers`), so its length no longer stops intake; with the"
        " default estimator (`auto`) a release at D = 1e7 counters takes 0.8-1.7 s (1-2 "
        "layers) and 10 repetitions 0.7-0.9 s more on this 2-core machine (hashed mode, B = "
        '2e7 buckets, n = 1e7, 1 layer: 0.7 s and 2.7 s; docs/speed.md, "Release time"), so '
        'for short windows at high rates set `release.estimator = "deconvolution"` and/or '
        '`release.error_bar_reps = 0` (docs/accuracy_grid.md, "Release time")',
    )
    plan_errors: bool = setting(
        True,
        brief="the start line's expected errors (simulated releases); false: floor only",
        doc="the start line's second part: the expected relative errors the releases will state, "
        "from simulated releases of two reference shapes (a thread beside the consume loop; "
        "seconds of CPU at every start, 5-25 s on this 2-core machine at the sizes the tests "
        "use). `false`: the start line gives the noise floor only; `panagg plan` still gives "
        "both. The test suite sets it false for the services it starts (tests/conftest.py)",
    )
    estimator: str = setting(
        "default",
        choices=("default", *METHODS),  # the estimators' registry (aggregator.estimators)
        brief="the accuracy grid's choice, or " + " | ".join(METHODS),
        doc="estimator of the histogram: `default` (the accuracy grid's choice per mode and layer"
        " count, docs/accuracy_grid.md) or one of `threshold`, `deconvolution`, `mle`, "
        "`wupagh`, `xfit`, `auto`. The adaptive `auto` costs 0.8-1.7 s per release at D = 1e7"
        ' with 1-2 layers and 2.1 s with 3 (docs/speed.md, "Release time"; 4-6 layers not '
        "re-measured: 3.1-3.5 s before, docs/accuracy_grid.md); `threshold` and "
        "`deconvolution` (0.05-0.1 s there) are the fast ones for short windows at high rates",
    )
    workers: int = setting(
        1,
        bounds=(NON_NEGATIVE,),
        brief="release worker processes beside the consume loop; 0: in the loop",
        doc="release worker processes beside the consume loop "
        "(aggregator/service/release_worker.py): at a window's close the loop checks the "
        "ledger, hands the closed noisy state to a worker and counts the next window at once;"
        " results are ledgered, checkpointed and published in window order. Each worker takes"
        " up to one core while a release runs (on 2 cores, 1 leaves the other to the loop). "
        "0: the release runs in the loop and intake stops while it runs. Several aggregations"
        " (`[aggregations.*]`) share one pool of `release.workers` processes, so their "
        "releases run in parallel. Event-time windows release beside the loop too; their "
        "checkpoint that starts the next window is written once the closed window's release "
        "is ledgered (until then a restart replays the closed window from its start). With "
        "`checkpoint.snapshots_per_window` > 0 a snapshot waits while a closed window is in "
        "flight (a snapshot checkpoint lists no closed windows), and the one window a restart"
        " resumes from a snapshot closes in the loop (its start is behind the snapshot). In a"
        " scale-out group the leader merges each window in this pool too",
    )
    max_in_flight: int = setting(
        2,
        bounds=(POSITIVE,),
        brief="closed windows waiting for their release before intake pauses",
        doc="closed windows that may wait for their release (their counters in memory only) "
        "before intake pauses, with one log line and `panagg_intake_paused` = 1, until the "
        "oldest is released (backpressure: memory stays bounded, no window is dropped)",
    )


@dataclass(frozen=True, eq=False)
class LedgerSettings(Section):
    """[ledger]: the privacy budget the ledger holds the releases to"""

    budget_per_window: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        identity="budget_per_window",
        shown_default="0 (= epsilon)",
        brief="0: equal to state.epsilon (one release per window)",
        doc="epsilon a window may spend on releases (default: one release)",
    )
    budget_total: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        identity="budget_total",
        shown_default="0 (no cap)",
        brief="0: no cap across windows",
        doc="cap on the epsilon of all ledgered releases",
    )
    budget_per_event: float = setting(
        0.0,
        note="recorded apart: the set of aggregations (`[aggregations.*]`) and its per-event "
        'budget are ledgered as a `composition` entry ("Several aggregations of one stream")',
        brief="several [aggregations.NAME]: cap on the sum of their per-window budgets (what one "
        "event spends over all of them)",
        doc="the cap on what one event (one source position) may be charged over every release "
        "that covers it, across restarts, fresh starts, configuration changes and "
        "aggregations (0: `ledger.budget_per_window`, one release per event); checked before "
        "any release noise is drawn (docs/privacy.md section 16). With `[aggregations.*]`: "
        "also the cap on the sum of the aggregations' per-window budgets; required (> 0) for "
        "two or more, refused when the sum exceeds it",
    )

    budget_per_user: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        identity="budget_per_user",
        shown_default="0 (unset)",
        brief="privacy_unit = user: the eps one user may be charged over all windows "
        "(required there)",
        doc='`state.privacy_unit = "user"`: the total epsilon one user may be charged over '
        "every window of the stream, restarts included. Any user may be in every window, so "
        "a user's charge is the sum of every user-level release of the state directory "
        "(each `state.epsilon`; every lineage: a fresh start gives no user a new budget), "
        "one more `state.epsilon` for each restart that replayed a released window (its "
        "bits were drawn twice) and what other deployments on the same stream charged (the "
        "budget registry); a release that would bring it over this is refused before its "
        "noise is drawn, and a Kafka source pauses its intake (docs/privacy_unit.md). E.g. "
        "30 at eps 1: a user is in at most 30 released windows. Required with the user unit "
        "(at least `state.epsilon`), refused with the event unit (events are not users)",
    )
    registry_topic: str = setting(
        "panagg.budget",
        brief='Kafka sources: the cluster\'s budget registry topic ("": none)',
        doc="Kafka sources: a compacted topic on the source's cluster where every panagg "
        "deployment records the source positions it charged, and which each reads before "
        "a release, so a second state directory, a new `source.group`, a restored directory "
        "or a second group over the same records stays within `ledger.budget_per_event` or "
        "is refused in one line naming the other deployment (docs/privacy.md section 22). "
        "Created at the first start if missing (a start waits up to "
        "`source.connect_timeout_s` for the cluster, as for the source). Keep the same name "
        'in every deployment on a cluster; `""` turns it off (charges across deployments '
        "are then not checked)",
    )
    file_registry: str = setting(
        "auto",
        brief='file sources: the budget registry file ("auto": per user; "": none)',
        doc="file sources: a file where every run over a file source records the positions it "
        "charged, keyed by the input's content (a digest of its leading bytes, not its "
        "name), and which each reads before a release, so the same file renamed, moved, "
        "grown or read from a new `checkpoint.dir` stays within `ledger.budget_per_event` "
        "or is refused in one line naming the earlier run (docs/privacy.md section 22). "
        "`auto`: `$XDG_STATE_HOME/panagg/budget-registry.jsonl` (default "
        "`~/.local/state/panagg/budget-registry.jsonl`), one per user: runs by another "
        "user or on another host are not seen unless they name the same file (a shared "
        'path works: it is locked for every write); `""` turns it off',
    )


@dataclass(frozen=True, eq=False)
class MetricsSettings(Section):
    """[metrics]: the Prometheus endpoint"""

    host: str = setting(
        "127.0.0.1",
        brief="Prometheus endpoint; keep it on loopback unless firewalled",
        doc="Prometheus endpoint's address; keep it on loopback unless firewalled",
    )
    port: int = setting(
        9464,
        bounds=(Bound(-1, 65535, says="-1 (off), 0 (any free port) or 1..65535"),),
        brief="0: any free port; -1: off",
        doc="Prometheus endpoint's port; 0 = any free port, -1 = off",
    )


@dataclass(frozen=True, eq=False)
class AuditSettings(Section):
    """[audit]: signed exports of the state (`panagg audit export`)"""

    key_file: str = setting(
        "",
        brief="hex HMAC key file; PANAGG_AUDIT_KEY (in /etc/panagg/env) wins",
        doc="hex HMAC key file for exports (or `PANAGG_AUDIT_KEY`, which wins). Checked at "
        "`panagg run`'s start: a key that is set but not hex, shorter than 32 hex digits "
        "or empty, or a key file that cannot be read refuses the start with one line, "
        "before anything is written; no key (`PANAGG_AUDIT_KEY` unset, `audit.key_file` "
        "empty) runs with audit exports refused",
    )
    dir: str = setting(
        "",
        shown_default="empty (= `<checkpoint.dir>/exports`)",
        brief="empty: <checkpoint.dir>/exports",
        doc="where signed exports go",
    )


@dataclass(frozen=True, eq=False)
class BreakdownSettings(Section):
    """[breakdown]: one release per key of a public key domain, each event charged once
    (parallel composition, docs/privacy.md section 24)"""

    field: str = setting(
        "",
        brief='e.g. "country": one histogram per key of the records\' field',
        doc="the dotted path of the key field (compared as text, like `item.filter_field`); set, "
        "the service runs one aggregation per key of `breakdown.keys` (each filtered to its "
        "key, released in `release.dir/KEY`) and charges each event once: the keys are one "
        "parallel composition (docs/privacy.md section 24). Not with `[aggregations]`, "
        "`window.rollups`, `scale.partitioned` or `state.model = shuffle`",
    )
    keys: tuple[str, ...] = setting(
        (),
        brief='the public key domain, fixed before the data, e.g. ["de", "fr", "it"]',
        doc="the public key domain: each key names its aggregation (a lowercase letter, then up "
        "to 31 of a-z 0-9 _ -). It must be chosen without the data (a key list read off the "
        "stream would itself leak); at least one key, at most 1,000",
    )
    other: bool = setting(
        True,
        brief="true: records outside the keys are counted in key `other`",
        doc="`true`: records whose key is not in `breakdown.keys` (the field missing included) "
        "are counted and released in one more key, `other`; `false`: they are filtered (not "
        "events, counted by `panagg_filtered_records_total`) and appear in no release",
    )


@dataclass(frozen=True, eq=False)
class ScaleSettings(Section):
    """[scale]: several processes in one group (docs/scale-out.md)"""

    partitioned: bool = setting(
        False,
        identity="partitioned",
        brief="true: several processes per group (docs/scale-out.md)",
        doc="several processes in one consumer group, sharing nothing but Kafka's internal "
        "topics; each counts its partitions' slices of the domain, and the group's leader "
        "merges each window (docs/scale-out.md). Needs `source.kind = kafka`, `window.kind = "
        "time` (intake time) or `event_time`",
    )
    store: str = setting(
        "kafka",
        choices=("directory", "kafka"),
        brief="the group shares state in Kafka's internal topics only; each member a local "
        "scratch checkpoint.dir",
        doc="where a group shares its state: `kafka` (internal topics `<group>.panagg.*`). "
        "`directory` (the removed shared-directory store) is refused with the way to move",
    )
    exchange: str = setting(
        "views",
        choices=("views", "items"),
        agree="exchange",
        brief="views: each member counts its own source partitions and shares only eps-DP "
        "views; items: plaintext counter indices in a repartition topic",
        doc="what a group's members share: `views` (each member counts the source partitions "
        "it is assigned into its own pan-private state, and at a window's end writes only "
        "that state's eps-DP view with one more DLap layer: every internal topic is eps-DP; "
        "time, event-time and count windows, sum rollups, audit exports, in-window "
        "snapshots of time windows) or `items` (the "
        "domain split: intake writes every event's counter index in plaintext to the "
        "repartition topic, readable by anyone who can read the topic; needed for the "
        "hybrid and tree rollup designs). "
        "Fixed for the life of the group (docs/scale-out.md)",
    )
    partitions: int = setting(
        0,
        bounds=(NON_NEGATIVE,),
        agree="partitions",
        brief="slices of the domain (repartition topic partitions); 0: the source topic's "
        "partition count",
        doc="slices of the domain (the repartition topic's partitions); 0: the source topic's "
        "partition count. Fixed for the life of the group",
    )
    close_grace_s: float = setting(
        2.0,
        bounds=(POSITIVE,),
        brief="a window closes this long after its end",
        doc="a group's window closes this long after its end (intake-time windows)",
    )
    repartition_retention_s: float = setting(
        0.0,
        bounds=(NON_NEGATIVE,),
        brief="retention of the repartition topic (plaintext items); 0: three windows, at least "
        "one hour",
        doc="retention of the repartition topic (plaintext counter indices); 0: three windows, at"
        " least one hour",
    )


@dataclass(frozen=True, eq=False)
class ShuffleSettings(Section):
    """[shuffle]: state.model = shuffle (docs/shuffle.md); the clients, the shuffler and the
    analyzer must agree on these and on state.epsilon and the number of buckets."""

    protocol: str = setting(
        "gkmp",
        choices=("gkmp", "balcer-cheu"),
        brief="gkmp (correlated noise, DLap) | balcer-cheu (seed 002)",
        doc="`state.model = shuffle`: `gkmp` (correlated noise; the counts are h + DLap(p)) or "
        "`balcer-cheu` (seed 002). Clients, shuffler and analyzer must agree on `[shuffle]`, "
        "`state.epsilon` and the number of buckets (the shuffler's end marker may carry them:"
        " a window randomized otherwise is refused)",
    )
    delta: float = setting(
        1e-06,
        bounds=(Bound(0, 1, open_low=True, open_high=True, says="in (0, 1), e.g. 1e-6"),),
        brief="each window's shuffled view is (epsilon, delta)-DP",
        doc="the shuffled view of a window is (epsilon, delta)-DP; releases and ledger entries "
        "carry it",
    )
    gamma: float = setting(
        0.1,
        bounds=(Bound(0, 1, open_low=True, open_high=True, says="in (0, 1), e.g. 0.1"),),
        brief="gkmp: share of epsilon spent on flooding",
        doc="`gkmp`: the share of epsilon spent on flooding (the DLap part runs at (1 - gamma) "
        "epsilon)",
    )
    n: int = setting(
        0,
        bounds=(Bound(0, says=">= 0 (0: window.size)"),),
        shown_default="0 (= `window.size`)",
        brief="randomizer outputs per window; 0: window.size (time windows: set)",
        doc="randomizer outputs per window (events + the shuffler's top-ups); count windows: 0 or"
        " `window.size`; time windows: required",
    )
    key_file: str = setting(
        "",
        brief="the analyzer's private key (panagg shuffle-keygen --out FILE), or "
        "PANAGG_SHUFFLE_PRIVATE_KEY (hex)",
        doc="the analyzer's private key (`panagg shuffle-keygen --out FILE`), or "
        "`PANAGG_SHUFFLE_PRIVATE_KEY` (64 hex digits); the analyzer refuses to start without "
        "one",
    )
    public_key: str = setting(
        "",
        brief="clients and shuffler: the analyzer's public key (hex or file)",
        doc="clients and `panagg shuffle`: the analyzer's public key, 64 hex digits or a file "
        "holding them (printed by `panagg shuffle-keygen`)",
    )
    client_topic: str = setting(
        "",
        brief="shuffler: the topic clients produce sealed events to",
        doc="`panagg shuffle` and `panagg shuffle-clients`: the topic clients produce sealed "
        "events to (keyed by a random 16-byte event id); the shuffler never creates it",
    )
    analyzer_topic: str = setting(
        "",
        shown_default="empty (= `source.topic`)",
        brief="shuffler: the topic it writes permuted windows to (default source.topic)",
        doc="`panagg shuffle`: the one-partition topic it writes permuted windows to, in Kafka "
        "transactions; the analyzer reads it as `source.topic`",
    )
    group: str = setting(
        "",
        shown_default="empty (= `panagg-shuffler`)",
        brief="shuffler: consumer group and transactional id prefix",
        doc="`panagg shuffle`: its consumer group on the client topic; its transactional id is "
        "`<group>-<analyzer topic>` (a second shuffler with the same pair fences the first)",
    )
    shuffler_dir: str = setting(
        "",
        shown_default="empty (= `<checkpoint.dir>/shuffler`)",
        brief="shuffler: its state file (default <checkpoint.dir>/shuffler)",
        doc="`panagg shuffle`: its state file (the last windows' event ids for deduplication, the"
        " window being committed)",
    )
    hash_key: str = setting(
        "",
        brief="hashed-mode clients: the bucket hash key, 32 hex digits shared by all",
        doc="hashed-mode clients (`state.mode = hashed`): the bucket hash key, 32 hex digits "
        "shared by every client (not secret for privacy; aggregator/hashing.py)",
    )


@dataclass(frozen=True, eq=False)
class TestingSettings(Section):
    """[testing]: test hooks, refused outside tests"""

    __test__ = False  # a settings section, not a test class for pytest to collect
    noise_seed: int = setting(
        -1,
        test_only=True,
        brief="makes the noise predictable",
        doc="deterministic noise from this seed (-1: the OS CSPRNG), for tests that compare "
        "counters; refused unless `PANAGG_TESTING=1`",
    )


@dataclass(frozen=True, eq=False)
class AggregationSettings(Section):
    """What one aggregation of a stream is (``[aggregations.NAME]``, docs/privacy.md section 19):
    its name, every aggregation of the stream, the stated cap on their per-event spend and the
    spend it adds up to; a rollup level's own block (docs/rollups.md) where it is one."""

    name: str = ""
    of: tuple[str, ...] = ()
    budget_per_event: float | None = None
    epsilon_per_event: float | None = field(default=None, metadata={"derived": True})
    rollup_level: Mapping | None = field(default=None, metadata={"derived": True})
    #: a breakdown's key: {"group": "breakdown:FIELD", "member": KEY, "of": n keys}
    parallel: Mapping | None = field(default=None, metadata={"derived": True})


#: section name -> its class, in the order of docs/configuration.md
SECTIONS: dict[str, type[Section]] = {
    "source": SourceSettings,
    "item": ItemSettings,
    "security": SecuritySettings,
    "state": StateSettings,
    "window": WindowSettings,
    "checkpoint": CheckpointSettings,
    "release": ReleaseSettings,
    "ledger": LedgerSettings,
    "metrics": MetricsSettings,
    "breakdown": BreakdownSettings,
    "audit": AuditSettings,
    "scale": ScaleSettings,
    "shuffle": ShuffleSettings,
    "testing": TestingSettings,
}


#: "section.key" -> its :class:`Setting`, every settable key in the order of the sections
SETTINGS: dict[str, Setting] = {
    f"{name}.{f.name}": dataclasses.replace(f.metadata["setting"], section=name, key=f.name)
    for name, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if not f.metadata.get("derived")
}


def settings_by(fact: str) -> dict[str, tuple[Setting, ...]]:
    """The settings grouped by the value of ``fact`` (``"identity"`` or ``"agree"``), each
    group in declaration order, the groups in the order of their first setting; settings
    without it are left out.

    >>> [s.name for s in settings_by("agree")["size"]]
    ['state.domain_size', 'state.buckets', 'state.expected_n']
    """
    out: dict[str, tuple[Setting, ...]] = {}
    for one in SETTINGS.values():
        value = getattr(one, fact)
        if value is not None:
            out[value] = out.get(value, ()) + (one,)
    return out


def defaults() -> dict[str, dict]:
    """Every settable key with its default, ``{section: {key: value}}`` (a fresh copy)."""
    return {
        name: {
            f.name: (list(f.default) if isinstance(f.default, tuple) else f.default)
            for f in dataclasses.fields(cls)
            if not f.metadata.get("derived")
        }
        for name, cls in SECTIONS.items()
    }


@dataclass(frozen=True, eq=False)
class Config(_Fields):
    """The validated configuration of one service (or of one of its aggregations).

    ``aggregations`` maps each ``[aggregations.NAME]`` to the settings it overrides (empty:
    one aggregation, the service's own); ``aggregation`` says which one this config is (None
    for the service's); ``rollup_levels`` describes the aggregations ``window.rollup_design``
    made (docs/rollups.md).
    """

    source: SourceSettings = field(default_factory=SourceSettings)
    item: ItemSettings = field(default_factory=ItemSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    state: StateSettings = field(default_factory=StateSettings)
    window: WindowSettings = field(default_factory=WindowSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    release: ReleaseSettings = field(default_factory=ReleaseSettings)
    ledger: LedgerSettings = field(default_factory=LedgerSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    breakdown: BreakdownSettings = field(default_factory=BreakdownSettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    scale: ScaleSettings = field(default_factory=ScaleSettings)
    shuffle: ShuffleSettings = field(default_factory=ShuffleSettings)
    testing: TestingSettings = field(default_factory=TestingSettings)
    aggregations: Mapping = field(default_factory=dict)
    aggregation: AggregationSettings | None = None
    rollup_levels: Mapping | None = None

    @classmethod
    def from_mapping(cls, values: Mapping) -> Config:
        """A config from ``{section: {key: value}}`` (a Config is returned as it is). Missing
        keys take their defaults; this does not validate: ``load_config`` does."""
        if isinstance(values, Config):
            return values
        agg = values.get("aggregation")
        return cls(
            **{name: sec.from_mapping(values.get(name)) for name, sec in SECTIONS.items()},
            aggregations=dict(values.get("aggregations") or {}),
            aggregation=AggregationSettings.from_mapping(agg) if agg is not None else None,
            rollup_levels=values.get("rollup_levels"),
        )

    def updated(self, changes: Mapping[str, Mapping]) -> Config:
        """A copy with ``{section: {key: value}}`` changed (this object is not)."""
        return dataclasses.replace(
            self,
            **{
                name: dataclasses.replace(getattr(self, name), **dict(values))
                for name, values in changes.items()
            },
        )

    @property
    def budget_per_window(self) -> float:
        """The epsilon one window's release may spend: ``ledger.budget_per_window``, else the
        state's epsilon (what one release spends)."""
        return float(self.ledger.budget_per_window or self.state.epsilon)

    @property
    def budget_per_event(self) -> float:
        """The ledger's cap on the epsilon spent on any one event over every release that covers
        it: this aggregation's own ``budget_per_event``, else ``ledger.budget_per_event``, else
        the per-window budget (one release per event)."""
        own = self.aggregation.budget_per_event if self.aggregation is not None else None
        return float(own or self.ledger.budget_per_event or self.budget_per_window)

    def to_dict(self) -> dict:
        """The plain ``{section: {key: value}}`` form (for JSON, and for deriving configs)."""
        return {
            name: value.to_dict() if isinstance(value, Section) else copy.deepcopy(dict(value))
            for name, value in self.items()
        }

    def _keys(self) -> tuple[str, ...]:
        # the service's own config has no `aggregation` and, without rollup levels, none of
        # those: the mapping shows what is there, as the saved config always has
        return tuple(
            name for name, _, _ in _field_defaults(type(self)) if getattr(self, name) is not None
        )
