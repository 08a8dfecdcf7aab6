"""Each window's fresh state, and the source of the service's noise.

A window opens with a fresh pan-private state: every counter a DLap draw independent of every
event (docs/privacy.md R1), so that memory read at any instant is eps-DP. What is drawn follows
the state's settings: the dense counters of a direct domain (``state.domain_size``), the
buckets of hashed items (:func:`..identity.choose_buckets_for`), or the density cells of
``state.privacy_unit = user`` (:mod:`..user_window`). With a release
worker the state's counters are moved into a shared block of their own
(:meth:`..release_worker.ReleaseWorker.house`), so that its close hands the worker a name,
not a copy. The draw runs beside the loop, one window ahead (:mod:`..next_state`): at 1e7
counters it takes seconds, which the loop would otherwise stall for.

Noise comes from the OS CSPRNG. Only under the tests' switch (``testing.noise_seed`` with
PANAGG_TESTING, settings.py) :meth:`FreshStates.rng` gives a generator seeded from the seed and
a tag (the window's number, a layer's purpose), so a test replays the same noise; the tag keeps
two draws from sharing a generator. Every stage that draws noise takes this ``rng``.

Durable writes: none (a fresh state lives in process memory only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from state_store.failpoints import under_tests

from ...state import PanPrivateHistogram
from ..identity import choose_buckets_for
from ..next_state import NextState
from ..user_window import is_user, new_user_state, user_cells
from ..window import WindowTask

if TYPE_CHECKING:
    from ..release_worker import ReleaseWorker

__all__ = ["FreshStates"]


class FreshStates:
    """Draws the fresh states of one aggregation's windows.

    Parameters
    ----------
    cfg
        The service's configuration (``state``, ``testing.noise_seed``); from it ``user``
        (a density state), ``direct`` (a dense domain) and ``size`` (counters, buckets or cells).
    worker
        ``worker()``: the release worker now (None: releases in the loop); asked at each draw,
        beside the loop, so a worker that goes meanwhile is not used.
    """

    def __init__(self, cfg, *, worker: Callable[[], ReleaseWorker | None]):
        st = cfg.state
        self.cfg, self.epsilon, self.worker = cfg, float(st.epsilon), worker
        self.user = is_user(cfg)
        self.direct = st.mode == "direct" and not self.user
        self.size = (
            user_cells(cfg)
            if self.user
            else int(st.domain_size)
            if self.direct
            else choose_buckets_for(cfg)
        )
        seed = cfg.testing.noise_seed
        self.seed = seed if seed >= 0 and under_tests() else None  # (test-only: settings.py)
        self.ahead = NextState(self.draw, size=self.size)

    def rng(self, *tag) -> np.random.Generator | None:
        """None (OS CSPRNG) in production; a deterministic generator only under PANAGG_TESTING."""
        if self.seed is None:
            return None
        return np.random.default_rng([self.seed, *[int(t) for t in tag]])

    def take(self, task: WindowTask, window_id: int) -> PanPrivateHistogram:
        """Window ``window_id``'s fresh state (drawn ahead, beside the loop)."""
        return self.ahead.take(window_id)

    def draw(self, window_id: int) -> PanPrivateHistogram:
        """Draw window ``window_id``'s state now (thread-safe: it touches nothing shared)."""
        if self.user:
            return new_user_state(self.cfg, self.rng(0, window_id))  # type: ignore[return-value]
        kwargs: dict[str, Any] = {"size": self.size} if self.direct else {"buckets": self.size}
        state = PanPrivateHistogram(self.epsilon, rng=self.rng(0, window_id), **kwargs)
        worker = self.worker()  # (this runs beside the loop: the worker may go meanwhile)
        if worker is not None:
            # its counters in a shared block of their own: the close hands over no copy
            state = worker.house(state)
        return state
