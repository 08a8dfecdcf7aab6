"""The full fault matrix of issue 46: every mode of tests/chaos/harness.py under every fault,
several seeds each, one real broker; prints (and with ``--doc`` writes) a table of cases,
faults injected, events produced / released / left in the open window, and violations of the
one invariant (tests/chaos/invariant.py).

    python -m bench.service.chaos --seeds 5 --doc docs/chaos.md
    python -m bench.service.chaos --modes count,several --faults kill9 --seeds 1   # a smoke run
    python -m bench.service.chaos --modes count --faults disk_full --seeds 1
    python -m bench.service.chaos --modes group_items2 --faults past_retention --seeds 1
    python -m bench.service.chaos --modes group2,group_items2 --faults source_retention --seeds 3

A fault that does not apply to a mode (disk_full to a group, past_retention to all but the
groups of 2-3 with time or count windows, the source_retention faults to event-time groups,
the faults not built for ``shuffle``), or a full disk where no filesystem can be mounted, is
skipped with its reason, never faked.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import parser
from tests.chaos.harness import FAULTS, MODES, Broker, run_case


def main(argv=None) -> int:
    ap = parser(__doc__, "--modes count --faults kill9 --seeds 1 --seconds 4 (its own broker)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated faults")
    ap.add_argument("--seeds", type=int, default=3, help="runs of each mode x fault")
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=16.0, help="production time per run")
    ap.add_argument(
        "--faults-per-run",
        type=int,
        default=2,
        help="kills or broker outages at random moments of each run",
    )
    ap.add_argument("--doc", help="write the table to this markdown file")
    ap.add_argument("--json", help="append each run's result to this JSON-lines file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.modes, args.faults, args.seeds, args.seconds = "count", "kill9", 1, 4.0
    modes, faults = args.modes.split(","), args.faults.split(",")
    unknown = [m for m in modes if m not in MODES] + [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown mode or fault: {', '.join(unknown)}")
    rows, t0 = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="panagg-chaos-") as tmp:
        broker = Broker(Path(tmp) / "kafka")
        broker.start()
        try:
            for mode in modes:
                for fault in faults:
                    for k in range(args.seeds):
                        seed = args.first_seed + k
                        res = run_case(
                            broker,
                            mode,
                            fault,
                            seed,
                            Path(tmp) / f"{mode}-{fault}-{seed}",
                            seconds=args.seconds,
                            faults=args.faults_per_run,
                        )
                        if res.skipped:
                            print(
                                f"{mode:15s} {fault:18s} seed {seed}: skipped ({res.skipped})",
                                flush=True,
                            )
                            continue
                        rows.append(res)
                        print(
                            f"{mode:15s} {fault:18s} seed {seed}: "
                            f"{'ok' if res.ok else 'VIOLATED'} produced {res.produced} "
                            f"released {sum(res.released.values())} faults {res.faults} "
                            f"({res.seconds:.0f} s)",
                            flush=True,
                        )
                        for v in res.violations[:5]:
                            print(f"    {v[:300]}", flush=True)
                        for note in res.notes:
                            print(f"    ({note[:300]})", flush=True)
                        if args.json:
                            with open(args.json, "a") as f:
                                f.write(json.dumps(res.__dict__) + "\n")
        finally:
            broker.stop()
    table = _table(
        rows,
        " ".join(["python -m bench.service.chaos", *(argv or sys.argv[1:])]),
        time.monotonic() - t0,
    )
    print(table)
    if args.doc:
        _write_doc(Path(args.doc), table)
    return 0 if all(r.ok for r in rows) else 1


def _table(rows, command: str, seconds: float) -> str:
    lines = [
        f"Command: `{command}` ({seconds / 60:.0f} min, one run)",
        "",
        "| mode | fault | runs | faults injected | events produced | released | left "
        "open | runs violated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list] = {}
    for r in rows:
        groups.setdefault((r.mode, r.fault), []).append(r)
    for (mode, fault), rs in groups.items():
        lines.append(
            f"| {mode} | {fault} | {len(rs)} | {sum(r.faults for r in rs)} | "
            f"{sum(r.produced for r in rs):,} | "
            f"{sum(sum(r.released.values()) for r in rs):,} | "
            f"{sum(sum(r.unreleased.values()) for r in rs):,} | "
            f"{sum(not r.ok for r in rs)} |"
        )
    lines.append(
        f"| **all** | | {len(rows)} | {sum(r.faults for r in rows)} | "
        f"{sum(r.produced for r in rows):,} | | | {sum(not r.ok for r in rows)} |"
    )
    for label, pick in (
        ("a group", lambda r: MODES[r.mode].members > 0),
        ("one process", lambda r: MODES[r.mode].members == 0),
    ):
        back = [
            (s, c)
            for r in rows
            if pick(r)
            for s, c in zip(r.resume_s, r.resume_censored or [False] * len(r.resume_s))
        ]
        seen = sorted(s for s, c in back if s is not None and not c)
        censored = sum(c for _, c in back)
        if back:
            lines.append("")
            lines.append(
                f"Next release holding events after the broker's return, {label}: "
                f"median {statistics.median(seen):.1f} s over {len(seen)} returns"
                if seen
                else f"Next release holding events after the broker's return, {label}: none"
            )
            if censored:
                lines[-1] += (
                    f"; {censored} returns left out, the next outage began before their release"
                )
            if len(seen) + censored < len(back):
                lines[-1] += (
                    f"; {len(back) - len(seen) - censored} returns with no release after them"
                )
    return "\n".join(lines)


def _write_doc(path: Path, table: str) -> None:
    begin, end = "<!-- chaos table -->", "<!-- /chaos table -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{table}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text += ("\n" if text else "") + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
