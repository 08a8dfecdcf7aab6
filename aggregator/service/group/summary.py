"""A partition's window summary and the merge of a window's summaries into one release.

Partition p of a group counts the slice of the domain whose counter indices are p mod P
(:func:`~aggregator.service.group.repartition.slice_size` counters). Closing a window, it takes
the noisy-value counts c_v of its slice (how many counters hold each value), after adding the
release layer W (joint model): :func:`partition_summary`. That is post-processing of the
release view (docs/privacy.md section 5). Value counts add up over partitions, and the P slices
are one D-counter state, so :func:`merge_summaries` (deterministic) computes from their sum
exactly the release one process would compute from its own state plus W.

>>> import numpy as np
>>> from aggregator.state import PanPrivateHistogram
>>> info = {"kind": "time", "size": 60.0, "events": 0, "started_unix": 0.0, "ended_unix": 60.0}
>>> parts = [PanPrivateHistogram(1.0, size=5) for _ in range(2)]      # D = 10 in 2 slices
>>> parts[0].add_indices(np.array([0, 0, 1]))
>>> summaries = [partition_summary(s, model="joint", window=7, partition=p, partitions=2,
...                                window_info=info) for p, s in enumerate(parts)]
>>> release = merge_summaries(summaries, error_bar_reps=0)
>>> release["n"], release["domain"]["counters"], release["layers"]
(3, 10, 2)
"""

from __future__ import annotations

import time

import numpy as np

from state_store.failpoints import slow_point

from ...counters import NoisyValueCounts, noisy_value_counts
from ...noise import discrete_laplace
from ...release import ERROR_BAR_REPS, STATE_ONLY_CAVEAT, estimate_with_accuracy, package_release
from ...state import PanPrivateHistogram

__all__ = [
    "add_source",
    "source_ranges",
    "partition_summary",
    "view_summary",
    "merge_summaries",
    "agreeing",
    "event_time_info",
    "merged_window_info",
    "SUMMARY_FORMAT",
]

SUMMARY_FORMAT = "panagg.summary"


# -- pure parts: summary and merge -------------------------------------------------------------------
def add_source(sources: dict, header: bytes | None) -> None:
    """Widen ``sources`` (``<topic>:<partition>`` -> [first, end)) by a repartition message's
    ``src`` header (repartition.source_header).

    >>> s = {}
    >>> add_source(s, b"t:3:10:20"); add_source(s, b"t:3:20:25"); add_source(s, None); s
    {'t:3': [10, 25]}
    """
    if header is None:
        return
    part, _, span = header.decode().rpartition(":")
    part, _, first = part.rpartition(":")
    have = sources.get(part)
    a, b = int(first), int(span)
    sources[part] = [a, b] if have is None else [min(have[0], a), max(have[1], b)]


def source_ranges(summaries) -> dict:
    """The source positions a window's summaries came from, per source partition the span
    from the first to the last (the budget registry charges them: docs/privacy.md section 22).

    >>> source_ranges([{"sources": {"t:0": [5, 9]}}, {"sources": {"t:0": [0, 7], "t:1": [2, 4]}}])
    {'t:0': [0, 9], 't:1': [2, 4]}
    """
    out: dict[str, list[int]] = {}
    for s in summaries:
        for part, (a, b) in (s.get("sources") or {}).items():
            add_source(out, f"{part}:{a}:{b}".encode())
    return out


def partition_summary(
    state: PanPrivateHistogram,
    *,
    model: str,
    window: int,
    partition: int,
    partitions: int,
    window_info: dict,
    rng=None,
    view: list | None = None,
) -> dict:
    """The summary of one partition's window: noisy-value counts of its counters.

    Model ``"joint"`` adds the release layer W first (a fresh DLap(p) draw per counter; ``rng`` is
    a test-only source), so the summary is exactly what a one-state release would be computed
    from. The summary is post-processing of that view: it carries no more than the release.
    ``view`` (a list) receives ``(counters, layers)``: that very view, for the sum rollups
    (rollups.py; a second draw of W would be a second look at the window).
    """
    counts, layers = state.counts, state.layers
    if model == "joint":
        counts = counts + discrete_laplace(state.p, state.size, rng=rng)
        layers += 1
    if view is not None:
        view.append((counts, int(layers)))
    return view_summary(
        counts,
        layers=layers,
        model=model,
        window=int(window),
        partition=partition,
        partitions=partitions,
        window_info=window_info,
        n=state.n,
        params=state,
    )


def view_summary(
    counts,
    *,
    layers: int,
    model: str,
    window,
    partition: int,
    partitions: int,
    window_info: dict,
    n: int,
    params,
) -> dict:
    """The summary of released counters ``counts`` (``layers`` DLap layers) of a partition's
    slice; ``params`` has the state's mode, size, epsilon, neighbor and p."""
    vc = noisy_value_counts(counts)
    nz = np.flatnonzero(vc.c)
    return {
        "format": SUMMARY_FORMAT,
        "version": 1,
        "window": window,
        "partition": int(partition),
        "partitions": int(partitions),
        "mode": params.mode,
        "size": int(params.size),
        "epsilon": params.epsilon,
        "neighbor": params.neighbor,
        "p": params.p,
        "layers": int(layers),
        "model": model,
        "n": int(n),
        "window_info": dict(window_info),
        "values": [[int(vc.lo + i), int(vc.c[i])] for i in nz],
    }


def _value_counts(summary: dict) -> NoisyValueCounts:
    values = np.asarray(summary["values"], dtype=np.int64).reshape(-1, 2)
    lo, hi = int(values[:, 0].min()), int(values[:, 0].max())
    c = np.zeros(hi - lo + 1, dtype=np.int64)
    c[values[:, 0] - lo] = values[:, 1]
    return NoisyValueCounts(lo, c)


_MUST_AGREE = ("window", "partitions", "mode", "epsilon", "neighbor", "p", "model")


def agreeing(docs: list[dict], fmt: str, keys, what: str) -> dict:
    """The first of ``docs`` once every one is of format ``fmt`` and agrees with it on
    ``keys`` (one window's summaries or views); ValueError naming the keys otherwise."""
    first = docs[0]
    for d in docs:
        if d.get("format") != fmt:
            raise ValueError(f"not one of a window's {what} (format {d.get('format')!r})")
        bad = [k for k in keys if d[k] != first[k]]
        if bad:
            raise ValueError(f"{what} of window {first['window']} disagree on {', '.join(bad)}")
    return first


def merged_window_info(infos: list[dict], per_partition: str) -> dict:
    """A window's ``window_info`` from its parts': the events added up, the earliest start and
    the latest end."""
    return {
        "kind": infos[0]["kind"],
        "size": infos[0]["size"],
        "events": int(sum(i["events"] for i in infos)),
        "started_unix": min(i["started_unix"] for i in infos),
        "ended_unix": max(i["ended_unix"] for i in infos),
        "per_partition": per_partition,
    }


def event_time_info(infos: list[dict], per_partition: str) -> dict:
    """The event-time fields of a window's ``window_info`` from its parts', as one process's
    event-time release states them (by the records' timestamps)."""
    return {
        "event_start_unix": infos[0]["event_start_unix"],
        "event_end_unix": infos[0]["event_end_unix"],
        "late": int(sum(i.get("late", 0) for i in infos)),
        "late_policy": infos[0]["late_policy"],
        "allowed_lateness_s": infos[0]["allowed_lateness_s"],
        "per_partition": per_partition,
    }


def _add_layers(vc: NoisyValueCounts, p: float, extra: int, rng=None) -> NoisyValueCounts:
    """The value counts after ``extra`` fresh DLap(p) layers on every counter. Counters are
    exchangeable in this form, so drawing a layer per counter of each value is exactly adding
    the layer to the counters: fresh noise, never a look at anything new."""
    values = np.repeat(np.arange(vc.lo, vc.lo + len(vc.c), dtype=np.int64), vc.c)
    for _ in range(int(extra)):
        values = values + discrete_laplace(p, len(values), rng=rng)
    return noisy_value_counts(values)


def merge_summaries(
    summaries: list[dict],
    *,
    loss: str = "l1",
    error_bar_reps: int = ERROR_BAR_REPS,
    method: str | None = None,
) -> dict:
    """The window's release from the summaries of all its partitions (deterministic).

    Noisy-value counts add up over partitions; the estimators then run once on the sum, with
    ``buckets`` = the total number of hash buckets in hashed mode.
    """
    slow_point("release")  # a test hook: a slow merge on a small domain (failpoints.py)
    if not summaries:
        raise ValueError("no summaries to merge")
    first = agreeing(summaries, SUMMARY_FORMAT, _MUST_AGREE, "summaries")
    have = sorted(s["partition"] for s in summaries)
    if have != list(range(first["partitions"])):
        raise ValueError(
            f"window {first['window']} needs summaries of partitions "
            f"0..{first['partitions'] - 1}, got {have}"
        )
    started = time.perf_counter()
    # a partition that exported its window (an audit export: two fresh layers around it) holds
    # more layers than the others; the others get fresh layers up to the same count, so the
    # window is one state with one noise model
    layers = max(int(s["layers"]) for s in summaries)
    vc = None
    for s in summaries:
        mine = _value_counts(s)
        if int(s["layers"]) < layers:
            mine = _add_layers(mine, first["p"], layers - int(s["layers"]))
        vc = mine if vc is None else vc.merge(mine)
    counters = int(sum(s["size"] for s in summaries))
    if vc.total != counters:
        raise ValueError("summary value counts do not add up to the partitions' counters")
    n = int(sum(s["n"] for s in summaries))
    hashed = first["mode"] == "hashed"
    # each partition counted only its slice of the domain, so the slices together are one
    # state of ``counters`` counters, exactly as one process has it
    hist, accuracy = estimate_with_accuracy(
        vc,
        first["p"],
        layers=layers,
        loss=loss,
        n=n,
        buckets=counters if hashed else None,
        reps=error_bar_reps,
        method=method,
    )
    infos = [s["window_info"] for s in summaries]
    release = package_release(
        hist,
        window=first["window"],
        n=n,
        epsilon=first["epsilon"],
        neighbor=first["neighbor"],
        model=first["model"],
        extra={
            "p": first["p"],
            "layers": layers,
            "loss": loss,
            "domain": {
                "mode": first["mode"],
                "size": counters,
                "counters": counters,
                "partitions": first["partitions"],
            },
        },
        accuracy=accuracy,
    )
    release["window_info"] = merged_window_info(infos, "time windows aligned to the epoch")
    if infos[0]["kind"] == "count":
        release["window_info"]["per_partition"] = (
            "count windows, closed by the leader's markers once the group's intake took "
            "window.size events (docs/scale-out.md)"
        )
    if infos[0]["kind"] == "event_time":
        release["window_info"].update(
            event_time_info(infos, "event-time windows, closed by the leader's markers")
        )
    release["release_seconds"] = time.perf_counter() - started
    if first["model"] == "state-only":
        release["caveat"] = STATE_ONLY_CAVEAT
    return release
