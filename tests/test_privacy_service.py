"""Intruder audits of the real service: memory, every file under the state directory, backups
and the release, read together (docs/privacy.md, "Every copy of the state counts").

The mechanism audited is the real :class:`aggregator.service.Aggregator` with production noise
(OS entropy, no seed): real decoding, counting, windows, checkpoints, snapshots and release layer.
To get many independent runs from few service runs, one run carries T independent *trials*: trial
j owns counters 3j, 3j+1, 3j+2 of a direct-mode domain of D = 3T, and its events are [0, 0, r]
(r = 1 in the stream x, r = 2 in its neighbour x'), plus one more 0 to end the window. Counters
are independent in the state, so the T blocks of three are T independent runs of the same
mechanism on a three-counter domain, and :func:`tests.test_privacy.empirical_epsilon` (the
Clopper-Pearson audit of the mechanism tests) applies to them unchanged.

The intruder reads, at an instant between two batches (each gap of the stream in turn):

* the live counters (the process memory), and
* every file under the state directory (checkpoints, temp files), keeping any counters in them;

and the release's input (the counters plus the release layer, captured where the estimator
receives them: the release itself is post-processing of it). Backups are copies of the state
directory taken at several instants. The same audit must flag: the design before this rewrite
(a checkpoint holding the live counters with the live noise), and a service whose noise is 25 %
weaker than the epsilon it claims.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest

import aggregator.release as release_mod
from aggregator.service import Aggregator
from aggregator.service.config import load_config
from aggregator.service.release_worker import ReleaseWorker
from tests.scripted_source import ScriptedSource
from tests.helpers.privacy import counters_in_files, empirical_epsilon

T = 40_000  # trials per service run
RUNS = 4  # service runs per neighbouring stream (N = T * RUNS runs of the mechanism)


def _segments(r: int) -> list[list[bytes]]:
    base = 3 * np.arange(T)
    pack = msgpack.packb
    return [
        [pack({"item": int(i)}) for i in np.repeat(base, 2)],  # events 0, 0 of every trial
        [pack({"item": int(i)}) for i in base + r],  # the replaced event
        [pack({"item": int(i)}) for i in base],
    ]  # one more: the window ends


@contextmanager
def _capture_worker_views(into: list):
    """While active, every release submitted to a :class:`ReleaseWorker` is computed with
    ``keep_view`` (the worker process returns the exact release-layered counters it estimated
    from, as for a rollup) and those counters are appended to ``into``; the loop receives the
    result it asked for (without the view unless it asked for it). The release itself, its
    noise and its process are the production ones."""
    original = ReleaseWorker.submit

    def submit(self, state, **kwargs):
        wanted = kwargs.get("keep_view", False)
        kwargs["keep_view"] = True
        inner = original(self, state, **kwargs)
        outer: Future = Future()

        def done(f):
            try:
                result = f.result()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop as it was
                outer.set_exception(exc)
                return
            into.append(np.array(result[3][0], copy=True))
            outer.set_result(result if wanted else result[:3])

        inner.add_done_callback(done)
        return outer

    ReleaseWorker.submit = submit
    try:
        yield
    finally:
        ReleaseWorker.submit = original


def _service_views(
    tmp_path: Path, r: int, gap: int, *, cls=Aggregator, epsilon=1.0, backups=(), workers=0, **sets
) -> list[np.ndarray]:
    """One run of the service on stream r: the intruder's views as (T, 3) arrays, in time
    order: the files' counters and the memory at ``gap`` (or the state directory's copies taken
    at ``backups``), then the release's input.

    ``workers`` 0: the release in the loop, its input captured where the estimator receives it.
    ``workers`` 1 (the default of ``release.workers``): the release in a spawned worker process;
    its input is the release-layered view the worker returns (``keep_view``, what a rollup
    receives), captured as the loop collects the release (:func:`_capture_worker_views`)."""
    state_dir = tmp_path / f"state-{r}-{gap}-w{workers}"
    shutil.rmtree(state_dir, ignore_errors=True)
    shutil.rmtree(f"{state_dir}-releases", ignore_errors=True)  # one run's, never another's
    overrides = [
        f"checkpoint.dir={state_dir}",
        f"release.dir={state_dir}-releases",
        "source.kind=generator",
        f"state.domain_size={3 * T}",
        "window.kind=count",
        f"window.size={4 * T}",
        f"state.epsilon={epsilon}",
        "metrics.port=-1",
        "release.on_exhausted=false",
        # the audit captures the release's input; the bootstrap intervals computed
        # after it are post-processing and only cost time here
        "release.error_bar_reps=0",
        # the release in the loop, where the audit captures its input in-process; the
        # release worker computes the same function of the same handed-over state in
        # another process (docs/privacy.md section 16, "Releases beside the loop")
        f"release.workers={workers}",
    ] + [f"{k}={v}" for k, v in sets.items()]
    if workers:  # the worker runs the estimate (post-processing of the view): the fast one
        overrides.append("release.estimator=threshold")
    cfg = load_config(None, overrides, env={})
    looks: list[list[np.ndarray]] = []

    def intrude():
        looks.append(counters_in_files(state_dir) + [agg.task.state.counts.copy()])

    def backup(k):
        copy = tmp_path / f"backup-{r}-{k}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(state_dir, copy)
        looks.append(counters_in_files(copy))

    at = {k: (lambda k=k: backup(k)) for k in backups} or {gap: intrude}
    agg = cls(cfg, ScriptedSource(_segments(r), at))
    release_input = []
    if workers:
        with _capture_worker_views(release_input):
            agg.run()
    else:
        original = release_mod.anonymized_histogram

        def capture(counts, p, **kw):  # the release's view; its estimate is post-processing
            release_input.append(np.array(counts, copy=True))
            return np.zeros(0, dtype=np.int64)

        release_mod.anonymized_histogram = capture
        try:
            agg.run()
        finally:
            release_mod.anonymized_histogram = original
    assert len(release_input) == 1
    views = [v for look in looks for v in look] + release_input
    return [v.reshape(T, 3) for v in views]


def _audit(tmp_path, gap, **kw):
    views = {r: [_service_views(tmp_path, r, gap, **kw) for _ in range(RUNS)] for r in (1, 2)}
    shapes = {r: {len(v) for v in runs} for r, runs in views.items()}
    assert shapes[1] == shapes[2] and len(shapes[1]) == 1, shapes
    stacked = {
        r: [np.concatenate([run[i] for run in runs]) for i in range(len(runs[0]))]
        for r, runs in views.items()
    }
    return empirical_epsilon(stacked[1], stacked[2]), len(stacked[1])


@pytest.mark.parametrize("gap", [1, 2, 3])  # after the 0,0 events / the replaced one / the last
@pytest.mark.parametrize("workers", [0, 1])  # the release in the loop / in the default worker
def test_memory_files_and_release_are_jointly_private(tmp_path, gap, workers):
    """``workers`` 1 (release.workers' default): the release is drawn in a spawned worker
    process from the handed-over state; its input is the view the worker returns."""
    (eps_hat, event), n_views = _audit(tmp_path, gap, workers=workers)
    assert n_views == 2  # memory and the release: no counters of the open window in any file
    assert eps_hat <= 1.0, event
    if gap < 3:  # one layer protects the replaced event in the joint view: the audit sees ~eps
        assert eps_hat >= 0.8, event  # (after the window, the release alone has two layers)


@pytest.mark.parametrize("gap", [1, 2, 3])
def test_with_layered_snapshots_every_look_at_any_instant_is_private(tmp_path, gap):
    (eps_hat, event), n_views = _audit(tmp_path, gap, **{"checkpoint.snapshots_per_window": 2})
    assert n_views == (3 if gap < 3 else 2)  # a layered snapshot on disk inside the window
    assert eps_hat <= 1.0, event


def test_backups_of_the_state_dir_at_two_instants_and_the_release(tmp_path):
    """Two copies of the state directory from one window (nightly volume snapshots), each
    holding a layered snapshot, plus the release."""
    (eps_hat, event), n_views = _audit(
        tmp_path, 0, backups=(1, 2), **{"checkpoint.snapshots_per_window": 2}
    )
    assert n_views == 3  # one snapshot in each copy, then the release
    assert eps_hat <= 1.0, event


class _OldCheckpoints(Aggregator):
    """The design before this rewrite: a checkpoint holds the live counters themselves."""

    def commit(self, task, *, snapshot=False, tag=()):
        record = task.record(task.state.serialize() if snapshot else None)
        self.checkpoints.save(task, record)
        return record.state


def test_the_audit_flags_checkpoints_that_share_the_live_noise(tmp_path):
    (eps_hat, event), _ = _audit(
        tmp_path, 2, cls=_OldCheckpoints, **{"checkpoint.snapshots_per_window": 1}
    )
    assert eps_hat > 3.0, event  # memory minus checkpoint is the exact replaced event


def test_the_audit_flags_a_25_percent_weaker_noise(tmp_path):
    """Noise for eps = 1.25 while eps = 1 is claimed: the audit must see it."""
    (eps_hat, event), _ = _audit(tmp_path, 2, epsilon=1.25)
    assert eps_hat > 1.0, event
