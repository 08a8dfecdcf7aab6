"""What each source position has been charged: the ledger's per-event accounting.

A release reveals the events its window counted, and those are the records of a range of source
positions: per partition, ``[start, end)``. The ledger records that range with every release
(and refusal), so the charge of one event is a sum over the releases whose ranges contain its
position, whatever their window numbers, uids, restarts, fresh starts or aggregations.

One refinement keeps the sum exact instead of over-counting: a **lineage** (one unbroken chain
of checkpoints of one aggregation: it begins at a start without a checkpoint) puts each record
in at most one of its windows. Count and time windows of a lineage never overlap, so their
ranges never meet. Event-time windows of a lineage do overlap in positions (two windows live at
once, records interleaved) while still splitting the records between them; for those, the
lineage's charge at a position is the largest of its overlapping windows, not their sum.

>>> book = ChargeBook([
...     {"kind": "release", "epsilon_spent": 1.0, "lineage": "a", "window_kind": "count",
...      "ranges": {"p0": [0, 100]}},
...     {"kind": "release", "epsilon_spent": 1.0, "lineage": "a", "window_kind": "count",
...      "ranges": {"p0": [100, 200]}}])
>>> book.peak({"p0": [50, 150]}, 1.0, lineage="b")   # a fresh start over spent positions
2.0
>>> book.peak({"p0": [200, 300]}, 1.0, lineage="b")  # new positions
1.0
>>> book.resume_offsets(1.0, budget=1.0)             # where a fresh start may begin
{'p0': 200}

A **parallel group** (a breakdown's keys, ``parallel = {"group", "member"}`` on the entries)
puts each record in the state of one member only (its key's): a position's charge from the group
is the largest of its members' charges, each member's summed as above, not their sum.

>>> keys = ChargeBook([
...     {"kind": "release", "epsilon_spent": 1.0, "lineage": k, "window_kind": "count",
...      "ranges": {"p0": [0, 100]}, "parallel": {"group": "breakdown:c", "member": k}}
...     for k in ("de", "fr", "it")])
>>> keys.peak({"p0": [0, 100]}, 0.0)                 # three keys' releases, one charge
1.0
>>> keys.peak({"p0": [0, 100]}, 1.0, lineage="de2",  # the same key again: it adds up
...           parallel={"group": "breakdown:c", "member": "de"})
2.0
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["ChargeBook", "CHARGED_KINDS"]

#: ledger entry kinds whose ``ranges`` carry a charge (a refusal records its range at eps 0)
CHARGED_KINDS = ("release", "export-release")


class ChargeBook:
    """Per-partition charges from ledger entries (each with ``ranges``, ``epsilon_spent``,
    ``lineage`` and ``window_kind``).

    Parameters
    ----------
    entries
        Ledger entries, from one ledger or from the ledgers of every aggregation of a stream;
        entries without ``ranges`` (migrated from format 1 without positions) charge nothing
        here and are accounted by window instead.
    """

    def __init__(self, entries):
        # partition -> list of (start, end, eps, group, parallel): one group's overlapping
        # ranges charge their maximum (event-time windows of one lineage), different groups add
        # up; the members of one parallel group (pgroup, member) charge their maximum
        self._by_partition: dict[str, list[tuple]] = defaultdict(list)
        for i, e in enumerate(entries):
            if e.get("kind") not in CHARGED_KINDS or not e.get("ranges"):
                continue
            eps = float(e.get("epsilon_spent", 0.0))
            if eps <= 0:
                continue
            group = self._group(e.get("lineage"), e.get("window_kind"), f"entry-{i}")
            par = _parallel(e.get("parallel"))
            for part, (start, end) in e["ranges"].items():
                if int(end) > int(start):
                    self._by_partition[part].append((int(start), int(end), eps, group, par))

    @staticmethod
    def _group(lineage, window_kind, unique: str) -> str:
        return f"et:{lineage}" if window_kind == "event_time" and lineage else unique

    def peak(
        self,
        ranges: dict,
        epsilon: float,
        *,
        lineage: str | None = None,
        window_kind: str | None = None,
        parallel: dict | None = None,
    ) -> float:
        """The largest charge any position of ``ranges`` would carry with a new release of
        ``epsilon`` over them (the check: ``peak <= budget_per_event``); ``parallel``: the new
        release's parallel group and member (a breakdown's key), None for none."""
        new_group = self._group(lineage, window_kind, "new")
        new_par = _parallel(parallel)
        worst = 0.0 if not ranges else float(epsilon)
        for part, (start, end) in ranges.items():
            start, end = int(start), int(end)
            if end <= start:
                continue
            spans = [s for s in self._by_partition.get(part, ()) if s[0] < end and s[1] > start]
            spans.append((start, end, float(epsilon), new_group, new_par))
            worst = max(worst, _max_sum(spans, start, end))
        return worst

    def resume_offsets(self, epsilon: float, *, budget: float) -> dict[str, int]:
        """Per partition, the first position after which a release of ``epsilon`` fits the
        budget everywhere (a fresh start begins there, never over spent positions)."""
        out = {}
        for part, spans in self._by_partition.items():
            over = 0
            for lo, hi, total in _segments(spans, None, None):
                if total + epsilon > budget * (1 + 1e-12):
                    over = max(over, hi)
            if over:
                out[part] = over
        return out

    def most(self, partitions) -> float:
        """The largest charge any position of ``partitions`` carries (0: none charged)."""
        return max(
            (
                total
                for part in partitions
                for _, _, total in _segments(self._by_partition.get(part, ()), None, None)
            ),
            default=0.0,
        )

    def charged_partitions(self) -> list[str]:
        return sorted(self._by_partition)


def _parallel(value) -> tuple[str, str] | None:
    """(group, member) of an entry's ``parallel`` field, None without one."""
    if not value:
        return None
    return str(value["group"]), str(value["member"])


def _segments(spans, lo, hi):
    """(start, end, charge) of the pieces between consecutive boundaries of ``spans``."""
    cuts = sorted(
        {s[0] for s in spans} | {s[1] for s in spans} | ({lo, hi} if lo is not None else set())
    )
    for a, b in zip(cuts, cuts[1:]):
        if lo is not None and (b <= lo or a >= hi):
            continue
        # (parallel group or None, member) -> group -> the largest charge there
        best: dict[tuple, dict[str, float]] = defaultdict(dict)
        for s, e, eps, group, par in spans:
            if s <= a and e >= b:
                one = best[par or (None, "")]
                one[group] = max(one.get(group, 0.0), eps)
        total = sum(best.pop((None, ""), {}).values())
        members: dict[str, float] = {}
        for (pgroup, _), groups in best.items():  # a position is in one member's state only
            members[pgroup] = max(members.get(pgroup, 0.0), sum(groups.values()))
        yield a, b, total + sum(members.values())


def _max_sum(spans, lo: int, hi: int) -> float:
    return max((total for _, _, total in _segments(spans, lo, hi)), default=0.0)
