"""A member's view of a window, and the release from a window's views (the views exchange).

A *view* is a member's pan-private state of window w (its counters plus its own DLap layer)
with one fresh DLap layer more, drawn at the window's end: the counters go as zlib chunks of
int32 or int64 (:func:`encode_counts`, :data:`CHUNK_COUNTERS` a message), then a JSON header
naming the window, the source partitions it covers and their ranges, the layers it holds and its
``n`` (:func:`view_header`). The leader sums the views of a window once they cover every source
partition exactly once (:func:`sum_views`) and releases from the sum, telling the estimators how
many layers it holds (:func:`merge_views`, deterministic but for a window no member counted an
event in). Why each layer is there: docs/privacy.md section 20a. The member that writes views:
:mod:`.views`.

>>> import numpy as np
>>> from aggregator.state import PanPrivateHistogram
>>> s = PanPrivateHistogram(1.0, size=6)
>>> s.add_indices(np.array([1, 1, 4]))
>>> head = view_header(s, window=3, covers=[0], partitions=2,
...                    window_info={"kind": "time", "size": 60.0, "events": 3,
...                                 "started_unix": 180.0, "ended_unix": 240.0})
>>> head["layers"], head["n"], head["covers"], len(head["_chunks"]) == head["chunks"]
(2, 3, [0], True)
>>> empty = view_header(None, window=3, covers=[1], partitions=2, size=6, params=s,
...                     window_info={"kind": "time", "size": 60.0, "events": 0,
...                                  "started_unix": 180.0, "ended_unix": 240.0})
>>> release = merge_views([head, empty], error_bar_reps=0)
>>> release["n"], release["layers"], release["domain"]["counters"]
(3, 2, 6)
"""

from __future__ import annotations

import time
import uuid
import zlib
from types import SimpleNamespace

import numpy as np

from ...counters import noisy_value_counts
from ...noise import discrete_laplace
from ...release import ERROR_BAR_REPS, estimate_with_accuracy, package_release
from ...state import PanPrivateHistogram
from .summary import agreeing, event_time_info, merged_window_info

__all__ = [
    "VIEW_FORMAT",
    "CHUNK_COUNTERS",
    "view_header",
    "merge_views",
    "decode_view",
    "encode_counts",
    "distinct_views",
    "sum_views",
    "state_params",
]

#: counters per chunk message: int32 chunks stay under 512 KB before compression, so a view fits
#: a broker's default message size (1 MB) whatever D is
CHUNK_COUNTERS = 1 << 17
VIEW_FORMAT = "panagg.view"


# -- pure parts: a view and the sum of a window's views -------------------------------------
def encode_counts(counts: np.ndarray) -> tuple[str, list[bytes]]:
    """(dtype, zlib chunks of CHUNK_COUNTERS counters): int32 when every counter fits."""
    small = counts.size == 0 or (int(counts.min()) >= -(2**31) and int(counts.max()) < 2**31)
    dtype = "<i4" if small else "<i8"
    arr = counts.astype(dtype)
    return dtype, [
        zlib.compress(arr[i : i + CHUNK_COUNTERS].tobytes(), 1)
        for i in range(0, max(1, arr.size), CHUNK_COUNTERS)
    ]


def decode_view(header: dict) -> np.ndarray:
    """The counters of a view from its header's ``_chunks`` (int64)."""
    parts = [np.frombuffer(zlib.decompress(c), dtype=header["dtype"]) for c in header["_chunks"]]
    out = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    if out.size != int(header["size"]):
        raise ValueError(
            f"view of window {header['window']} holds {out.size} counters, not {header['size']}"
        )
    return out


def view_header(
    state: PanPrivateHistogram | None,
    *,
    window: int,
    covers: list[int],
    partitions: int,
    window_info: dict,
    mode: str = "direct",
    size: int | None = None,
    params=None,
    rng=None,
) -> dict:
    """The view of a member's window: ``state`` plus one fresh DLap layer, as chunks (kept in
    ``_chunks``, sent as their own messages) and a JSON-able header. ``state`` None: the member
    counted no event in the window; the header carries no counters (``size`` and ``params``,
    anything with epsilon, neighbor and p, describe the domain). ``mode``: the group's (a
    hashed group's counters are hash buckets)."""
    params = state if state is not None else params
    head = {
        "format": VIEW_FORMAT,
        "version": 1,
        "window": int(window),
        "partition": int(min(covers)),
        "covers": sorted(int(p) for p in covers),
        "partitions": int(partitions),
        "mode": str(mode),
        "size": int(state.size if state is not None else size),
        "epsilon": params.epsilon,
        "neighbor": params.neighbor,
        "p": params.p,
        "model": "joint",
        "window_info": dict(window_info),
        "uid": uuid.uuid4().hex,
    }
    if state is None:
        head.update(layers=0, n=0, chunks=0, dtype="<i4", _chunks=[])
        return head
    counts = state.counts + discrete_laplace(state.p, state.size, rng=rng)
    dtype, chunks = encode_counts(counts)
    head.update(
        layers=int(state.layers) + 1,
        n=int(state.n),
        chunks=len(chunks),
        dtype=dtype,
        _chunks=chunks,
    )
    return head


def distinct_views(have: dict) -> list[dict]:
    """The views of a window once each (``have`` files a view under every partition it
    covers)."""
    return list({id(v): v for v in have.values()}.values())


def sum_views(views: list[dict], size: int) -> tuple[np.ndarray, int, int]:
    """``(counters, layers, n)`` of ``views`` added up: what a window's release is computed
    from (a view without counters, or a refused one, adds none)."""
    total = np.zeros(int(size), dtype=np.int64)
    layers = 0
    for v in views:
        if v.get("chunks"):
            total += decode_view(v)
            layers += int(v["layers"])
    return total, layers, int(sum(int(v.get("n") or 0) for v in views))


def state_params(identity: dict):
    """epsilon, neighbor and p of the group's states (anything ``view_header`` takes)."""

    probe = PanPrivateHistogram(identity["epsilon"], neighbor=identity["neighbor"], size=1)
    return SimpleNamespace(epsilon=probe.epsilon, neighbor=probe.neighbor, p=probe.p)


_MUST_AGREE = ("window", "partitions", "mode", "size", "epsilon", "neighbor", "p")


def merge_views(
    views: list[dict],
    *,
    loss: str = "l1",
    error_bar_reps: int = ERROR_BAR_REPS,
    method: str | None = None,
    rng=None,
) -> dict:
    """The window's release from the views of every member that counted part of it: the sum of
    the views' counters (each with its state layer and its view layer), then the estimators,
    told how many layers the sum holds. Deterministic but for a window no member counted an
    event in: that one gets the two layers one process's empty window has, drawn here."""
    if not views:
        raise ValueError("no views to merge")
    first = agreeing(views, VIEW_FORMAT, _MUST_AGREE, "views")
    covered = sorted(p for v in views for p in v["covers"])
    if covered != list(range(first["partitions"])):
        raise ValueError(
            f"window {first['window']} needs views of partitions "
            f"0..{first['partitions'] - 1} once each, got {covered}"
        )
    started = time.perf_counter()
    size = int(first["size"])
    total, layers, n = sum_views(views, size)
    if layers == 0:
        for _ in range(2):
            total += discrete_laplace(first["p"], size, rng=rng)
        layers = 2
    vc = noisy_value_counts(total)
    hashed = first["mode"] == "hashed"
    hist, accuracy = estimate_with_accuracy(
        vc,
        first["p"],
        layers=layers,
        loss=loss,
        n=n,
        buckets=size if hashed else None,
        reps=error_bar_reps,
        method=method,
    )
    members = sum(1 for v in views if v["chunks"])
    release = package_release(
        hist,
        window=first["window"],
        n=n,
        epsilon=first["epsilon"],
        neighbor=first["neighbor"],
        model="joint",
        extra={
            "p": first["p"],
            "layers": layers,
            "loss": loss,
            "domain": {
                "mode": first["mode"],
                "size": size,
                "counters": size,
                "partitions": first["partitions"],
            },
            "exchange": {
                "kind": "views",
                "views": members,
                "why_layers": "each member's view carries its state's layer, "
                "two per in-window snapshot and its view's layer; "
                "the leader sums them",
            },
        },
        accuracy=accuracy,
    )
    infos = [v["window_info"] for v in views]
    release["window_info"] = merged_window_info(
        infos,
        "count windows cut by each member at the group's reported total"
        if infos[0]["kind"] == "count"
        else "time windows by each member's clock, aligned to the epoch",
    )
    if infos[0]["kind"] == "event_time":
        release["window_info"].update(
            event_time_info(
                infos,
                "event-time windows, closed by each member once the group's low watermark "
                "passed them (event_views.py)",
            )
        )
    release["release_seconds"] = time.perf_counter() - started
    return release
