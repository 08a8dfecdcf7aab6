"""Source records deleted before they were counted: the look both exchanges use.

A topic's retention (or ``kafka-delete-records``) can delete records a member has not read yet,
most often while it was down longer than the retention. The consumer then goes on from the
first record left (``auto_offset_reset = earliest``) without a word, and a window counted
without them would be released short. Both exchanges look, where a partition's offsets start
or jump, whether its first offset is now past where reading was due to go on; the records in
between were deleted, and every window that may have held one is withheld naming them
(views: :mod:`.views`; items: the intake's ``lost`` markers, :mod:`.repartition`).
"""

from __future__ import annotations

from ..stages.retention import deleted_text

__all__ = ["deleted_since", "deleted_text", "lost_through"]


def deleted_since(consumer, since: dict) -> dict:
    """TopicPartition -> its first offset, for each partition of ``since`` (TopicPartition ->
    offset) whose first offset is past ``since[tp]``: the records in between were deleted
    before they were counted. One look at the broker for all of them."""
    if not since:
        return {}
    lows = consumer.beginning_offsets(list(since))
    return {
        tp: int(lows[tp])
        for tp in sorted(since)
        if lows.get(tp) is not None and int(lows[tp]) > since[tp]
    }


def lost_through(now_ms: int, *, size_ms: int, skew_ms: int) -> int:
    """The last window a record deleted before it was counted may have belonged to.

    Its timestamp is gone with it. It was written before now, and a record stamped later than
    now + ``window.max_future_skew_s`` is rejected, so its window (or, if it was late, the
    first window its partition had not passed, which is earlier) is at most the window of
    ``now_ms + skew_ms``; none at or before the last window closed on its partition. Every
    window in between may hold it, so each is withheld on that partition.

    >>> lost_through(10_500, size_ms=1000, skew_ms=3000)
    13
    """
    return int((int(now_ms) + int(skew_ms)) // int(size_ms))
