"""The release worker: estimates and error bars beside the consume loop, never in it.

At a window's close the loop checks the ledger (before any release noise), hands the closed
window's noisy state to :class:`ReleaseWorker` and goes straight on counting the next window.
The worker is a pool of processes (``release.workers``), so numpy/EM work does not hold the
loop's GIL (several aggregations and scale-out still release in the loop). The loop collects the
results in window order: the document is ledgered with its source ranges, checkpointed and
published there (aggregator.service.process).

What the worker holds. The closed window's counters (the state as it was at the close) and,
once drawn, its release layer: memory only, never a file. After a crash the checkpoint lists
the closed, unreleased windows with where each starts and ends in the source, and they are
replayed under fresh noise (docs/privacy.md section 16, "Releases beside the loop").

The hand-off. The closed counters reach the worker through a shared-memory block, not through
the pool's pipe: pickling 1e7 counters (80 MB) in the executor's feeder thread held the loop's
GIL for seconds (intake stalls of 3-5 s, issue 53). :meth:`ReleaseWorker.submit` copies the
counters into a fresh block (one memcpy), sends the state without them plus the block's name,
and the worker maps and copies them back. The block holds the closed state, which the release
view already covers (docs/privacy.md, section 16); it is unlinked once the release is collected
or abandoned, and by the pool's resource tracker if the service is killed.

Test hook: ``slow_point("release")`` (state_store/failpoints.py): with ``PANAGG_TESTING=1``,
``PANAGG_TEST_RELEASE_DELAY_S`` makes every release (and every merge of a group's leader) take
that much longer (a slow release on a small domain).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import shared_memory

import numpy as np

from state_store.failpoints import slow_point

__all__ = ["ReleaseWorker", "compute_release"]

log = logging.getLogger("panagg.service")


def compute_release(state, *, model: str, loss: str, window: int, rng, error_bar_reps: int,
                    method: str | None, keep_view: bool = False):
    """The release of ``state`` (in a worker process): the document, and when it started and
    ended there (for the in-process overlap and latency figures; never in the document).
    With ``keep_view`` (window.rollups) a fourth item: ``(counts, layers)``, the release-layered
    counters the document was computed from, for the rollups to add up (the same draw: a
    second draw would be a second view of the window)."""
    from ..release import make_release

    started = time.time()
    slow_point("release")
    view: list | None = [] if keep_view else None
    doc = make_release(state, model=model, loss=loss, window=window, rng=rng,
                       error_bar_reps=error_bar_reps, method=method, view=view)
    if keep_view:
        return doc, started, time.time(), view[0]
    return doc, started, time.time()


def _shelve(state):
    """``(shell, block)``: a copy of ``state`` without its counters, and a new shared-memory
    block holding them (the caller unlinks it)."""
    shell, counts = state.split_counters()
    block = shared_memory.SharedMemory(create=True, size=max(1, counts.nbytes))
    np.ndarray(counts.shape, counts.dtype, buffer=block.buf)[:] = counts
    return shell, (block.name, counts.shape, counts.dtype.str), block


def compute_release_shared(shell, where, **kwargs):
    """:func:`compute_release` of a state whose counters are in the shared block ``where``
    (``(name, shape, dtype)``): mapped, copied into this process, unmapped."""
    name, shape, dtype = where
    # (a spawned worker shares the parent's resource tracker: the block stays registered there,
    # so a parent killed -9 still has it unlinked)
    block = shared_memory.SharedMemory(name=name)
    try:
        shell.with_counters(np.array(np.ndarray(shape, np.dtype(dtype), buffer=block.buf)))
    finally:
        block.close()
    return compute_release(shell, **kwargs)


def _die_with_parent(parent: int) -> None:
    """A worker never outlives the loop (a kill -9 of the service): Linux's parent-death
    signal, and a check that the parent is still the one that started it."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the pool's own end-of-parent handling remains
        pass
    if os.getppid() != parent:
        os._exit(0)


def _warm() -> bool:
    """Import what a release needs before the first window closes (scipy.stats alone ~0.6 s)."""
    from .. import intervals, release  # noqa: F401
    import scipy.stats  # noqa: F401
    return True


class ReleaseWorker:
    """A pool of ``workers`` processes computing releases.

    Parameters
    ----------
    workers
        Processes in the pool (``release.workers``). Each takes up to one core while a release
        runs; on a 2-core machine 1 leaves the other core to the consume loop.
    """

    def __init__(self, workers: int):
        self.workers = int(workers)
        # spawn: a child that inherits nothing of the loop (no Kafka client threads, no state)
        self._pool = ProcessPoolExecutor(max_workers=self.workers,
                                         mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_die_with_parent,
                                         initargs=(os.getpid(),))
        self._pool.submit(_warm)
        self._blocks: set = set()  # shared blocks handed over and not yet unlinked
        self._blocks_lock = threading.Lock()

    def submit(self, state, **kwargs) -> Future:
        """The release of the closed ``state``, computed in the pool (module docstring: the
        counters go through a shared-memory block)."""
        shell, where, block = _shelve(state)
        with self._blocks_lock:
            self._blocks.add(block)
        try:
            future = self._pool.submit(compute_release_shared, shell, where, **kwargs)
        except BaseException:
            self._free(block)
            raise
        future.add_done_callback(lambda _f: self._free(block))
        return future

    def _free(self, block) -> None:
        with self._blocks_lock:
            if block not in self._blocks:
                return
            self._blocks.discard(block)
        block.close()
        try:
            block.unlink()
        except FileNotFoundError:
            pass

    def call(self, fn, *args, **kwargs) -> Future:
        """Run ``fn`` (a module-level function: it is pickled by name) in the pool: a group's
        merge, a rollup's release (:func:`aggregator.release.release_from_view`)."""
        return self._pool.submit(fn, *args, **kwargs)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop at once: releases not collected are replayed from the source at the next start.

        The workers are terminated and the pool's manager thread joined before returning: left
        running (``shutdown(wait=False)`` alone), it raced the interpreter's exit and CPython
        printed "Exception ignored ... Bad file descriptor" tracebacks at every member's stop."""
        pool = self._pool
        # shutdown() forgets both, so take them first
        procs = list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout_s)
        if manager is not None:
            manager.join(timeout_s)
        for block in list(self._blocks):  # releases abandoned by the stop
            self._free(block)
