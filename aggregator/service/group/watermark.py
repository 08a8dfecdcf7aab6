"""Event time in a group: each record's window, decided once at intake, and the low watermark.

Windows are epoch-aligned: window ``k`` is ``[k*S, (k+1)*S)``; L is ``window.allowed_lateness_s``
(0 <= L < S). A source partition *passes* window k at its first record stamped at or after
``e_k + L`` (``e_k = (k+1)*S``); ``passed`` is the largest timestamp of its good records so far.

* **A record's window** (:func:`stamp`): the window its timestamp falls in, unless its own source
  partition had passed that window before it: then it is *late* and goes to the first window the
  partition has not passed (``window.late = next``), or is rejected (``dead_letter``). That is
  the one-process rule (aggregator/service/event_time.py): there a partition waits at its close
  position until the window closes, so a record after it is read while the next window is open.
  Records stamped before the group's first window are late too. The decision depends only on
  the partition's own earlier records, and the intake writes it (in the message headers) in the
  same transaction as the partition's new ``passed``, so it is made exactly once.
* **The low watermark** (:func:`low_watermark`): the least ``passed`` over the source partitions,
  leaving out those idle (read to their end) for ``window.idle_partition_timeout_s``. Once it
  reaches ``e_K + L``, every window up to K is complete (:func:`closable_upto`): any later record
  of those windows is late by the rule above (its partition passed them), except on a partition
  left out as idle, whose late records the counting stage recognises by the close marker.
"""

from __future__ import annotations

import json

import numpy as np

__all__ = [
    "stamp",
    "low_watermark",
    "closable_upto",
    "opening_window",
    "too_far_ahead",
    "MarkRecord",
    "MAX_AHEAD_WINDOWS",
]

#: the intake pauses a source partition whose ``passed`` is more than this many windows ahead of
#: the low watermark: it bounds the windows a counting partition keeps live
MAX_AHEAD_WINDOWS = 3


def stamp(
    ts_ms: np.ndarray,
    passed_ms: int | None,
    *,
    size_ms: int,
    lateness_ms: int,
    first_window: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Windows of the good records ``ts_ms`` (in partition order) of one source partition whose
    largest earlier timestamp is ``passed_ms`` (None: none yet).

    Returns ``(window, late, passed)``: each record's window, whether it is late (its window is
    then the first one its partition had not passed), and the partition's new ``passed``.
    ``first_window``: records before it are late too (a group leaves that to the counting
    partitions, which learn the first window from the leader's opening marker).

    >>> w, late, passed = stamp(np.array([1500, 2600, 1200, 3100]), None, size_ms=1000,
    ...                         lateness_ms=500, first_window=1)
    >>> w.tolist(), late.tolist(), passed     # 1200 comes after 2600 >= e_1 + L = 2500: late
    ([1, 2, 2, 3], [False, False, True, False], 3100)
    """
    ts = np.asarray(ts_ms, dtype=np.int64)
    if not len(ts):
        return np.zeros(0, np.int64), np.zeros(0, bool), passed_ms
    before = np.maximum.accumulate(
        np.concatenate(([-1 if passed_ms is None else passed_ms], ts[:-1]))
    )
    # the first window not passed: the least j with (j + 1) * S + L > passed
    open_ = (before - lateness_ms) // size_ms  # no record yet (-1): window -1, nothing late
    if first_window is not None:
        open_ = np.maximum(open_, first_window)
    window = ts // size_ms
    late = window < open_
    window = np.where(late, open_, window)
    new = int(max(before[-1], ts[-1]))
    return window, late, new


def low_watermark(marks: dict, partitions, *, now_ms: int, idle_timeout_ms: int) -> int | None:
    """The least ``passed`` over ``partitions`` (keys of ``marks``: ``MarkRecord``), leaving out
    the ones idle for ``idle_timeout_ms`` (0: never); None while one that counts has none. When
    every partition is idle, the largest ``passed``: all were read to their end."""
    values, idle = [], []
    for key in partitions:
        m = marks.get(key)
        if (
            m is not None
            and idle_timeout_ms
            and m.idle_since_ms is not None
            and now_ms - m.idle_since_ms >= idle_timeout_ms
        ):
            idle.append(m.passed_ms)
            continue
        if m is None or m.passed_ms is None:
            return None
        values.append(m.passed_ms)
    if values:
        return min(values)
    known = [v for v in idle if v is not None]
    return max(known) if known else None


def opening_window(
    marks: dict, partitions, *, now_ms: int, idle_timeout_ms: int, size_ms: int
) -> int | None:
    """The group's first window, as one process opens it: the earliest window of the source
    partitions' first records, once every partition has one (those idle for
    ``idle_timeout_ms`` aside); None until then.

    >>> marks = {"t:0": MarkRecord(50_000, first_ms=31_000), "t:1": MarkRecord(12_000,
    ...          first_ms=12_000)}
    >>> opening_window(marks, ["t:0", "t:1"], now_ms=0, idle_timeout_ms=0, size_ms=10_000)
    1
    >>> opening_window(marks, ["t:0", "t:1", "t:2"], now_ms=0, idle_timeout_ms=0, size_ms=10_000)
    """
    firsts = []
    for key in partitions:
        m = marks.get(key)
        idle = (
            m is not None
            and idle_timeout_ms
            and m.idle_since_ms is not None
            and now_ms - m.idle_since_ms >= idle_timeout_ms
        )
        if m is None or m.first_ms is None:
            if idle:
                continue
            return None
        firsts.append(m.first_ms)
    return min(firsts) // size_ms if firsts else None


def closable_upto(watermark_ms: int | None, *, size_ms: int, lateness_ms: int) -> int | None:
    """The last window K with ``(K + 1) * S + L <= watermark`` (None: no watermark).

    >>> closable_upto(2500, size_ms=1000, lateness_ms=500), closable_upto(2499, size_ms=1000,
    ...                                                                   lateness_ms=500)
    (1, 0)
    """
    if watermark_ms is None:
        return None
    return (int(watermark_ms) - int(lateness_ms)) // int(size_ms) - 1


def too_far_ahead(passed_ms: int | None, watermark_ms: int | None, *, size_ms: int) -> bool:
    """Whether a source partition that has ``passed_ms`` is more than MAX_AHEAD_WINDOWS windows
    past the low watermark, so the intake pauses it (no watermark yet: nothing is counted
    before the group's first window is known, so nothing is live to bound).

    >>> too_far_ahead(95_000, 50_000, size_ms=10_000)
    True
    >>> too_far_ahead(89_999, 50_000, size_ms=10_000), too_far_ahead(None, 50_000, size_ms=1)
    (False, False)
    """
    if passed_ms is None or watermark_ms is None:
        return False
    return int(passed_ms) // size_ms > int(watermark_ms) // size_ms + MAX_AHEAD_WINDOWS


class MarkRecord:
    """What the intake topic holds of one source partition for one aggregation (key
    ``wm:<repartition topic>:<source topic>:<partition>``): its ``passed``, the timestamp of its
    first record (``first_ms``) and, while it is read to its end, since when
    (``idle_since_ms``)."""

    __slots__ = ("passed_ms", "idle_since_ms", "first_ms")

    def __init__(
        self, passed_ms: int | None, idle_since_ms: int | None = None, first_ms: int | None = None
    ):
        self.passed_ms, self.idle_since_ms, self.first_ms = passed_ms, idle_since_ms, first_ms

    def encode(self) -> bytes:
        return json.dumps(
            {"ts": self.passed_ms, "idle": self.idle_since_ms, "first": self.first_ms},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, value: bytes) -> "MarkRecord":
        d = json.loads(value)
        return cls(d.get("ts"), d.get("idle"), d.get("first"))

    @staticmethod
    def key(route_topic: str, source: str) -> str:
        return f"wm:{route_topic}:{source}"

    @staticmethod
    def close_key(route_topic: str) -> str:
        """The last window the leader closed (written with its close markers)."""
        return f"close:{route_topic}"


def stamped(decoder, recs, now_ms: int, skew_ms: int):
    """``recs`` (one source partition's records, in order) decoded, with their timestamps, for
    event-time windows: ``(decoded, good, ts, rejects, keep)``. ``good``: the indices the
    decoder accepted; ``ts``: their timestamps in ms (-1: none); ``rejects``: (index, reason) of
    the records that do not count (undecodable, no timestamp, stamped past ``now_ms`` plus the
    allowed skew); ``keep``: the mask over ``good`` of those that do."""
    decoded = decoder.decode(
        [r.value for r in recs], [r.key for r in recs], [r.headers for r in recs]
    )
    bad = {i for i, _ in decoded.rejected}
    good = np.asarray([i for i in range(len(recs)) if i not in bad], dtype=np.int64)
    ts = np.asarray(
        [-1 if recs[i].timestamp is None else recs[i].timestamp for i in good], dtype=np.int64
    )
    no_ts, future = ts < 0, ts > now_ms + skew_ms
    rejects = list(decoded.rejected)
    rejects += [(int(i), "no_timestamp") for i in good[no_ts]]
    rejects += [(int(i), "future_timestamp") for i in good[future]]
    return decoded, good, ts, rejects, ~(no_ts | future)
