"""The user-level intruder audit of the running service: exact losses by number of events.

    python -m bench.service.user_privacy_audit           # the whole table (about 15 s)
    python -m bench.service.user_privacy_audit --smoke   # one scenario per row kind

The real Aggregator runs in this process under ``state.privacy_unit = "user"`` (eps 1,
``state.expected_users`` 2,000: 5,019 cells) on a login stream; an intruder reads the density
bits the service holds at one instant, every file under the state directory and the release
document. The loss between the stream with the victim's events and the stream where a stand-in
user has them (the service's replace-one neighbours) is computed exactly from the draws the
service made (tests/user_audit.py). Each row is the worst over the split of the victim's events
around the intrusion (none, half, all before it) and the other users sharing the victim's or the
stand-in's cell (none; before, after, both). Rows marked **control** must read above eps.
Exact figures: no sampling, so a re-run reads the same.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT, md_table, parser, provenance

if str(ROOT) not in sys.path:  # the audit is the tests' (tests/ is not a package on the path)
    sys.path.insert(0, str(ROOT))

from tests.user_audit import EPS, Scenario, doubled, user_level_loss  # noqa: E402

OTHERS = [("", ""), ("before", ""), ("after", ""), ("", "after"), ("both", "both")]


def _worst(tmp: Path, events: int, smoke: bool, **kw) -> tuple[float, str]:
    worst, at = -1.0, ""
    splits = [events // 2] if smoke else sorted({0, events // 2, events})
    for split in splits:
        for others in OTHERS[:1] if smoke else OTHERS:
            loss = user_level_loss(
                tmp / f"{events}-{split}-{'-'.join(others)}-{len(kw)}",
                Scenario(events, split, others),
                **kw,
            )
            if loss > worst:
                worst, at = (
                    loss,
                    (
                        f"{split} of {events} before the look, others in cells: "
                        f"{others[0] or '-'} / {others[1] or '-'}"
                    ),
                )
    return worst, at


def main() -> None:
    args = parser(__doc__, "one scenario per row").parse_args()
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for workers in (1, 0):
            for events in (1, 10, 10_000):
                loss, at = _worst(tmp / f"w{workers}", events, args.smoke, workers=workers)
                rows.append(
                    [
                        f"{events:,} event(s), release.workers = {workers}",
                        "<= 1.05 eps",
                        f"{loss:.4f}",
                        at,
                    ]
                )
            if args.smoke:
                break
        for events in (10,) if args.smoke else (1, 10, 10_000):
            loss = user_level_loss(tmp / f"r{events}", Scenario(events, events // 2 or 1, rollup=2))
            rows.append(
                [
                    f"{events:,} event(s) in a base window and its rollup span "
                    "(window.rollups, one look at both states)",
                    "<= 2 x 1.05 eps (charged 2 eps)",
                    f"{loss:.4f}",
                    f"{events // 2 or 1} of {events} before the look",
                ]
            )
        loss = user_level_loss(tmp / "dbl", Scenario(10, 5), thresholds=doubled)
        rows.append(
            [
                "**control**: bits drawn for 2 x the state's share",
                "> eps",
                f"{loss:.4f}",
                "5 of 10 before the look",
            ]
        )
        for events in (2,) if args.smoke else (2, 10_000):
            loss = user_level_loss(tmp / f"2w{events}", Scenario(events, events // 2, windows=2))
            rows.append(
                [
                    f"**control**: {events:,} events in two windows, a look inside each",
                    "~2 eps (charged 2 eps)",
                    f"{loss:.4f}",
                    "half in each window",
                ]
            )
        loss = user_level_loss(tmp / "2l", Scenario(10, 5), intrusions=(1, 2))
        rows.append(
            [
                "**control**: two looks at one window around the events",
                "unbounded",
                f"{loss:.4f}",
                "5 of 10 between the looks",
            ]
        )
    print(
        f"user-level intruder audit of the service at eps {EPS:g} (exact; "
        f"{time.perf_counter() - t0:.0f} s); {provenance()}"
    )
    for line in md_table(["scenario", "bound", "loss", "worst at"], rows):
        print(line)


if __name__ == "__main__":
    main()
