"""The budget of one aggregation: its privacy ledger, and the gate that asks it first.

Every release spends budget, and the privacy ledger (``checkpoint.dir/ledger.jsonl``,
:mod:`..ledger`) is where it is spent: per window, per source position (``budget_per_event``)
and in total. The release gate (:mod:`..release_gate`) asks the ledger about the source
positions a release covers *before* any release noise is drawn, so a refused release costs
nothing and leaks nothing. Under ``state.privacy_unit = user`` any user may be in every window:
the ledger then also bounds each user's sum over the windows (:class:`..user_budget.UserBudget`,
attached to the gate). A ledger that cannot be read refuses the start with its one line
(:class:`..errors.ServiceError`), before anything is written.

Durable writes: none here (the ledger is read; its entries are written by the stages that
decide them).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ServiceError
from ..identity import identity_of
from ..ledger import Ledger, LedgerError
from ..metrics import Metrics
from ..release_gate import ReleaseGate
from ..settings import Config
from ..user_budget import UserBudget

__all__ = ["open_budget"]


def open_budget(
    cfg: Config, directory: Path, metrics: Metrics, *, user: bool
) -> tuple[Ledger, ReleaseGate]:
    """The ledger in ``directory`` with ``cfg``'s budgets, and the release gate over it (with
    the per-user budget when ``user``)."""
    try:
        ledger = Ledger(
            directory / "ledger.jsonl",
            budget_per_window=cfg.budget_per_window,
            budget_total=cfg.ledger.budget_total or None,
            budget_per_event=cfg.budget_per_event,
        )
    except LedgerError as exc:
        raise ServiceError(str(exc)) from None
    epsilon, aggregation = float(cfg.state.epsilon), cfg.aggregation
    gate = ReleaseGate(
        ledger,
        metrics,
        epsilon=epsilon,
        model=cfg.state.model,
        stream=identity_of(cfg)["stream"],
        aggregation=aggregation.name if aggregation else "",
        directory=directory,
        parallel=dict(aggregation.parallel) if aggregation and aggregation.parallel else None,
    )
    if user:  # any user may be in every window: the ledger bounds their sum
        gate.user_budget = UserBudget(ledger, budget=cfg.ledger.budget_per_user, epsilon=epsilon)
    return ledger, gate
