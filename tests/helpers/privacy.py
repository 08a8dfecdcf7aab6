"""The counter-event audit of tests/test_privacy.py (its docstring states the method): the
empirical epsilon of two samples of views of neighbouring streams, a statistical lower bound on
the privacy loss that a correct mechanism exceeds with probability at most :data:`ALPHA`."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np

from aggregator.state import PanPrivateHistogram
from tests import lr_audit

ALPHA = 1e-6  # family-wise false-failure probability of one audit
L_SINGLE = 30  # one-dimensional events use values in [-L-1, L+1] (the ends are tail events)
L_PAIR = 12  # two-dimensional (quadrant) events use thresholds in [-Q-1, Q+1]

_cp_lower, _cp_upper = lr_audit._cp_lower, lr_audit._cp_upper


def _single_events(f: np.ndarray, lim: int = L_SINGLE) -> np.ndarray:
    """Counts of {f == v}, {f <= v}, {f >= v} for v in [-lim-1, lim+1] (values clipped there)."""
    width = 2 * lim + 3
    h = np.bincount(np.clip(f, -lim - 1, lim + 1) + lim + 1, minlength=width)
    return np.concatenate([h, np.cumsum(h), np.cumsum(h[::-1])[::-1]])


def _quadrant_events(f: np.ndarray, g: np.ndarray, lim: int = L_PAIR) -> np.ndarray:
    """Counts of the four quadrants {f <=/>= a, g <=/>= b} for a, b in [-lim-1, lim+1]."""
    width = 2 * lim + 3
    fi = np.clip(f, -lim - 1, lim + 1) + lim + 1
    gi = np.clip(g, -lim - 1, lim + 1) + lim + 1
    h = np.bincount(fi * width + gi, minlength=width * width).reshape(width, width)

    def cum(a):
        return a.cumsum(0).cumsum(1)

    le_le = cum(h)
    ge_ge = cum(h[::-1, ::-1])[::-1, ::-1]
    le_ge = cum(h[:, ::-1])[:, ::-1]
    ge_le = cum(h[::-1, :])[::-1, :]
    return np.concatenate([q.ravel() for q in (le_le, ge_ge, le_ge, ge_le)])


def view_event_counts(views: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """Counts over N samples of a fixed family of events on a view (V_0, ..., V_m).

    Each V_j is an (N, D) array (one row per run of the mechanism). Events are built from the
    raw views, the consecutive differences V_j - V_{j-1}, the counter differences within each of
    those, same-counter pairs across views, and quadrants of counter pairs: so they include the
    event that attains the e^eps ratio and the events that expose a missing noise layer. The
    family depends only on the shapes, never on the data, so the Bonferroni correction is valid.
    """
    arrays = [(f"V{j}", v) for j, v in enumerate(views)]
    arrays += [(f"V{j}-V{j - 1}", views[j] - views[j - 1]) for j in range(1, len(views))]
    singles, pairs = [], []
    for name, arr in arrays:
        d = arr.shape[1]
        singles += [(f"{name}[{i}]", arr[:, i]) for i in range(d)]
        for a in range(d):
            for b in range(a + 1, d):
                singles.append((f"{name}[{a}]-{name}[{b}]", arr[:, a] - arr[:, b]))
                pairs.append((f"({name}[{a}], {name}[{b}])", arr[:, a], arr[:, b]))
    for j in range(len(views)):
        for k in range(j + 1, len(views)):
            for i in range(views[0].shape[1]):
                pairs.append((f"(V{j}[{i}], V{k}[{i}])", views[j][:, i], views[k][:, i]))
    blocks, names = [], []
    for name, f in singles:
        c = _single_events(f)
        blocks.append(c)
        names.append((name, len(c)))
    for name, f, g in pairs:
        c = _quadrant_events(f, g)
        blocks.append(c)
        names.append((name, len(c)))
    return np.concatenate(blocks), names


def _best_log_ratio(c_num, n_num, c_den, n_den, a) -> tuple[float, int]:
    """max over events of log(lower CI of c_num / n_num) - log(upper CI of c_den / n_den).

    The bound is at most the point estimate log((c_num/n_num) / (c_den/n_den)) (for a < 1/2 the
    lower CI is below, the upper CI above the point estimate), so only events whose point estimate
    beats the best bound found so far need their intervals computed: an exact maximum, cheaply.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        point = np.log(c_num / n_num) - np.log(c_den / n_den)
    point[c_num == 0] = -np.inf
    order = np.argsort(-point, kind="stable")
    best, best_i, done = -np.inf, -1, 0
    while done < len(order):
        chunk = order[done : done + 2000]
        if point[chunk[0]] <= best:
            break
        with np.errstate(divide="ignore"):
            r = np.log(_cp_lower(c_num[chunk], n_num, a)) - np.log(
                _cp_upper(c_den[chunk], n_den, a)
            )
        j = int(np.argmax(r))
        if r[j] > best:
            best, best_i = float(r[j]), int(chunk[j])
        done += len(chunk)
    return best, best_i


def empirical_epsilon(views_x, views_y, alpha: float = ALPHA) -> tuple[float, str]:
    """Clopper-Pearson lower bound on the privacy loss between two samples of views.

    Returns (eps_hat, description of the event attaining it). Bonferroni over 4 intervals per
    event of the whole family (lower and upper for both samples, used in both directions), even
    though only the events that can matter have their intervals evaluated.
    """
    cx, names = view_event_counts(views_x)
    cy, _ = view_event_counts(views_y)
    nx, ny = len(views_x[0]), len(views_y[0])
    a = alpha / (4 * len(cx))
    r_xy, i_xy = _best_log_ratio(cx, nx, cy, ny, a)
    r_yx, i_yx = _best_log_ratio(cy, ny, cx, nx, a)
    best, i, direction = (r_xy, i_xy, "x vs x'") if r_xy >= r_yx else (r_yx, i_yx, "x' vs x")
    for name, size in names:
        if i < size:
            break
        i -= size
    return best, f"{name} event #{i} ({direction})"


def counters_in_files(state_dir: Path) -> list[np.ndarray]:
    """Counters found in any file under the state directory (checkpoints, temp files, exports),
    in the order of the files' checkpoint sequence numbers."""
    found = []
    for path in sorted(p for p in state_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if "checkpoint" not in path.name or len(data) < 8:
            assert b"panagg.state" not in data, path  # no serialized state anywhere else
            continue
        hlen = int.from_bytes(data[:8], "little")
        header = msgpack.unpackb(data[8 : 8 + hlen], raw=False, strict_map_key=False)
        if header.get("has_state", True) and len(data) > 8 + hlen:
            found.append((header["seq"], PanPrivateHistogram.deserialize(data[8 + hlen :]).counts))
    return [c for _, c in sorted(found, key=lambda t: t[0])]
