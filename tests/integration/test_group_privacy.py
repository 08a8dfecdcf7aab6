"""The intruder audit of a whole views group on a real broker (docs/privacy.md section 20a).

Two real members (``scale.exchange = "views"``) count a two-partition topic; an intruder reads
one member's memory and state directory inside a window, every view of that window from the
summaries topic, and the leader's release input (tests/group_audit.py builds the streams and
reads the looks). The likelihood-ratio family (tests/lr_audit.py, with one chain per member and
the release as their sum) must read at or below 1.05 eps at eps 1 with the replaced event on the
intruded member's partition or on the other's, before or after the intrusion; the same path must
flag views written without their layer and noise 25 % weaker than claimed.
"""

from __future__ import annotations

import pytest

from tests.group_audit import group_scenarios
from tests.lr_audit import lr_epsilon

TRIALS = 40_000  # trials per window: half on each member's partition
CYCLES = 2  # windows per (stream, gap): 2 x 20,000 = 40,000 runs per stream per audit


@pytest.mark.parametrize("workers", [1, 0])  # the leader's merge in the release worker / loop
def test_an_intruder_reading_a_member_and_every_view_gets_an_eps_dp_view(
    kafka_broker, tmp_path, workers
):
    """``workers`` 1 is release.workers' default: the leader's merge runs in a spawned worker
    process (the input captured as the leader hands it over); 0 runs it in the loop (a smaller
    run: one window per stream and gap)."""
    cycles = CYCLES if workers else 1
    readings = {}
    for (kind, gap), sc in group_scenarios(
        kafka_broker, tmp_path, TRIALS, cycles, workers=workers
    ).items():
        r = lr_epsilon(*sc)
        readings[kind, gap] = r
        assert r.eps <= 1.05, (kind, gap, r)
    print("\n" + "\n".join(f"{k}: {r.eps:.3f} at {r.where}" for k, r in readings.items()))
    if workers:
        # not vacuous: one layer protects the event where the intrusion closes its block
        assert readings["own", 1].eps >= 0.75 and readings["own", 2].eps >= 0.75, readings


def test_views_written_without_their_layer_are_flagged(kafka_broker, tmp_path):
    """The negative control: memory and view then differ by the exact increments."""
    sc = group_scenarios(kafka_broker, tmp_path, 20_000, 1, gaps=(1,), unlayered=True)
    r = lr_epsilon(*sc["own", 1])
    print(f"\nunlayered views: {r.eps:.3f} at {r.where}")
    assert r.eps > 5.0, r  # (10,000 runs per stream show at most about 6.2)


def test_noise_25_percent_weaker_than_claimed_is_flagged(kafka_broker, tmp_path):
    """The group's states and views drawn for eps 1.25, audited as eps 1."""
    # (3 windows per stream: 60,000 runs; 40,000 read 1.14 once, the truth is 1.25)
    sc = group_scenarios(kafka_broker, tmp_path, TRIALS, 3, gaps=(2,), epsilon=1.25)
    r = lr_epsilon(*sc["own", 2])
    print(f"\nnoise for eps 1.25 claimed as 1: {r.eps:.3f} at {r.where}")
    assert r.eps > 1.1, r
