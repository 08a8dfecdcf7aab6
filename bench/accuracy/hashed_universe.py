"""Hashed mode against direct mode over the real id universe (issue 12).

    python -m bench.accuracy.hashed_universe [--reps 3] [--quick]

A user who knows the id universe U (every id that could appear, most never seen) can run direct
mode with D = U counters; hashed mode needs no universe and keeps B = choose_buckets(n) = 2 n
counters. This compares the two as shipped (``anonymized_histogram`` with each mode's default
estimator, n public, capped at n) on the same items, paired per repetition:

* items: n events over [U] with Zipf(1.1), Zipf(1.5) (truncated to U) or uniform weights;
* U / n in {1, 10, 100, 1000}; n in {1e4, 1e5, 1e6}; eps in {0.5, 1, 2}; 1 layer (state-only)
  and 2 layers (joint model);
* error: l1 distance of the released and the true anonymized histogram; ratio = hashed / direct
  over U (target <= 1.2). The support oracle (direct mode over exactly the ids seen, which no
  deployment can run) is reported as a reference line only.

Direct mode's U - distinct empty counters are simulated exactly (one multinomial draw over the
noise pmf), so U = 1e9 costs no more than U = 1e4. Seeded numpy noise (benchmark only). Writes
docs/hashed_universe.md.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import numpy as np

from aggregator.estimate import l1_distance
from aggregator.anonymize import anonymized_histogram
from aggregator.largedomain import choose_buckets
from aggregator.noise import p_from_epsilon
from bench.accuracy.largedomain import hash_items, hashed_vc, noisy_vc
from bench.harness import ROOT, git_rev, parser

SEED = 20261123
DISTS = ("zipf1.1", "zipf1.5", "uniform")
RATIOS = (1, 10, 100, 1000)
NS = (10**4, 10**5, 10**6)
EPS = (0.5, 1.0, 2.0)
LAYERS = (1, 2)


def draw_items(rng: np.random.Generator, n: int, U: int, dist: str):
    """(names, counts) of n events over the universe [U]."""
    if dist == "uniform":
        ids = rng.integers(0, U, n)
    else:
        s = float(dist[4:])
        ids = rng.zipf(s, n)
        bad = ids > U
        while bad.any():  # truncate to the universe by resampling
            ids[bad] = rng.zipf(s, int(bad.sum()))
            bad = ids > U
    uniq, counts = np.unique(ids, return_counts=True)
    return np.char.add(b"u", uniq.astype(np.bytes_)), counts.astype(np.int64)


def run_cell(n: int, U: int, dist: str, eps: float, reps: int) -> dict:
    p = p_from_epsilon(eps)
    B = choose_buckets(n, eps)
    out: dict = {"B": B, "distinct": []}
    for rep in range(reps):
        rng = np.random.default_rng([SEED, n, U, DISTS.index(dist), int(eps * 100), rep])
        names, h = draw_items(rng, n, U, dist)
        out["distinct"].append(len(h))
        where = hash_items(rng, names, B)
        for layers in LAYERS:
            vh, _ = hashed_vc(rng, h, where, B, p, layers)
            vu = noisy_vc(rng, h, U - len(h), p, layers)  # direct over the universe
            vs = noisy_vc(rng, h, 0, p, layers)  # support oracle (reference only)
            for key, vc, kw in (
                ("hashed", vh, {"buckets": B}),
                ("universe", vu, {}),
                ("oracle", vs, {}),
            ):
                est = anonymized_histogram(vc, p, layers=layers, n=n, **kw)
                out.setdefault((key, layers), []).append(l1_distance(h, est))
    return out


def cells(quick: bool, eps_list=EPS, smoke: bool = False):
    ns = (300,) if smoke else NS[:2] if quick else NS
    for n in ns:
        for ratio in RATIOS[:1] if smoke else RATIOS:
            for dist in DISTS[:1] if smoke else DISTS:
                for eps in eps_list:
                    yield n, n * ratio, dist, eps


def main(argv=None) -> int:
    ap = parser(__doc__, "Zipf(1.1), n = U = 300, eps 1, one repetition, into out/")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--eps", type=float, action="append", help="only these eps (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "hashed_universe.md"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.eps, args.out = 1, [1.0], "out/hashed_universe.md"
        Path("out").mkdir(exist_ok=True)
    started = time.time()
    rows = []
    for n, U, dist, eps in cells(args.quick, tuple(args.eps) if args.eps else EPS, args.smoke):
        res = run_cell(n, U, dist, eps, args.reps)
        for layers in LAYERS:
            hashed = statistics.mean(res[("hashed", layers)])
            universe = statistics.mean(res[("universe", layers)])
            oracle = statistics.mean(res[("oracle", layers)])
            ratios = [a / b for a, b in zip(res[("hashed", layers)], res[("universe", layers)])]
            rows.append(
                {
                    "n": n,
                    "U": U,
                    "dist": dist,
                    "eps": eps,
                    "layers": layers,
                    "distinct": statistics.mean(res["distinct"]),
                    "B": res["B"],
                    "hashed": hashed,
                    "universe": universe,
                    "oracle": oracle,
                    "ratio": hashed / universe,
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
        print(
            f"n={n:.0e} U/n={U // n} {dist} eps={eps}: "
            + ", ".join(f"{r['layers']}L {r['ratio']:.2f}" for r in rows[-len(LAYERS) :]),
            flush=True,
        )
    write(rows, args, started)
    return 0


def write(rows, args, started) -> None:
    rev = git_rev(["aggregator", "bench/accuracy/hashed_universe.py"])
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    lines = [
        "# Hashed mode against direct mode over the real id universe",
        "",
        f"Produced by `.venv/bin/python -m bench.accuracy.hashed_universe --reps {args.reps}"
        f"{' --quick' if args.quick else ''}"
        f"{''.join(f' --eps {e:g}' for e in (args.eps or []))}` at {rev} "
        f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))}Z, "
        f"{(time.time() - started) / 60:.1f} min, load average at the end {load}).",
        "",
        "A user who knows the id universe U can run direct mode with U counters; hashed "
        "mode keeps B = 2 n counters and needs no universe. Both as shipped (each mode's "
        "default estimator, n public, capped at n), on the same items and paired noise. "
        "ratio = mean l1 error of hashed / mean l1 error of direct over U (target <= 1.2; "
        "below 1: hashed is better). The support oracle (direct mode over exactly the ids "
        "seen, which no deployment can run) is a reference line only. Source: "
        "`bench/accuracy/hashed_universe.py`.",
        "",
    ]
    for layers in LAYERS:
        sub = [r for r in rows if r["layers"] == layers]
        worst = max(sub, key=lambda r: r["ratio"])
        over = [r for r in sub if r["ratio"] > 1.2]
        geo = math.exp(statistics.mean(math.log(r["ratio"]) for r in sub))
        lines += [
            f"## {layers} layer{'s' if layers > 1 else ''} "
            f"({'state-only' if layers == 1 else 'joint model'})",
            "",
            f"{len(sub)} cells; geometric mean ratio {geo:.2f}; worst {worst['ratio']:.2f} "
            f"(n={worst['n']:.0e}, U/n={worst['U'] // worst['n']}, {worst['dist']}, "
            f"eps={worst['eps']}); cells over 1.2: {len(over)}.",
            "",
            "| n | U/n | items | eps | distinct | hashed l1 | direct over U l1 | ratio "
            "(min..max) | oracle l1 (reference) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sub:
            lines.append(
                f"| {r['n']:.0e} | {r['U'] // r['n']} | {r['dist']} | {r['eps']} | "
                f"{r['distinct']:,.0f} | {r['hashed']:,.0f} | {r['universe']:,.0f} | "
                f"**{r['ratio']:.2f}** ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) | "
                f"{r['oracle']:,.0f} |"
            )
        lines.append("")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
