"""Rollups (issue 30): day and week releases summed from hourly release views, against one hour,
against a day-long window with its own state, and against tree designs that split epsilon.

Designs, all at the same epsilon per event unless said (eps = 1 by default; p(e) = exp(-e/2)):

* ``hour``: one base window, 2 layers at p(eps) (the release today);
* ``day-sum`` / ``week-sum`` (what the service builds): the sum of 24 / 168 hourly release views,
  48 / 336 layers at p(eps), 0 extra eps;
* ``day-own`` / ``week-own``: a window of the whole day / week with its own state, 2 layers at
  p(eps): what a second aggregation gives, at **2 eps per event** (not equal eps: reference (b));
* ``tree2``: two levels each with its own live state at eps/2 (hour and day, 2 layers at p(eps/2)
  each); its week is the sum of 7 day views (14 layers at p(eps/2)) (the hybrid);
* ``tree3``: three levels at eps/3 each (hour, day, week: 2 layers at p(eps/3) each).

The truth of a day is a multinomial draw of 24 n_hour events from the profile; the rollup's
counters are that truth plus 48 independent layers (the sum of 24 windows' truths and views is
exactly that). Errors against the truth of the same window: l1 of the anonymized histogram over
n, relative error of distinct items and of entropy. Noise from the CSPRNG (not seeded); the data
draws unseeded too. Every figure of one table comes from one run.

Usage::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.rollups --accuracy [--reps 3]
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.rollups --timing
"""

from __future__ import annotations

import time

import numpy as np

from aggregator import properties
from aggregator.estimate import l1_distance
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.release import estimate_with_accuracy

from .._data import real_profile, weights
from ..harness import git_rev, mean_se, parser, write_doc_section

DOC = "docs/rollups.md"
PROFILES = ("wf-en", "sc-ru", "ss-en", "jb-zh")


def noisy(h: np.ndarray, p: float, layers: int) -> np.ndarray:
    out = h.copy()
    for _ in range(layers):
        out += discrete_laplace(p, len(h))  # the CSPRNG
    return out


def errors(h: np.ndarray, x: np.ndarray, p: float, layers: int, n: int) -> tuple:
    est = anonymized_histogram(x, p, layers=layers, n=n)
    truth = np.sort(h[h > 0])[::-1]
    d_true, h_true = len(truth), properties.entropy(truth)
    return (
        l1_distance(est, truth) / n,
        abs(len(est) - d_true) / d_true,
        abs(properties.entropy(est) - h_true) / h_true,
    )


def accuracy(profiles, hourly, eps: float, reps: int) -> list[str]:
    rng = np.random.default_rng()
    pe, p2, p3 = p_from_epsilon(eps), p_from_epsilon(eps / 2), p_from_epsilon(eps / 3)
    designs = {  # name -> (window hours, p, layers)
        "hour": (1, pe, 2),
        "day-sum": (24, pe, 48),
        "day-own (2 eps)": (24, pe, 2),
        "tree2 hour": (1, p2, 2),
        "tree2 day": (24, p2, 2),
        "week-sum": (168, pe, 336),
        "week-own (2 eps)": (168, pe, 2),
        "tree2 week (7 day views)": (168, p2, 14),
        "tree3 hour": (1, p3, 2),
        "tree3 day": (24, p3, 2),
        "tree3 week": (168, p3, 2),
    }
    lines = [
        f"eps = {eps:g} per event; {reps} repetitions per cell; mean relative errors "
        "(l1 / n, distinct, entropy) over the repetitions, then the ratios; "
        f"commit {git_rev(['aggregator', 'bench'])}.",
        "",
    ]
    table = [
        "| profile (D) | n per hour | design | hours | layers | l1 / n | distinct | entropy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = [
        "| profile | n per hour | hour / day-sum (l1, distinct, entropy) | "
        "day-sum / day-own (l1, distinct, entropy) | day-sum / tree2 day | "
        "week-sum / tree3 week | week-sum / tree2 week |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in profiles:
        # (--smoke: "zipf", Zipf(1.1) over 200 items instead of a real profile)
        w = weights("zipf", 200) if name == "zipf" else real_profile(name)
        D = len(w)
        for nh in hourly:
            res: dict = {d: [] for d in designs}
            for _ in range(reps):
                truths = {
                    hours: rng.multinomial(nh * hours, w).astype(np.int64) for hours in (1, 24, 168)
                }
                for d, (hours, p, k) in designs.items():
                    h = truths[hours]
                    res[d].append(errors(h, noisy(h, p, k), p, k, nh * hours))
                print(f"{name} n/h={nh}: rep done", flush=True)
            mean = {d: np.mean(np.array(v), axis=0) for d, v in res.items()}
            for d, (hours, p, k) in designs.items():
                m = mean[d]
                table.append(
                    f"| {name} ({D:,}) | {nh:,} | {d} | {hours} | {k} | "
                    f"{m[0]:.4f} | {m[1]:.4f} | {m[2]:.5f} |"
                )

            def r(a, b):
                return ", ".join(f"{x / y:.2f}" if y > 0 else "-" for x, y in zip(mean[a], mean[b]))

            ratios.append(
                f"| {name} | {nh:,} | {r('hour', 'day-sum')} | "
                f"{r('day-sum', 'day-own (2 eps)')} | {r('day-sum', 'tree2 day')} | "
                f"{r('week-sum', 'tree3 week')} | "
                f"{r('week-sum', 'tree2 week (7 day views)')} |"
            )
            print("\n".join(table[-len(designs) :] + ratios[-1:]), flush=True)
    return lines + table + [""] + ratios


DESIGNS = {  # design -> its (hour, day, week) rows of the accuracy table
    "sum": ("hour", "day-sum", "week-sum"),
    "hybrid": ("tree2 hour", "tree2 day", "tree2 week (7 day views)"),
    "tree": ("tree3 hour", "tree3 day", "tree3 week"),
}
STATS = ("l1 / n", "distinct", "entropy")


def summarize(text: str) -> list[str]:
    """The designs compared from one run's accuracy table (the rows it printed): per profile
    and hourly n, each resolution's error over the best design's there (regret), and the
    designs' worst and mean regret over profiles, resolutions and the three statistics (the
    smallest worst regret is the accuracy grid's rule, docs/accuracy_grid.md)."""
    rows: dict = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[1].replace(",", "").isdigit():
            key = (cells[0].split()[0], int(cells[1].replace(",", "")))
            rows.setdefault(key, {})[cells[2]] = [float(x) for x in cells[5:8]]
    regrets: dict = {d: [] for d in DESIGNS}
    by_profile: dict = {}  # profile -> design -> its regrets (for the held-out choice)
    out = [
        "| profile | n per hour | resolution | "
        + " | ".join(f"{d} (l1, distinct, entropy)" for d in DESIGNS)
        + " |",
        "|---|---|---|" + "---|" * len(DESIGNS),
    ]
    target = [
        "| profile | n per hour | hour (sum design, eps) / day of: "
        + " | ".join(f"{d} (l1, distinct, entropy)" for d in DESIGNS)
        + " |",
        "|---|---|" + "---|" * len(DESIGNS),
    ]
    for key, got in rows.items():
        if not all(r in got for d in DESIGNS.values() for r in d):
            continue
        for i, res in enumerate(("hour", "day", "week")):
            errs = {d: got[DESIGNS[d][i]] for d in DESIGNS}
            best = [min(errs[d][j] for d in DESIGNS) for j in range(3)]
            cells = []
            for d in DESIGNS:
                reg = [errs[d][j] / best[j] if best[j] > 0 else 1.0 for j in range(3)]
                regrets[d].extend(reg)
                by_profile.setdefault(key[0], {}).setdefault(d, []).extend(reg)
                cells.append(", ".join(f"{x:.2f}" for x in reg))
            out.append(f"| {key[0]} | {key[1]:,} | {res} | " + " | ".join(cells) + " |")
        hour = got["hour"]
        target.append(
            f"| {key[0]} | {key[1]:,} | "
            + " | ".join(
                ", ".join(f"{hour[j] / got[DESIGNS[d][1]][j]:.2f}" for j in range(3))
                for d in DESIGNS
            )
            + " |"
        )
    worst = {d: (max(v), float(np.mean(v))) for d, v in regrets.items() if v}
    choice = min(worst, key=lambda d: worst[d])
    by_mean = min(worst, key=lambda d: worst[d][1])
    lines = [
        "Regret: a design's error over the best design's at that resolution (1.00: best);",
        "per cell l1 / n, distinct, entropy.",
        "",
        *out,
        "",
        "Worst / mean regret over every cell, resolution and statistic: "
        + "; ".join(f"{d} {w:.2f} / {m:.2f}" for d, (w, m) in worst.items())
        + f". Smallest worst regret: **{choice}**; smallest mean regret: **{by_mean}**.",
        "",
        *held_out(by_profile),
        "",
        "The target: the hourly release (sum design: the whole eps) over the day release "
        "of each design (> 1: the day is more accurate, relative errors):",
        "",
        *target,
    ]
    return lines


def bound(profiles, hourly: int, eps: float, reps: int) -> list[str]:
    """How far any design can take the day at ``eps`` per event: the hour at eps against a
    day-long window with its own state at the whole eps (no hourly release beside it: what
    every design that also releases hours can only approach) and the hybrid's day at eps/2.
    The ratio hour / day at eps bounds what the issue's 3x target can reach."""
    rng = np.random.default_rng()
    pe, p2 = p_from_epsilon(eps), p_from_epsilon(eps / 2)
    designs = {"hour": (1, pe), "day at eps": (24, pe), "hybrid day at eps/2": (24, p2)}
    lines = [
        f"eps = {eps:g}; {hourly:,} events per hour; {reps} repetitions; mean relative "
        "errors (l1 / n, distinct items, entropy), standard errors in brackets; commit "
        f"{git_rev(['aggregator', 'bench'])}.",
        "",
        "| profile (D) | statistic | " + " | ".join(designs) + " | hour / day at eps | "
        "hour / hybrid day |",
        "|---|---|" + "---|" * (len(designs) + 2),
    ]
    for name in profiles:
        w = real_profile(name)
        res: dict = {d: [] for d in designs}
        for _ in range(reps):
            truths = {
                hours: rng.multinomial(hourly * hours, w).astype(np.int64) for hours in (1, 24)
            }
            for d, (hours, p) in designs.items():
                h = truths[hours]
                res[d].append(errors(h, noisy(h, p, 2), p, 2, hourly * hours))
        for j, stat in enumerate(STATS):
            m = {d: mean_se([e[j] for e in v]) for d, v in res.items()}
            lines.append(
                f"| {name} ({len(w):,}) | {stat} | "
                + " | ".join(f"{m[d][0]:.4f} ({m[d][1]:.4f})" for d in designs)
                + f" | {m['hour'][0] / m['day at eps'][0]:.2f} | "
                f"{m['hour'][0] / m['hybrid day at eps/2'][0]:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


def held_out(by_profile: dict) -> list[str]:
    """The default chosen out of sample: hold out one profile, pick the design with the
    smallest mean regret on the others, score the pick on the held-out profile (mean / worst
    regret); each fixed design's held-out figures alongside."""
    if len(by_profile) < 2:
        return []
    out = [
        "Held out (leave one profile out; pick: smallest mean regret on the other "
        "profiles; held-out mean / worst regret):",
        "",
        "| held out | pick | pick's mean / worst | " + " | ".join(DESIGNS) + " |",
        "|---|---|---|" + "---|" * len(DESIGNS),
    ]
    picked = []
    for held in sorted(by_profile):
        rest = [pr for pr in by_profile if pr != held]
        pick = min(
            DESIGNS, key=lambda d: float(np.mean([x for pr in rest for x in by_profile[pr][d]]))
        )
        mine = by_profile[held]
        picked.append(float(np.mean(mine[pick])))
        out.append(
            f"| {held} | {pick} | {np.mean(mine[pick]):.2f} / {max(mine[pick]):.2f} | "
            + " | ".join(f"{np.mean(mine[d]):.2f} / {max(mine[d]):.2f}" for d in DESIGNS)
            + " |"
        )
    fixed = {d: float(np.mean([np.mean(by_profile[pr][d]) for pr in by_profile])) for d in DESIGNS}
    out += [
        "",
        "Mean over the held-out profiles of their mean regret: the procedure "
        f"{np.mean(picked):.2f}; "
        + "; ".join(f"{d} fixed {v:.2f}" for d, v in fixed.items())
        + ".",
    ]
    return out


def methods(profile: str = "sc-ru", hourly: int = 10_000) -> list[str]:
    """Every estimator on one day (48 layers) and one week (336 layers) of ``profile``."""
    from aggregator.estimators import METHODS

    rng = np.random.default_rng()
    w = real_profile(profile)
    p = p_from_epsilon(1.0)
    lines = [
        "| layers | estimator | seconds | l1 / n | distinct | entropy |",
        "|---|---|---|---|---|---|",
    ]
    for k, n in ((48, 24 * hourly), (336, 168 * hourly)):
        h = rng.multinomial(n, w).astype(np.int64)
        x = noisy(h, p, k)
        for m in METHODS:
            t = time.perf_counter()
            try:
                est = anonymized_histogram(x, p, layers=k, n=n, method=m)
            except ValueError as exc:
                lines.append(f"| {k} | {m} | - | refused: {exc} | | |")
                continue
            dt = time.perf_counter() - t
            truth = np.sort(h[h > 0])[::-1]
            lines.append(
                f"| {k} | {m} | {dt:.1f} | {l1_distance(est, truth) / n:.4f} | "
                f"{abs(len(est) / len(truth) - 1):.4f} | "
                f"{abs(properties.entropy(est) / properties.entropy(truth) - 1):.5f} |"
            )
            print(lines[-1], flush=True)
    return lines


def timing(cells, reps_bars: int) -> list[str]:
    """Release time (estimate + bootstrap error bars as the service runs them) of a rollup."""
    rng = np.random.default_rng()
    lines = [
        "| counters D | Zipf(1.1), n | layers | error_bar_reps | release seconds | estimator |",
        "|---|---|---|---|---|---|",
    ]
    p = p_from_epsilon(1.0)
    for D, n, k in cells:
        h = rng.multinomial(n, weights("zipf", D)).astype(np.int64)
        if True:
            x = noisy(h, p, k)
            t = time.perf_counter()
            _, acc = estimate_with_accuracy(x, p, layers=k, n=n, reps=reps_bars)
            dt = time.perf_counter() - t
            row = f"| {D:,} | {n:,} | {k} | {reps_bars} | {dt:.1f} | {acc['estimator']} |"
            print(row, flush=True)
            lines.append(row)
    return lines


def main(argv=None) -> None:
    ap = parser(
        __doc__,
        "--accuracy: Zipf(1.1) over 200 items, 20 events an hour, eps 8 "
        "(narrow noise: 336 layers stay cheap), one repetition; writes no doc",
    )
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument(
        "--methods",
        action="store_true",
        help="every estimator at 48 and 336 layers on one sc-ru day and week",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--eps", type=float, default=1.0)
    ap.add_argument("--profiles", nargs="*", default=list(PROFILES))
    ap.add_argument("--hourly", nargs="*", type=int, default=[10_000, 100_000])
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument(
        "--bound",
        action="store_true",
        help="hour / a day window at the whole eps "
        "(what any design can reach) and / the hybrid day, on --profiles at the "
        "first --hourly",
    )
    ap.add_argument(
        "--summarize",
        metavar="OUTPUT",
        help="compare the designs from the output of an --accuracy run (its printed table)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.accuracy, args.no_doc, args.profiles, args.hourly, args.reps, args.eps = (
            True,
            True,
            ["zipf"],
            [20],
            1,
            8.0,
        )
    if args.bound:
        print("\n".join(bound(args.profiles, args.hourly[0], args.eps, args.reps)))
        return
    if args.summarize:
        from pathlib import Path

        text = Path(args.summarize).read_text()
        lines = summarize(text)
        print("\n".join(lines))
        if not args.no_doc:  # the run's own table, then the comparison
            table = [
                ln
                for ln in text.splitlines()
                if ln.startswith("| ") and not ln.startswith("| profile")
            ]
            rows = [ln for ln in table if ln.count("|") == 9]
            ratios = [ln for ln in table if ln.count("|") == 8]
            head = [
                "| profile (D) | n per hour | design | hours | layers | l1 / n | distinct "
                "| entropy |",
                "|---|---|---|---|---|---|---|---|",
            ]
            rhead = [
                "| profile | n per hour | hour / day-sum (l1, distinct, entropy) | "
                "day-sum / day-own (l1, distinct, entropy) | day-sum / tree2 day | "
                "week-sum / tree3 week | week-sum / tree2 week |",
                "|---|---|---|---|---|---|---|",
            ]
            write_doc_section(
                DOC,
                "bench",
                "rollups-accuracy",
                [
                    f"eps = {args.eps:g}, {args.reps} repetitions per cell (mean relative errors)",
                    "",
                    *head,
                    *rows,
                    "",
                    *rhead,
                    *ratios,
                ],
                "Rollups",
            )
            write_doc_section(DOC, "bench", "rollups-designs", lines, "Rollups")
    if args.accuracy:
        lines = accuracy(args.profiles, args.hourly, args.eps, args.reps)
        if not args.no_doc:
            write_doc_section(DOC, "bench", "rollups-accuracy", lines, "Rollups")
    if args.methods:
        lines = methods()
        if not args.no_doc:
            write_doc_section(DOC, "bench", "rollups-methods", lines, "Rollups")
    if args.timing:
        # an hour of 1e6 events, its day (24 windows) and its week (168) at 1e6 counters
        lines = timing(
            [(10**6, 10**6, 2), (10**6, 24 * 10**6, 48), (10**6, 168 * 10**6, 336)], reps_bars=10
        )

        if not args.no_doc:
            write_doc_section(DOC, "bench", "rollups-timing", lines, "Rollups")


if __name__ == "__main__":
    main()
