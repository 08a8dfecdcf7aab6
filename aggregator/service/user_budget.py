"""What one user has been charged: the per-user budget of ``state.privacy_unit = "user"``
(``ledger.budget_per_user``).

The ledger's per-event check (:mod:`.charges`) sums the releases that cover one source
position. That bounds an event, not a user: the windows of a lineage cover disjoint positions,
so each passes, while a user who logs in during every window is in every window's release. The
ledger does not know who is in which window (it must not), so it bounds the worst case, every
user in every window. A user's charge is then the sum, over the whole ledger (every lineage: a
fresh start gives no user a new budget), of what each user-level release charged every user
(``user_epsilon`` on its entry, :meth:`UserBudget.charge_of`):

* its window's eps (``state.epsilon``; 0 for a window without events, whose bits no user
  touched);
* plus ``state.epsilon`` for each ``restart`` entry of that window: the replayed window's bits
  were in memory before the stop and are drawn afresh after it, so an intruder who read memory
  before and after sees two states of one released window (docs/privacy.md section 23: one
  more eps_s, rounded up here to one window's eps). A replayed window is charged 2 eps.

To that the gate adds the user-level charges of this deployment's other levels
(``window.rollups`` under the user unit: each span a density state with a ledger of its own in a
sibling directory, read as the per-event check reads them: ``levels`` of :meth:`UserBudget.check`)
and the user-level releases other deployments on the same stream wrote to the
budget registry (the same Kafka topic or one ``--same-records-as`` names; a file of the same
content): :meth:`.release_gate.ReleaseGate.user_charges_elsewhere`. Event-level releases carry no
``user_epsilon``: they protect an event, and a user with g events in one is protected at g x eps
there, which no per-user sum can bound.

A window that is never released (refused, or lost at a fresh start) charges nothing, as at the
event level: the one intrusion the model allows (section 23) reads its bits at eps_s, on top of
the ledgered sum.

The gate asks :meth:`UserBudget.check` before any release noise is drawn and refuses the window
when the sum with it would pass the budget; an endless source pauses its intake once the budget
cannot pay for one more window (:meth:`UserBudget.exhausted`).

>>> from types import SimpleNamespace
>>> ledger = SimpleNamespace(entries=[
...     {"kind": "release", "window_uid": "a", "user_epsilon": 1.0},
...     {"kind": "restart", "window_uid": "b"},     # window b was replayed after a stop
...     {"kind": "release", "window_uid": "x", "epsilon_spent": 1.0}])  # (event level)
>>> budget = UserBudget(ledger, budget=3.0, epsilon=1.0)
>>> budget.spent(), budget.charge_of("b", 1.0), budget.windows_left()
(1.0, 2.0, 2)
>>> budget.check(7, budget.charge_of("b", 1.0))
>>> import textwrap
>>> try:
...     budget.check(8, 3.0)
... except BudgetExceeded as exc:
...     print(textwrap.fill(str(exc).split(";")[0], 88))
release of window 8 refused: the per-user budget is spent (a user present in every
window would be charged 4 eps > ledger.budget_per_user = 3: 1 user-level release of this
ledger holds 1, this window 3)
"""

from __future__ import annotations

import math

from .ledger import BudgetExceeded

__all__ = ["USER_EPSILON", "USER_STREAM", "user_spent", "windows_left", "UserBudget"]

#: the field of a user-level release's ledger entry (and registry charge): what it charged every
#: user, restarts of its window included
USER_EPSILON = "user_epsilon"
#: the stream that charge is on (the registry matches other deployments' charges by it):
#: ``kafka:<topic>``, or a file's content identity
USER_STREAM = "user_stream"

#: float slack of the budget comparisons (eps are sums of decimals)
_SLACK = 1e-12


def user_spent(entries) -> float:
    """What every user may have been charged by ``entries`` (ledger entries or registry
    charges): the sum of their :data:`USER_EPSILON`."""
    return float(sum(float(e.get(USER_EPSILON) or 0.0) for e in entries))


def windows_left(budget: float, spent: float, epsilon: float) -> int:
    """How many more windows of ``epsilon`` a per-user ``budget`` pays for after ``spent``.

    >>> windows_left(3.0, 1.0, 1.0), windows_left(3.0, 3.5, 1.0), windows_left(0.3, 0.0, 0.1)
    (2, 0, 3)
    """
    return max(0, math.floor((budget - spent) / epsilon + 1e-9))


def _releases(entries) -> str:
    """ "3 user-level releases of this ledger hold": the entries the sum is over."""
    n = sum(1 for e in entries if float(e.get(USER_EPSILON) or 0.0) > 0)
    one = n == 1
    return f"{n} user-level release{'' if one else 's'} of this ledger hold{'s' if one else ''}"


class UserBudget:
    """``ledger.budget_per_user`` over one ledger's entries.

    Parameters
    ----------
    ledger
        The privacy ledger (its ``entries`` are read at each question).
    budget
        ``ledger.budget_per_user``: the eps one user may be charged in all.
    epsilon
        One window's eps (``state.epsilon``): what a release, and each restart of its window,
        charges.
    """

    def __init__(self, ledger, *, budget: float, epsilon: float):
        self.ledger, self.budget, self.epsilon = ledger, float(budget), float(epsilon)
        #: other deployments' user charges on this stream, as read at the last check
        self.elsewhere = 0.0
        #: the user charges of this deployment's other levels (``window.rollups``: each span a
        #: state of its own, with a ledger of its own beside this one), as read at the last check
        self.levels = 0.0
        self._cached: tuple[int, float] = (-1, 0.0)

    def own(self) -> float:
        """What this ledger has charged every user (recounted when it grew)."""
        entries = self.ledger.entries
        if self._cached[0] != len(entries):  # (the loop asks every poll while paused)
            self._cached = (len(entries), user_spent(entries))
        return self._cached[1]

    def spent(self) -> float:
        """This ledger's user charges, its sibling levels' and the registry's of other
        deployments (as last read)."""
        return self.own() + self.levels + self.elsewhere

    def windows_left(self) -> int:
        """How many more windows the budget pays for (a replayed one costs two)."""
        return windows_left(self.budget, self.spent(), self.epsilon)

    def charge_of(self, window_uid: str, charge: float) -> float:
        """What releasing window ``window_uid`` at ``charge`` charges every user: ``charge``,
        plus one window's eps for each restart that replayed it (0 for an empty window)."""
        if charge <= 0:
            return 0.0
        restarts = sum(
            1
            for e in self.ledger.entries
            if e["kind"] == "restart" and e.get("window_uid") == window_uid
        )
        return float(charge) + restarts * self.epsilon

    def fields(self, user_charge: float, stream: str) -> dict:
        """What a user-level release's entry records: :data:`USER_EPSILON` and
        :data:`USER_STREAM`."""
        return {USER_EPSILON: float(user_charge), USER_STREAM: stream}

    def check(
        self, window, user_charge: float, elsewhere=(), pending: float = 0.0, levels=()
    ) -> None:
        """BudgetExceeded (one line naming the fix) when a release that charges every user
        ``user_charge`` (:meth:`charge_of`) would bring a user's worst-case charge over the
        budget. ``elsewhere``: the registry's user charges of other deployments on this stream;
        ``pending``: releases granted, not yet ledgered; ``levels``: the entries of this
        deployment's other levels' ledgers (``window.rollups``)."""
        self.elsewhere = user_spent(elsewhere)
        self.levels = user_spent(levels)
        after = self.spent() + pending + user_charge
        if after <= self.budget * (1 + _SLACK):
            return
        theirs = f", the other rollup levels {self.levels:g}" if self.levels else ""
        theirs += (
            f", other deployments on this stream {self.elsewhere:g} (the budget registry)"
            if self.elsewhere
            else ""
        )
        raise BudgetExceeded(
            f"release of window {window} refused: the per-user budget is spent (a user present "
            f"in every window would be charged {after:g} eps > ledger.budget_per_user = "
            f"{self.budget:g}: {_releases(self.ledger.entries)} {self.own():g}{theirs}, this "
            f"window {user_charge:g}); nothing of the window is published and no noise was "
            "drawn. Fix: raise ledger.budget_per_user (a policy change: restart with "
            "--accept-change, which records it in the ledger) or stop the service "
            "(docs/privacy_unit.md)"
        )

    def exhausted(self) -> str | None:
        """The line to pause an endless source's intake with, once the budget cannot pay for
        one more window (None while it can): counting on would only hold users' bits in memory
        for windows that are refused."""
        left = self.budget - self.spent()
        if left >= self.epsilon * (1 - _SLACK):
            return None
        theirs = (
            f" ({self.elsewhere:g} of it by other deployments on this stream, the budget registry)"
            if self.elsewhere
            else ""
        )
        return (
            f"per-user budget spent: {self.spent():g}{theirs} of ledger.budget_per_user="
            f"{self.budget:g} leaves {max(left, 0.0):g} < {self.epsilon:g} for a window, so "
            "intake is paused (no window is counted only to be refused). Fix: raise "
            "ledger.budget_per_user (a policy change, recorded in the ledger with "
            "--accept-change) or stop the service"
        )

    def document(self, user_charge: float) -> dict:
        """What a user-level release says of the budget once it is ledgered: the budget, what
        every user has been charged with this release, the windows left."""
        spent = self.spent() + user_charge
        return {
            "budget_per_user": self.budget,
            "spent": spent,
            "this_release": user_charge,
            "windows_left": windows_left(self.budget, spent, self.epsilon),
        }

    def line(self) -> str:
        """The start's line: spent, budget and the windows left."""
        theirs = f", {self.levels:g} by the other rollup levels" if self.levels else ""
        theirs += (
            f", {self.elsewhere:g} by other deployments on this stream" if self.elsewhere else ""
        )
        return (
            f"per-user budget: {self.spent():g} of ledger.budget_per_user={self.budget:g} "
            f"eps charged to every user ({_releases(self.ledger.entries)} "
            f"{self.own():g}{theirs}): {self.windows_left()} more window(s), each restart "
            "adding one to the window it replays"
        )
