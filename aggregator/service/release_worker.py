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
GIL for seconds (intake stalls of 3-5 s, issue 53). A window's state of
:data:`HOUSE_MIN_SIZE` counters or more is drawn into a block of its own before the window
opens (:meth:`ReleaseWorker.house`, called beside the loop by :mod:`.next_state`), so at the
close :meth:`ReleaseWorker.submit` sends only the state without its counters plus the block's
name: no copy in the loop. A state that is not housed (the first window after a start, a
restored one) is copied into a fresh block at the close (one memcpy). The worker maps the block
and copies the counters out. A block holds a window's live, then closed, state: pan-private
memory, which section 16 of docs/privacy.md already covers; it is unlinked once the release is
collected or abandoned, when a housed state is dropped unused, and by the pool's resource
tracker if the service is killed.

Room. Blocks live in ``/dev/shm``, a tmpfs that containers often cap (64 MiB by default in
Docker and Kubernetes): a page touched past the cap kills the process with SIGBUS. So a block's
pages are reserved when it is made (``posix_fallocate``: a clear ENOSPC instead), and a state
with no room goes through the pool's pipe as before, with one WARNING naming the fix
(deploy/kubernetes/deployment.yaml mounts a larger ``/dev/shm``).

Test hook: ``slow_point("release")`` (state_store/failpoints.py): with ``PANAGG_TESTING=1``,
``PANAGG_TEST_RELEASE_DELAY_S`` makes every release (and every merge of a group's leader) take
that much longer (a slow release on a small domain).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import shared_memory

import numpy as np

from state_store.failpoints import slow_point

from ..release import make_release

__all__ = ["ReleaseWorker", "compute_release"]

log = logging.getLogger("panagg.service")


def compute_release(
    state,
    *,
    model: str,
    loss: str,
    window: int,
    rng,
    error_bar_reps: int,
    method: str | None,
    keep_view: bool = False,
):
    """The release of ``state`` (in a worker process): the document, and when it started and
    ended there (for the in-process overlap and latency figures; never in the document).
    With ``keep_view`` (window.rollups) a fourth item: ``(counts, layers)``, the release-layered
    counters the document was computed from, for the rollups to add up (the same draw: a
    second draw would be a second view of the window)."""

    started = time.time()
    slow_point("release")
    view: list | None = [] if keep_view else None
    doc = make_release(
        state,
        model=model,
        loss=loss,
        window=window,
        rng=rng,
        error_bar_reps=error_bar_reps,
        method=method,
        view=view,
    )
    if keep_view:
        return doc, started, time.time(), view[0]
    return doc, started, time.time()


#: states of this many counters or more are housed in a block of their own ahead of the close
#: (below it the copy at the close is shorter than a thread's start)
HOUSE_MIN_SIZE = 100_000


class NoRoom(OSError):
    """``/dev/shm`` cannot hold another block of the asked size."""


def _new_block(nbytes: int) -> shared_memory.SharedMemory:
    """A fresh shared block of ``nbytes`` whose pages are reserved now (:class:`NoRoom` if the
    tmpfs is full: touching an unreserved page past its cap would be a SIGBUS)."""
    block = shared_memory.SharedMemory(create=True, size=max(1, int(nbytes)))
    try:
        fd = getattr(block, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, max(1, int(nbytes)))
    except OSError as exc:
        _drop(block)
        raise NoRoom(exc.errno, f"/dev/shm has no room for {nbytes / 2**20:.0f} MiB") from None
    return block


def _drop(block) -> None:
    """Unmap (when no array still views it) and unlink ``block``."""
    try:
        block.close()
    except BufferError:  # an array still maps it: unmapped when that array goes
        pass
    try:
        block.unlink()
    except FileNotFoundError:
        pass


def _in_block(counts: np.ndarray):
    """``(block, array)``: a new shared block holding a copy of ``counts``, and the array over
    it (:class:`NoRoom` without room)."""
    block = _new_block(counts.nbytes)
    housed = np.ndarray(counts.shape, counts.dtype, buffer=block.buf)
    housed[:] = counts
    return block, housed


def _key(counts: np.ndarray) -> tuple[int, int]:
    """Where ``counts`` live (address, bytes): how a housed state's block is found again."""
    return counts.__array_interface__["data"][0], counts.nbytes


def _shelve(state):
    """``(shell, block)``: a copy of ``state`` without its counters, and a new shared-memory
    block holding them (the caller unlinks it)."""
    shell, counts = state.split_counters()
    block, _ = _in_block(counts)
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
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the pool's own end-of-parent handling remains
        pass
    if os.getppid() != parent:
        os._exit(0)


def _warm() -> bool:
    """A first task for each worker, before the first window closes: importing this module
    (its ``make_release``) has loaded what a release needs (~0.7 s of imports)."""
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
        self._pool = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_die_with_parent,
            initargs=(os.getpid(),),
        )
        self._pool.submit(_warm)
        self._blocks: set = set()  # shared blocks handed over and not yet unlinked
        self._housed: dict = {}  # (address, bytes) of a housed state's counters -> its block
        self._blocks_lock = threading.Lock()
        self._warned_room = False

    def house(self, state):
        """``state`` with its counters moved into a shared block of their own (module
        docstring): its close then hands over the block's name, no copy. Returns ``state``
        unchanged below :data:`HOUSE_MIN_SIZE` counters or when ``/dev/shm`` has no room.
        Thread-safe (called from the thread that draws the next window's state)."""
        counts = state.counts
        if counts.size < HOUSE_MIN_SIZE:
            return state
        try:
            block, housed = _in_block(counts)
        except NoRoom as exc:
            self._no_room(exc)
            return state
        state.with_counters(housed)
        key = _key(housed)
        with self._blocks_lock:
            self._housed[key] = block
        # dropped unused (a draw for another window, a stop): the block goes with the state
        weakref.finalize(state, self._unhouse, key, block)
        return state

    def _unhouse(self, key, block=None) -> None:
        """Unlink the housed block at ``key`` (only if it is still ``block``: an address can
        be mapped again by a later block once this one was handed over and freed)."""
        with self._blocks_lock:
            if block is None:
                block = self._housed.get(key)
            if block is None or self._housed.get(key) is not block:
                return
            del self._housed[key]
        _drop(block)

    def _no_room(self, exc: OSError) -> None:
        if not self._warned_room:
            self._warned_room = True
            log.warning(
                "%s: closed windows go to the release worker through its pipe (slower, "
                "it may stall intake at the close); give the process a larger /dev/shm "
                "(about 3 x 8 bytes x state.domain_size per aggregation; "
                "deploy/kubernetes/deployment.yaml mounts one)",
                exc.strerror or exc,
            )

    def submit(self, state, **kwargs) -> Future:
        """The release of the closed ``state``, computed in the pool (module docstring: the
        counters go through a shared-memory block, the state's own when it is housed)."""
        shell, counts = state.split_counters()
        key = _key(counts)
        with self._blocks_lock:
            block = self._housed.pop(key, None)
        if block is not None:  # housed: the block changes hands, nothing is copied
            where = (block.name, counts.shape, counts.dtype.str)
        else:
            try:
                shell, where, block = _shelve(state)
            except NoRoom as exc:
                self._no_room(exc)
                return self._pool.submit(compute_release, state, **kwargs)
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
        _drop(block)

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
        for key in list(self._housed):  # housed states never closed
            self._unhouse(key)
