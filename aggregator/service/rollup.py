"""Rollups: hour, day and week releases from the base windows' release views, at no extra eps.

The math. A base window w is released from its *release view*

    B_w = c_w + Z_w + W_w

(its counters c_w, the state's noise layers Z_w and the fresh release layer W_w: ``layers_w``
independent DLap(p) draws per counter, 2 in the joint model without snapshots). The release is a
function of B_w alone, and B_w is eps-DP jointly with one intrusion into window w's state
(docs/privacy.md, Theorem 1 and section 16). A rollup of k consecutive base windows is

    R = sum_w B_w = (sum_w c_w) + (sum of sum_w layers_w independent DLap(p) layers),

a function of views that are each already released: post-processing, no epsilon (docs/privacy.md
section 21 has the proof, including the intruder who reads window w's live state and later
sees the rollup that contains it). The counters of R are exactly the counters of one long window
holding all k windows' events, with K = sum_w layers_w noise layers instead of 2: the
estimators take the layer count and deconvolve the K-fold convolution of DLap(p)
(:func:`aggregator.estimate.noise_pmf`). It must be the *same* B_w the base release used: a
second draw of W_w would be a second view of window w (2 eps).

:class:`RollupSum` is one rollup's running sum: ``update`` adds one base window's view (keyed
by its uid: adding the same window twice is a no-op, so a replayed fold after a crash never
counts it twice), ``merge`` adds another partial sum of disjoint windows (scale-out: one per
partition group, later), and ``to_bytes``/``from_bytes`` keep it on disk (atomic file writes
are :class:`RollupStore`'s job).

>>> import numpy as np
>>> r = RollupSum("3x", 0, windows=3, p=0.6, mode="direct", size=4)
>>> r.update("uid-a", 0, np.array([2, 0, -1, 5]), layers=2, n=7)
True
>>> r.update("uid-a", 0, np.array([2, 0, -1, 5]), layers=2, n=7)  # the same window again
False
>>> other = RollupSum("3x", 0, windows=3, p=0.6, mode="direct", size=4)
>>> other.update("uid-b", 1, np.array([1, 1, 0, 0]), layers=2, n=2)
True
>>> r.merge(other)
>>> r.counts.tolist(), r.layers, r.n, r.covered()
([3, 1, -1, 5], 4, 9, [0, 1])
>>> RollupSum.from_bytes(r.to_bytes()).counts.tolist()
[3, 1, -1, 5]
>>> r.expected_windows(), r.missing()
([0, 1, 2], [2])
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np

from state_store.atomic import atomic_write

__all__ = [
    "RollupSum",
    "RollupStore",
    "parse_span",
    "RollupError",
    "ROLLUP_ARGUMENT",
    "rollup_block",
    "missing_caveat",
]

#: the ledger's and the release's argument for a rollup's 0 eps (one process and groups)
ROLLUP_ARGUMENT = (
    "0 eps: the sum of its base windows' release views (the counters each "
    "base release was computed from, with its release layer): "
    "post-processing of released views (docs/privacy.md section 21)"
)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class RollupError(ValueError):
    """A rollup setting or sum that cannot be used (one line naming the fix)."""


def parse_span(text, *, kind: str, size: float) -> int:
    """The number of base windows in the rollup ``text`` of windows of ``kind`` and ``size``.

    ``"24x"``: 24 base windows (any kind). Time windows: a duration (``"1h"``, ``"1d"``,
    ``"7d"``, ``"90m"``, ``"3600s"``) that is a multiple of ``window.size`` seconds. Count
    windows: a number of events (``2400000`` or ``"2400000"``) that is a multiple of
    ``window.size``. At least 2 base windows.

    >>> parse_span("1d", kind="time", size=3600), parse_span("7d", kind="event_time", size=3600)
    (24, 168)
    >>> parse_span(3000, kind="count", size=1000), parse_span("5x", kind="count", size=1000)
    (3, 5)
    >>> parse_span("90m", kind="time", size=3600)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    aggregator.service.rollup.RollupError: window.rollups: "90m" is 5400 s, not a multiple of
    window.size = 3600 s; use a multiple such as "2h"
    """
    raw = str(text).strip().lower()
    m = re.fullmatch(r"(\d+)x", raw)
    if m:
        k = int(m.group(1))
    elif kind == "count":
        if not raw.isdigit():
            raise RollupError(
                f"window.rollups: {text!r} is not a number of events (count "
                f'windows of {size:g} events: use e.g. {int(size) * 24} or "24x")'
            )
        events = int(raw)
        if events % int(size):
            raise RollupError(
                f"window.rollups: {events} events is not a multiple of "
                f"window.size = {int(size)}; use e.g. {int(size) * 24}"
            )
        k = events // int(size)
    else:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", raw)
        if not m:
            raise RollupError(
                f'window.rollups: {text!r} is not a duration; use e.g. "1d", '
                '"7d", "6h" or "24x" (24 base windows)'
            )
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
        ratio = seconds / float(size)
        if abs(ratio - round(ratio)) > 1e-9:
            hint = _duration(float(size) * max(2, int(ratio) or 2))
            raise RollupError(
                f'window.rollups: "{raw}" is {seconds:g} s, not a multiple of '
                f"window.size = {float(size):g} s; use a multiple such as "
                f'"{hint}"'
            )
        k = int(round(ratio))
    if k < 2:
        raise RollupError(
            f"window.rollups: {text!r} is {k} base window(s); a rollup covers at "
            "least 2 (one window is its own release)"
        )
    return k


def _duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


class RollupSum:
    """The running sum of one rollup: base windows ``index * windows .. (index+1) * windows - 1``
    of the series ``span`` (their numbers, not their uids, place them; uids key the sum).

    Parameters
    ----------
    span
        The rollup's name as configured (``"1d"``); ``windows`` base windows make one.
    p, mode, size
        The base windows' noise parameter and domain: every view added must match.
    """

    FORMAT = "panagg-rollup"

    def __init__(self, span: str, index: int, *, windows: int, p: float, mode: str, size: int):
        self.span, self.index, self.windows = str(span), int(index), int(windows)
        self.p, self.mode, self.size = float(p), str(mode), int(size)
        self.counts = np.zeros(self.size, dtype=np.int64)
        self.layers = 0
        self.n: int | None = 0
        #: uid -> {"window": id, "layers": k, "n": n or None} of each base window added
        self.parts: dict[str, dict] = {}

    def expected_windows(self) -> list[int]:
        return list(range(self.index * self.windows, (self.index + 1) * self.windows))

    def covered(self) -> list[int]:
        return sorted(int(v["window"]) for v in self.parts.values())

    def missing(self) -> list[int]:
        have = set(self.covered())
        return [w for w in self.expected_windows() if w not in have]

    def holds(self, window: int) -> bool:
        return self.index * self.windows <= int(window) < (self.index + 1) * self.windows

    def update(self, uid: str, window: int, counts, *, layers: int, n: int | None) -> bool:
        """Add base window ``window`` (uid ``uid``): its release view ``counts`` carrying
        ``layers`` DLap(p) layers and its event count ``n`` (None: not public). False if that
        uid is already in the sum (nothing changes)."""
        if uid in self.parts:
            return False
        if not self.holds(window):
            raise RollupError(
                f"rollup {self.span} #{self.index} covers windows "
                f"{self.index * self.windows}..{(self.index + 1) * self.windows - 1}"
                f", not window {window}"
            )
        counts = np.asarray(counts)
        if counts.shape != (self.size,):
            raise RollupError(
                f"rollup {self.span}: a view of {counts.shape} counters cannot be "
                f"added to a sum of {self.size}"
            )
        self.counts += counts.astype(np.int64, copy=False)
        self.layers += int(layers)
        self.n = None if (self.n is None or n is None) else self.n + int(n)
        self.parts[str(uid)] = {
            "window": int(window),
            "layers": int(layers),
            "n": None if n is None else int(n),
        }
        return True

    def merge(self, other: "RollupSum") -> None:
        """Add another partial sum of the same rollup over other base windows."""
        if (other.span, other.index, other.p, other.mode, other.size) != (
            self.span,
            self.index,
            self.p,
            self.mode,
            self.size,
        ):
            raise RollupError("rollup sums of different rollups or domains cannot be merged")
        both = set(self.parts) & set(other.parts)
        if both:
            raise RollupError(
                f"rollup {self.span} #{self.index}: base windows {sorted(both)} "
                "are in both sums (each window is added once)"
            )
        self.counts += other.counts
        self.layers += other.layers
        self.n = None if (self.n is None or other.n is None) else self.n + other.n
        self.parts.update(other.parts)

    # -- on disk -------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        head = {
            "format": self.FORMAT,
            "version": 1,
            "span": self.span,
            "index": self.index,
            "windows": self.windows,
            "p": self.p,
            "mode": self.mode,
            "size": self.size,
            "layers": self.layers,
            "n": self.n,
            "parts": self.parts,
        }
        buf = io.BytesIO()
        np.save(buf, self.counts, allow_pickle=False)
        meta = json.dumps(head, sort_keys=True).encode()
        return len(meta).to_bytes(8, "big") + meta + buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RollupSum":
        try:
            size = int.from_bytes(data[:8], "big")
            head = json.loads(data[8 : 8 + size])
            if head.get("format") != cls.FORMAT:
                raise ValueError("not a rollup sum")
            obj = cls(
                head["span"],
                head["index"],
                windows=head["windows"],
                p=head["p"],
                mode=head["mode"],
                size=head["size"],
            )
            obj.counts = np.load(io.BytesIO(data[8 + size :]), allow_pickle=False).astype(np.int64)
            obj.layers, obj.n, obj.parts = int(head["layers"]), head["n"], dict(head["parts"])
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise RollupError(f"a rollup sum file is damaged ({exc})") from None
        if obj.counts.shape != (obj.size,):
            raise RollupError("a rollup sum file is damaged (wrong number of counters)")
        return obj


def rollup_block(r: RollupSum, missing: list[dict], layers: int) -> dict:
    """The ``rollup`` block of a rollup's release document (``missing``: ``{"window", "why"}``
    of each base window it lacks; ``layers``: the noise layers its release deconvolves)."""
    return {
        "span": r.span,
        "index": r.index,
        "base_windows": r.windows,
        "first_window": r.index * r.windows,
        "last_window": (r.index + 1) * r.windows - 1,
        "windows": r.covered(),
        "complete": not missing,
        "missing": missing,
        "layers": int(layers),
        "epsilon_spent": 0.0,
        "argument": ROLLUP_ARGUMENT,
    }


def missing_caveat(name: str, held: int, windows: int, missing: list[dict]) -> str:
    """The release's caveat for a rollup that lacks base windows."""
    return (
        f"rollup {name} holds {held} of {windows} base windows "
        f"(missing: {', '.join(str(m['window']) for m in missing[:5])}"
        f"{' ...' if len(missing) > 5 else ''}); its n and histogram "
        "cover only the windows it names"
    )


def _write_atomic(path: Path, data: bytes) -> None:
    """The old or the new bytes, durably, mode 0600 (sums of release views stay private files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, [data])


class RollupStore:
    """The rollup sums of one aggregation under ``<checkpoint.dir>/rollups``.

    Files (all of them sums of base windows' release views, docs/privacy.md section 21):

    * ``inbox/<uid>.npy`` + ``.json``: one base window's release view, written *after* its
      release is in the ledger and removed once every rollup series holds it;
    * ``<span>/<index>.sum``: the open (or closed, not yet ledgered) rollup's sum, replaced
      atomically; the uids it holds make a second fold of the same window a no-op.
    """

    def __init__(self, directory, spans: dict[str, int]):
        self.dir = Path(directory)
        self.spans = dict(spans)  # name -> base windows per rollup

    def _sum_path(self, span: str, index: int) -> Path:
        return self.dir / span / f"{int(index)}.sum"

    def load(self, span: str, index: int) -> RollupSum | None:
        path = self._sum_path(span, index)
        if not path.exists():
            return None
        return RollupSum.from_bytes(path.read_bytes())

    def save(self, rollup: RollupSum) -> None:
        _write_atomic(self._sum_path(rollup.span, rollup.index), rollup.to_bytes())

    def remove(self, span: str, index: int) -> None:
        self._sum_path(span, index).unlink(missing_ok=True)

    def open_indices(self, span: str) -> list[int]:
        d = self.dir / span
        if not d.is_dir():
            return []
        return sorted(int(p.stem) for p in d.glob("*.sum") if p.stem.lstrip("-").isdigit())

    # -- the inbox: one base window's view between its ledger entry and the folds ------------
    def put_inbox(self, uid: str, window: int, counts, *, layers: int, n, meta: dict) -> None:
        buf = io.BytesIO()
        np.save(buf, np.asarray(counts, dtype=np.int64), allow_pickle=False)
        body = json.dumps(
            {"uid": uid, "window": int(window), "layers": int(layers), "n": n, **meta},
            sort_keys=True,
        ).encode()
        data = len(body).to_bytes(8, "big") + body + buf.getvalue()
        _write_atomic(self.dir / "inbox" / f"{uid}.view", data)

    def inbox(self) -> list[tuple[dict, np.ndarray]]:
        out = []
        d = self.dir / "inbox"
        if not d.is_dir():
            return out
        for path in sorted(d.glob("*.view")):
            data = path.read_bytes()
            size = int.from_bytes(data[:8], "big")
            meta = json.loads(data[8 : 8 + size])
            out.append((meta, np.load(io.BytesIO(data[8 + size :]), allow_pickle=False)))
        out.sort(key=lambda mv: mv[0]["window"])
        return out

    def drop_inbox(self, uid: str) -> None:
        (self.dir / "inbox" / f"{uid}.view").unlink(missing_ok=True)
