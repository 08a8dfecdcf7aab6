"""Turn a pan-private state into a release: noise layer, estimate, properties, files.

The release is post-processing of a view of the counters, so everything in it is covered by the
state's epsilon (see docs/privacy.md):

* model ``"joint"`` (default): the release is computed from the counters plus a fresh DLap(p)
  layer W, so the release and any single intrusion into the state are jointly epsilon-DP;
* model ``"state-only"``: the release is computed from the counters themselves (one layer less,
  better accuracy); an intrusion plus the release then reveal the exact increments between them.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from . import properties
from .estimate import anonymized_histogram
from .noise import discrete_laplace
from .state import PanPrivateHistogram

__all__ = ["MODELS", "ReleaseExists", "make_release", "package_release", "write_release",
           "plot_release",
           "plot_rank_frequency"]

MODELS = ("joint", "state-only")
STATE_ONLY_CAVEAT = (
    "state-only model: this release and a snapshot of the state taken during the window are not "
    "jointly epsilon-DP (together they reveal the exact increments between them)"
)


def make_release(state: PanPrivateHistogram, *, model: str = "joint", loss: str = "l1",
                 window: str | int | None = None, rng=None) -> dict:
    """Estimate the anonymized histogram of ``state`` and package it as a JSON-ready dict.

    The event count is public only for a replace-one state: it goes into the release (``"n"``)
    and to the estimators. An add-remove state has no n (neighbors differ by one event), so its
    release says ``"n": null`` and the estimators run without n; ``loss="l2"``, which needs n
    for its sum constraint, is refused for it.

    ``rng`` is a test-only noise source for the release layer; the state is not modified.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    n = state.n if state.neighbor == "replace-one" else None
    if n is None and loss == "l2":
        raise ValueError("loss='l2' needs the public event count n, and an add-remove state has "
                         "none (neighbors differ by one event); use loss='l1'")
    started = time.perf_counter()
    counts, layers = state.counts, state.layers
    if model == "joint":
        counts = counts + discrete_laplace(state.p, state.size, rng=rng)
        layers += 1
    hist = anonymized_histogram(counts, state.p, layers=layers, loss=loss, n=n,
                                buckets=state.size if state.mode == "hashed" else None)
    release = package_release(
        hist, window=window, n=n, epsilon=state.epsilon, neighbor=state.neighbor,
        model=model, extra={"p": state.p, "layers": layers, "loss": loss,
                            "domain": {"mode": state.mode, "size": state.size}})
    release["release_seconds"] = time.perf_counter() - started
    if model == "state-only":
        release["caveat"] = STATE_ONLY_CAVEAT
    return release


def package_release(hist, *, window, n, epsilon: float, neighbor: str, model: str,
                    extra: dict | None = None) -> dict:
    """The release document for an anonymized histogram (prevalence form plus properties).

    ``n`` is the public event count, or None where it is not public (add-remove states, the
    central model); it is only copied into the document. Nothing here is computed from it: the
    properties use n_hat, the total of the released histogram (post-processing).
    """
    hist = np.asarray(hist, dtype=np.int64)
    vals, phis = properties.prevalences(hist)
    n_hat = int(hist.sum())
    props = {
        "entropy_nats": properties.entropy(hist),
        "entropy_miller_madow_nats": properties.entropy(hist, correction="miller-madow"),
        "distinct_items": int(len(hist)),
        "support_coverage_2n": properties.support_coverage(hist, 2 * n_hat) if n_hat else 0.0,
    }
    release = {
        "format": "panagg.release",
        "version": 1,
        "window": window,
        "created_unix": time.time(),
        "n": n,
        "n_in_histogram": n_hat,
        "epsilon": epsilon,
        "neighbor": neighbor,
        "model": model,
    }
    release.update(extra or {})
    release["histogram"] = {"form": "prevalence",
                            "pairs": [[int(r), int(c)] for r, c in zip(vals[::-1], phis[::-1])]}
    release["properties"] = props
    return release


def plot_rank_frequency(release: dict, path: Path) -> None:
    """Log-log rank vs count plot of the released histogram (PNG).

    Uses matplotlib's object API (no pyplot global state), so it may run off the main thread.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pairs = release["histogram"]["pairs"]
    counts = np.repeat([r for r, _ in pairs], [c for _, c in pairs]) if pairs else np.zeros(0)
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if len(counts):
        ax.loglog(np.arange(1, len(counts) + 1), counts, drawstyle="steps-post")
    ax.set_xlabel("rank")
    ax.set_ylabel("count")
    n_text = release["n"] if release["n"] is not None else release["n_in_histogram"]
    ax.set_title(f"window {release['window']}: n={n_text}, eps={release['epsilon']:g}, "
                 f"{release['model']}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


class ReleaseExists(FileExistsError):
    """A different release document already has this file name (another run wrote it)."""


def write_release(release: dict, outdir: str | os.PathLike, *, plot: bool = True) -> Path:
    """Write ``release-<window>.json`` and, unless ``plot=False``, its PNG plot
    (:func:`plot_release`) into ``outdir``.

    Never overwrites another release: the same document again (a re-publish after a crash) is a
    no-op; a different one under the same name raises :class:`ReleaseExists`.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"release-{release['window']}.json"
    data = json.dumps(release, indent=1, allow_nan=False).encode() + b"\n"
    if not _create_once(path, data):
        if path.read_bytes() != data:
            raise ReleaseExists(errno.EEXIST, "a different release is already in this file "
                                "(another run or state directory wrote it); publish to a new "
                                "release directory or release name", str(path))
        if path.with_suffix(".png").exists():
            return path
    if plot:
        plot_release(release, outdir)
    return path


def _create_once(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically unless ``path`` exists (False then): temp file,
    fsync, hard link to the final name (which fails rather than replaces)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        Path(tmp).unlink(missing_ok=True)


def plot_release(release: dict, outdir: str | os.PathLike) -> Path:
    """The PNG rank-frequency plot ``release-<window>.png`` next to the release JSON."""
    path = Path(outdir) / f"release-{release['window']}.png"
    plot_rank_frequency(release, path)
    return path
