"""Shuffle model vs pan-private vs central at equal epsilon, and what the shuffle protocols cost.

    python -m bench.accuracy.shuffle [--reps 3] [--quick]  # tables: stdout, docs/shuffle.md
    python -m bench.accuracy.shuffle --cost-only           # the cost table only (seconds)

Error: l1 distance between the released anonymized histogram and the true one, mean over
``--reps`` draws of the items, on the same true counts for every model:

* ``shuffle GKMP``: n real randomizer outputs (``GKMPRandomizer.encode_many``, OS-entropy noise),
  counted by ``gkmp_analyze`` (= h + DLap(p), p = exp(-(1 - gamma) eps / 2)), released by the
  product's default estimator with 1 layer. Messages are not encrypted here (sealing changes
  nothing the analyzer counts).
* ``shuffle Balcer-Cheu``: its analyzer's input h_j + Bin(n, s) drawn from that exact law (the
  real randomizer sends about B messages per event: 1e9 rows at B = 1e4, n = 1e5), its own
  analyzer, then the anonymized histogram of the rounded estimates.
* ``pan-private, state-only`` (1 DLap(exp(-eps/2)) layer) and ``joint`` (2 layers, the service
  default), through the same estimator; ``central``: PRIVHIST (eps <= 1) / DPAnonHist (eps > 1).

Cost: expected messages and bytes per event (a sealed message is 74 bytes, shuffle_wire v2) against
B / n, from the calibrated parameters; the measured mean of one encode_many run beside it.
"""

from __future__ import annotations

import time

import numpy as np

from aggregator import central
from aggregator.estimate import l1_distance
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import p_from_epsilon
from aggregator.service.shuffle_wire import SEALED_SIZE
from aggregator.shuffle import BalcerCheuRandomizer, GKMPRandomizer, gkmp_analyze
from bench._data import noisy, true_counts
from bench.harness import ROOT, cpu_model, git_rev, parser, write_doc_section

DELTA = 1e-6
DOC = ROOT / "docs" / "shuffle.md"


def _hist(counts: np.ndarray) -> np.ndarray:
    c = np.sort(counts[counts > 0])[::-1]
    return c.astype(np.int64)


def one_cell(dist: str, D: int, n: int, eps: float, reps: int, rng) -> dict:
    errs = {k: [] for k in ("gkmp", "bc", "pan1", "pan2", "central")}
    rz = GKMPRandomizer(eps, DELTA, n, D, max_messages=1e9)
    bc_ok = True
    try:
        bc = BalcerCheuRandomizer(eps, DELTA, n, D, max_messages=1e12)
    except ValueError as exc:
        bc_ok, bc = False, str(exc)
    p_pan = p_from_epsilon(eps, 2)
    for _ in range(reps):
        h = true_counts(rng, dist, D, n)
        truth = _hist(h)
        items = np.repeat(np.arange(D), h)
        counts = np.zeros(D, dtype=np.int64)
        for chunk in np.array_split(items, max(1, len(items) // 20_000)):
            rows, _ = rz.encode_many(chunk)
            counts += gkmp_analyze(rows, D)
        errs["gkmp"].append(l1_distance(truth, anonymized_histogram(counts, rz.p, layers=1, n=n)))
        if bc_ok:
            view = h + rng.binomial(n, bc.s, size=D)
            est = np.where(view > n, view - bc.s * n, 0.0)  # balcer_cheu_analyze on these counts
            errs["bc"].append(l1_distance(truth, _hist(np.rint(est).astype(np.int64))))
        for layers, key in ((1, "pan1"), (2, "pan2")):
            errs[key].append(
                l1_distance(
                    truth,
                    anonymized_histogram(noisy(rng, h, p_pan, layers), p_pan, layers=layers, n=n),
                )
            )
        rel = central.privhist(h, eps) if eps <= 1 else central.dp_anon_hist(h, eps, n=n)
        errs["central"].append(l1_distance(truth, np.asarray(rel, dtype=np.int64)))
    out = {k: (float(np.mean(v)) if v else float("nan")) for k, v in errs.items()}
    out["bc_note"] = "" if bc_ok else bc
    out["p"] = rz.p
    out["msgs"] = rz.expected_messages
    return out


def error_table(reps: int, quick: bool, rng, smoke: bool = False) -> list[str]:
    cells = [
        ("zipf", 10_000, 100_000, 1.0),
        ("uniform", 10_000, 100_000, 1.0),
        ("heavy", 100_000, 100_000, 1.0),
        ("zipf", 10_000, 100_000, 0.5),
    ]
    if smoke:
        cells = [("zipf", 1_000, 10_000, 1.0)]
    elif not quick:
        cells += [("geometric", 10_000, 100_000, 1.0), ("zipf", 1_000, 100_000, 2.0)]
    lines = [
        "| data | D | n | eps | shuffle GKMP | shuffle Balcer-Cheu | pan-private 1 layer | "
        "pan-private 2 layers | central | GKMP / pan 1 layer | GKMP msgs/event |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dist, D, n, eps in cells:
        t0 = time.perf_counter()
        r = one_cell(dist, D, n, eps, reps, rng)
        bc = f"{r['bc']:,.0f}" if not r["bc_note"] else "refused (n too small)"
        lines.append(
            f"| {dist} | {D:,} | {n:,} | {eps:g} | {r['gkmp']:,.0f} | {bc} | "
            f"{r['pan1']:,.0f} | {r['pan2']:,.0f} | {r['central']:,.0f} | "
            f"{r['gkmp'] / r['pan1']:.2f} | {r['msgs']:.1f} |"
        )
        print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return lines


def cost_table(rng) -> list[str]:
    n = 100_000
    lines = [
        "| B / n | B | protocol | expected msgs/event | measured msgs/event | bytes/event sealed |",
        "|---|---|---|---|---|---|",
    ]
    for frac in (0.001, 0.01, 0.1, 1.0):
        B = int(frac * n)
        for name in ("gkmp", "bc"):
            try:
                rz = (
                    GKMPRandomizer(1.0, DELTA, n, B, max_messages=1e9)
                    if name == "gkmp"
                    else BalcerCheuRandomizer(1.0, DELTA, n, B, max_messages=1e12)
                )
            except ValueError as exc:
                lines.append(f"| {frac:g} | {B:,} | {name} | refused: {exc} | | |")
                continue
            events = max(10, min(2000, int(2e6 / max(rz.expected_messages, 1))))
            if name == "gkmp":
                rows, _ = rz.encode_many(rng.integers(0, B, size=events))
                measured = len(rows) / events
            else:
                measured = np.mean(
                    [len(rz.encode(int(b))) for b in rng.integers(0, B, size=min(events, 50))]
                )
            lines.append(
                f"| {frac:g} | {B:,} | {'GKMP' if name == 'gkmp' else 'Balcer-Cheu'} | "
                f"{rz.expected_messages:,.1f} | {measured:,.1f} | "
                f"{rz.expected_messages * SEALED_SIZE:,.0f} |"
            )
    return lines


def main(argv=None) -> int:
    ap = parser(
        __doc__, "one cell, D = 1000, n = 10,000, one draw, and the cost table; writes no doc"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--cost-only", action="store_true", help="only the cost table")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.no_write = 1, True
    rng = np.random.default_rng()
    if args.cost_only:
        cost = cost_table(rng)
        print("\n".join(cost))
        if not args.no_write:
            write_doc_section(
                DOC,
                "bench.accuracy.shuffle",
                "cost",
                [
                    "Command: `python -m bench.accuracy.shuffle --cost-only` "
                    f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                    f"git {git_rev(['aggregator', 'bench'])}); n = 100,000, eps = 1, delta = 1e-6; "
                    f"{SEALED_SIZE} bytes per sealed message (wire v2: the parameter fingerprint "
                    "inside every box).",
                    "",
                ]
                + cost,
            )
        return 0
    head = [
        f"Command: `python -m bench.accuracy.shuffle --reps {args.reps}"
        f"{' --quick' if args.quick else ''}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_model()}; "
        f"git {git_rev(['aggregator', 'bench'])}); "
        f"delta = {DELTA:g}, gamma = 0.1, l1 error of the anonymized histogram, mean of "
        f"{args.reps} draws.",
        "",
    ]
    err = error_table(args.reps, args.quick, rng, args.smoke)
    cost = cost_table(rng)
    print("\n".join(cost))
    if not args.no_write:
        write_doc_section(DOC, "bench.accuracy.shuffle", "error", head + err)
        write_doc_section(
            DOC,
            "bench.accuracy.shuffle",
            "cost",
            ["Command: as above; n = 100,000, eps = 1, delta = 1e-6.", ""] + cost,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
