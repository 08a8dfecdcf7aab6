"""Rejected records, said without their content: a rate-limited log line per reject
(:class:`RejectLog`) and one loud line when a run's first records are nearly all rejected
(:class:`RejectWatch`: a wrong ``source.format``, ``state.mode`` or ``item.field`` otherwise looks
like an idle stream)."""

from __future__ import annotations

import json
import logging
import time

import msgpack

from consumers.decode import _walk

from .settings import Config

__all__ = ["RejectLog", "RejectWatch"]

log = logging.getLogger("panagg.service")


class RejectLog:
    """Rejected records in the log by position and reason, never content, rate-limited: the
    first ``burst`` of each minute one line each, then one summary line a minute by reason."""

    def __init__(self, burst: int = 5, period_s: float = 60.0):
        self.burst, self.period_s = burst, period_s
        self.start = time.monotonic()
        self.logged = 0
        self.suppressed: dict[str, int] = {}

    def record(self, partition: str, offset: int, reason: str) -> None:
        self.flush()
        if self.logged < self.burst:
            self.logged += 1
            log.warning("rejected record at %s offset %d: %s", partition, int(offset), reason)
        else:
            self.suppressed[reason] = self.suppressed.get(reason, 0) + 1

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.start < self.period_s:
            return
        if self.suppressed:
            log.warning(
                "%d more rejected records in the last %.0f s (%s); counts by reason in "
                "panagg_decode_errors_total",
                sum(self.suppressed.values()),
                now - self.start,
                ", ".join(f"{k}: {v}" for k, v in sorted(self.suppressed.items())),
            )
        self.start, self.logged, self.suppressed = now, 0, {}


class RejectWatch:
    """Says loudly, once, when the first records of a run are (almost) all rejected: a wrong
    ``source.format`` or ``state.mode`` otherwise looks like an idle stream (a release of n = 0).

    Looks at the first ``sample`` records a process sees; at ``ratio`` or more rejected, logs one
    error naming the likely fix (from the rejects' reasons and the records' first byte, never
    their content), and :meth:`fatal` gives the same line for a finite run that ends with no event.
    """

    def __init__(self, cfg: Config, sample: int = 1000, ratio: float = 0.9):
        self.cfg, self.sample, self.ratio = cfg, sample, ratio
        self.seen = self.rejected = self.counted = 0
        self.reasons: dict[str, int] = {}
        self.looks_json = self.looks_msgpack = 0
        #: what the rejected items of reason wrong_type are (map, list, ...): the fix differs
        self.kinds: dict[str, int] = {}
        self.warned = False

    def observe(self, values, rejected, filtered: int = 0) -> None:
        self.counted += len(values) - len(rejected) - filtered
        if self.seen >= self.sample:
            return
        self.seen += len(values) - filtered
        self.rejected += len(rejected)
        for i, reason in rejected:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
            head = bytes(values[i][:1]) if isinstance(values[i], (bytes, bytearray)) else b""
            self.looks_json += head in (b"{", b"[")
            self.looks_msgpack += bool(head) and 0x80 <= head[0] <= 0x8F
            if reason == "wrong_type" and sum(self.kinds.values()) < 100:
                kind = self._item_kind(values[i])
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if (
            self.seen >= min(self.sample, 100)
            and not self.warned
            and self.rejected >= self.ratio * self.seen
        ):
            self.warned = True
            log.error("%s", self.message())

    def _item_kind(self, raw) -> str:
        """The type (only) of the value at item.field in one rejected record."""

        if self.cfg.item.source != "value" or not isinstance(raw, (bytes, bytearray)):
            return "?"
        try:
            doc = (
                msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
                if self.cfg.source.format == "msgpack"
                else json.loads(bytes(raw))
            )
        except Exception:
            return "?"
        item = _walk(doc, tuple(self.cfg.item.field.split(".")))
        return {
            dict: "map",
            list: "list",
            float: "a number with a fraction",
            bool: "true or false",
            type(None): "null",
        }.get(type(item), "?")

    def message(self) -> str:
        top = max(self.reasons, key=self.reasons.get) if self.reasons else "?"
        fmt, mode = self.cfg.source.format, self.cfg.state.mode
        kind = max(self.kinds, key=self.kinds.get) if self.kinds else "?"
        field = self.cfg.item.field
        if top == "wrong_type" and kind == "map":
            fix = (
                f"item.field {field!r} is a map; name one of its keys with a dotted path, "
                f"e.g. item.field = {field}.id"
            )
        elif top == "wrong_type" and kind == "list":
            fix = (
                f"item.field {field!r} is a list; name one of its elements by position, "
                f"e.g. item.field = {field}.0, or a key inside it ({field}.0.id)"
            )
        elif top == "wrong_type" and mode == "hashed" and kind != "?":
            fix = (
                f"item.field {field!r} holds {kind}; items are strings, bytes or whole "
                "numbers: name a field that holds one"
            )
        elif top in ("undecodable", "not_a_map") and fmt == "msgpack" and self.looks_json:
            fix = "the records look like JSON: set source.format = json"
        elif top in ("undecodable", "not_a_map") and fmt == "json" and self.looks_msgpack:
            fix = "the records look like msgpack: set source.format = msgpack"
        elif top == "wrong_type" and mode == "direct":
            fix = (
                "direct mode counts ints in [0, state.domain_size); for string or bytes "
                "items set state.mode = hashed"
            )
        elif top == "out_of_range":
            fix = "items fall outside [0, state.domain_size): raise state.domain_size"
        elif top == "missing_item":
            fix = (
                "records carry no item where item.source / item.field say (default: the "
                'field "item", {"item": <str|bytes|int>, ...}); set item.field (e.g. user.id) '
                "or item.source = key / header"
            )
        else:
            fix = "see docs/operations.md, Bad input"
        return (
            f"{self.rejected} of the first {self.seen} records were rejected (mostly {top}): {fix}"
        )

    def fatal(self) -> str | None:
        """The line to stop a finite run with: nothing counted, something rejected."""
        if self.counted == 0 and self.rejected:
            return self.message()
        return None
