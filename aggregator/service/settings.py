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
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Section", "Config", "AggregationSettings", "SECTIONS", "defaults"]


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
    return tuple((f.name, bool(f.metadata.get("derived")), f.default)
                 for f in dataclasses.fields(cls))


class Section(_Fields):
    """A config section: attributes for code, a read-only mapping of its keys for serialization.

    A field whose metadata says ``derived`` is set by validation, not by the user: it is left
    out of :func:`defaults` (so no file or flag can set it) and out of the mapping while it holds
    its default (the saved effective config is what the user's settings resolved to).
    """

    def _keys(self) -> tuple[str, ...]:
        return tuple(name for name, derived, default in _field_defaults(type(self))
                     if not (derived and getattr(self, name) == default))

    @classmethod
    def from_mapping(cls, values: Mapping | None):
        """The section from a mapping of its keys (missing keys take their defaults); a list
        becomes a tuple, so the object stays read-only."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {k: (tuple(v) if isinstance(v, list) else v)
                 for k, v in (values or {}).items() if k in known}
        return cls(**given)

    def to_dict(self) -> dict:
        """A plain dict copy (tuples as lists, as TOML and JSON have them)."""
        return {k: list(v) if isinstance(v, tuple) else copy.deepcopy(v) for k, v in self.items()}

@dataclass(frozen=True, eq=False)
class SourceSettings(Section):
    """[source]"""

    kind: str = "kafka"  # kafka | file | generator
    bootstrap: str = "127.0.0.1:9092"
    topic: str = "events"
    group: str = "panagg"
    instance_id: str = ""  # Kafka static membership id; empty: derived from checkpoint.dir
                           # (partitioned mode: empty means dynamic membership)
    start: str = "earliest"  # a new state dir starts at: earliest | latest | a time
                             # (ISO 8601 with zone, e.g. 2026-11-20T00:00:00Z)
    connect_timeout_s: float = 30.0  # give up (one clear line) if Kafka cannot be reached
    session_timeout_s: float = 45.0  # Kafka group session: a dead member's partitions move after it
    format: str = "msgpack"  # msgpack | json
    max_records: int = 20000  # records decoded and counted at once (in flight)
    fetch_max_bytes: int = 16777216  # Kafka client fetch buffer (in flight)
    max_partition_fetch_bytes: int = 4194304  # per partition, within fetch_max_bytes
    dead_letter_topic: str = ""  # empty: no dead-letter topic
    path: str = ""  # file source: path or "-" for stdin
    max_message_bytes: int = 65536
    max_item_bytes: int = 1024
    generator_events: int = 1000000  # generator source
    generator_zipf: float = 1.1
    generator_rate: float = 0.0  # events/s; 0 = as fast as possible
    generator_seed: int = -1  # -1: fresh


@dataclass(frozen=True, eq=False)
class ItemSettings(Section):
    """[item]: which part of a record is the counted item"""

    source: str = "value"  # value (a field of the message) | key (record key) | header
    field: str = "item"  # value: dotted field path, e.g. user.id (digits index a list)
    header: str = ""  # header: the header's name (the last one of that name wins)
    coerce: bool = False  # direct mode: "00042" / b"42" count as the int 42
    normalize: str = "none"  # hashed mode, text items: none | nfc (Unicode NFC)
    casefold: bool = False  # hashed mode, text items: Unicode case folding
    filter_field: str = ""  # only records with filter_value at this field path are
    filter_value: str = ""  # events; the rest are counted as filtered (not rejects)


@dataclass(frozen=True, eq=False)
class SecuritySettings(Section):
    """[security]: every Kafka client (consumer, admin, producers); secrets are read from a file
    or the environment, never logged."""

    protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str = ""  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 (SASL_* protocols)
    username: str = ""
    password_file: str = ""  # a file holding the SASL password (trailing newline dropped)
    password_env: str = ""  # or the name of an environment variable holding it
    password: str = ""  # inline: refused unless allow_inline_password (then warned)
    allow_inline_password: bool = False
    ca_file: str = ""  # PEM CA bundle for the broker's certificate; empty: system CAs
    cert_file: str = ""  # client certificate (mutual TLS), PEM
    key_file: str = ""  # its private key, PEM
    key_password_file: str = ""  # a file holding the private key's password, if encrypted
    check_hostname: bool = True  # the broker's certificate must name the host connected to


@dataclass(frozen=True, eq=False)
class StateSettings(Section):
    """[state]"""

    mode: str = "direct"  # direct | hashed
    domain_size: int = 100000  # direct mode: items are ints in [0, domain_size)
    buckets: int = 0  # hashed mode: 0 = choose from expected_n
    expected_n: int = 1000000  # hashed mode: events expected per window
    epsilon: float = 1.0
    model: str = "joint"  # joint | state-only | shuffle (the analyzer of the
                          # shuffle model: docs/shuffle.md)
    loss: str = "l1"  # l1 | l2


@dataclass(frozen=True, eq=False)
class WindowSettings(Section):
    """[window]"""

    kind: str = "count"  # count | time | event_time (Kafka record timestamps)
    size: int = 1000000  # events (count) or seconds (time, event_time)
    clock: str = "auto"  # time windows: auto (Kafka: the records' timestamps where
                         # event_time applies, else this process's clock) | record |
                         # process
    late: str = "next"  # event_time: a record of a closed window: next | dead_letter
    max_future_skew_s: float = 300.0  # event_time: a timestamp later than now + this is rejected
    idle_partition_timeout_s: float = 0.0  # event_time: a partition read to its end stops
                                           # holding the watermark after this long (0: never)
    allowed_lateness_s: float = 0.0  # event_time: a window keeps its records stamped in it
                                     # until the watermark passes its end + this (< size)
    rollups: tuple[str, ...] = ()  # longer releases from the same stream, e.g. ["1d", "7d"]
                                   # (multiples of window.size; count windows: events or
                                   # "24x"), built as window.rollup_design says; docs/rollups.md
    rollup_design: str = "hybrid"  # hybrid (default: the first span its own live state, eps
                                   # split in two, longer spans sums of its views) | sum (0
                                   # extra eps, base windows keep all of it: sums of their
                                   # views) | tree (every span its own state, eps split
                                   # equally); measured and chosen: docs/rollups.md
    #: set by validation: window.kind = time became event_time because window.clock = auto
    auto_event_time: bool = field(default=False, metadata={"derived": True})


@dataclass(frozen=True, eq=False)
class CheckpointSettings(Section):
    """[checkpoint]"""

    dir: str = "var/panagg"
    snapshots_per_window: int = 0  # layered snapshots inside a window (each: +2 noise layers;
                                   # bounds the replay after a crash to a fraction of a window)


@dataclass(frozen=True, eq=False)
class ReleaseSettings(Section):
    """[release]"""

    dir: str = "out/releases"
    topic: str = ""  # empty: releases only go to files
    on_exhausted: bool = True  # finite sources: release the partial last window
    error_bar_reps: int = 10  # bootstrap repetitions for the release's intervals; 0: none
    plan_errors: bool = True  # the start line's expected errors, from simulated releases
                              # (seconds of CPU beside the loop at every start); false:
                              # the noise floor only (`panagg plan` gives both)
    estimator: str = "default"  # default (the accuracy grid's choice) or a METHODS name
    workers: int = 1  # release worker processes beside the consume loop; 0: the
                      # release runs in the loop (intake stops while it runs)
    max_in_flight: int = 2  # closed windows waiting for their release before intake
                            # pauses (backpressure; their counters are in memory only)


@dataclass(frozen=True, eq=False)
class LedgerSettings(Section):
    """[ledger]"""

    budget_per_window: float = 0.0  # 0: equal to state.epsilon (one release per window)
    budget_total: float = 0.0  # 0: no cap across windows
    budget_per_event: float = 0.0  # several [aggregations.*]: the cap on the sum of their
                                   # per-window budgets (each event is in one window of each);
                                   # required (> 0) once there are two or more


@dataclass(frozen=True, eq=False)
class MetricsSettings(Section):
    """[metrics]"""

    host: str = "127.0.0.1"
    port: int = 9464  # 0: pick a free port; -1: disabled


@dataclass(frozen=True, eq=False)
class AuditSettings(Section):
    """[audit]"""

    key_file: str = ""  # or PANAGG_AUDIT_KEY (hex)
    dir: str = ""  # empty: <checkpoint.dir>/exports


@dataclass(frozen=True, eq=False)
class ScaleSettings(Section):
    """[scale]"""

    partitioned: bool = False  # several processes in one group (scale-out, docs/scale-out.md)
    store: str = "kafka"  # partitioned: the group shares state in Kafka's internal
                          # topics only, each member a local scratch dir (docs/scale-out.md)
    partitions: int = 0  # store = kafka: repartition topic partitions (the domain is
                         # split into this many slices); 0: the source topic's count
    close_grace_s: float = 2.0  # store = kafka: a window closes this long after its end
    repartition_retention_s: float = 0.0  # store = kafka: retention of the repartition topic
                                          # (plaintext items); 0: 3 windows, at least one hour


@dataclass(frozen=True, eq=False)
class ShuffleSettings(Section):
    """[shuffle]: state.model = shuffle (docs/shuffle.md); the clients, the shuffler and the
    analyzer must agree on these and on state.epsilon and the number of buckets."""

    protocol: str = "gkmp"  # gkmp (correlated noise, DLap) | balcer-cheu (seed 002)
    delta: float = 1e-6  # the shuffled view of a window is (epsilon, delta)-DP
    gamma: float = 0.1  # gkmp: share of epsilon spent on flooding
    n: int = 0  # randomizer outputs per window (events + top-ups); 0: window.size
                # (count windows; time windows must set it)
    key_file: str = ""  # analyzer: its private key (`panagg shuffle-keygen`), or the
                        # environment variable PANAGG_SHUFFLE_PRIVATE_KEY (hex)
    public_key: str = ""  # clients and shuffler: the analyzer's public key (hex or file)
    client_topic: str = ""  # shuffler: the topic clients produce to
    analyzer_topic: str = ""  # shuffler: the topic it writes windows to (default source.topic)
    group: str = ""  # shuffler: consumer group / transactional id prefix
    shuffler_dir: str = ""  # shuffler: its state file (default <checkpoint.dir>/shuffler)
    hash_key: str = ""  # hashed-mode clients: the bucket hash key, 32 hex digits
                        # shared by every client (not secret: aggregator/hashing.py)


@dataclass(frozen=True, eq=False)
class TestingSettings(Section):
    """[testing]"""

    __test__ = False  # a settings section, not a test class for pytest to collect
    noise_seed: int = -1  # TEST ONLY (needs PANAGG_TESTING=1): deterministic noise

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


#: section name -> its class, in the order of docs/configuration.md
SECTIONS: dict[str, type[Section]] = {
    "source": SourceSettings, "item": ItemSettings, "security": SecuritySettings,
    "state": StateSettings, "window": WindowSettings, "checkpoint": CheckpointSettings,
    "release": ReleaseSettings, "ledger": LedgerSettings, "metrics": MetricsSettings,
    "audit": AuditSettings, "scale": ScaleSettings, "shuffle": ShuffleSettings,
    "testing": TestingSettings}


def defaults() -> dict[str, dict]:
    """Every settable key with its default, ``{section: {key: value}}`` (a fresh copy)."""
    return {name: {f.name: (list(f.default) if isinstance(f.default, tuple) else f.default)
                   for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
            for name, cls in SECTIONS.items()}


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
        return cls(**{name: sec.from_mapping(values.get(name)) for name, sec in SECTIONS.items()},
                   aggregations=dict(values.get("aggregations") or {}),
                   aggregation=AggregationSettings.from_mapping(agg) if agg is not None else None,
                   rollup_levels=values.get("rollup_levels"))

    def updated(self, changes: Mapping[str, Mapping]) -> Config:
        """A copy with ``{section: {key: value}}`` changed (this object is not)."""
        return dataclasses.replace(self, **{
            name: dataclasses.replace(getattr(self, name), **dict(values))
            for name, values in changes.items()})

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
        return {name: value.to_dict() if isinstance(value, Section) else copy.deepcopy(dict(value))
                for name, value in self.items()}

    def _keys(self) -> tuple[str, ...]:
        # the service's own config has no `aggregation` and, without rollup levels, none of
        # those: the mapping shows what is there, as the saved config always has
        return tuple(name for name, _, _ in _field_defaults(type(self))
                     if getattr(self, name) is not None)
