"""Accuracy of the released anonymized histogram: l1 and l2^2 error vs n, epsilon and D.

Run from the repository root:

    python -m bench.accuracy.accuracy            # full study (about 10-15 minutes on one core)
    python -m bench.accuracy.accuracy --quick    # smoke run (about 1 minute)

Writes docs/accuracy_core.md and docs/img/accuracy_vs_{n,eps,D}.png. With --quick the same
files go under out/ instead (git-ignored), so a smoke run never overwrites the committed results.

Compared, on the same true histogram and the same noise draws in each repetition:

* ``alg1``  - state-only release: counters h + DLap(p) (one layer), threshold estimator +
              l1 isotonic projection (seed 001 Algorithm 1/5), ``anonymized_histogram(x, p)``.
* ``l2``    - same counters, loss="l2" (Algorithm 3: sum = n and rank box; exact MILP).
* ``joint`` - joint model: h + DLap(p) + DLap(p) (two layers, same p; docs ALGORITHMS.md
              "Joint privacy"), default method (deconvolution for 2 layers).
* ``naive`` - sort the one-layer noisy counts, drop values <= 0.
* ``thm9``  - sqrt(C_p (n + D) log n), C_p = p^2/(1-p)^5 + p/(1-p): the *shape* of Theorem 9's
              l1 bound with constant 1, not a constant-exact bound.

p = p_from_epsilon(eps) = exp(-eps/2) rounded up (replace-one neighbors, sensitivity 2).
Noise here comes from a seeded numpy Generator (reproducible; benchmark only, never private).

Repetitions: each repetition draws a fresh multinomial sample of n items and fresh noise.
Cheap methods run every repetition; the expensive ones (l2, joint) stop early in a cell once
their time budget is used (at least 2 repetitions unless one run exceeds the hard cap); the
``reps`` columns say how many were run.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from aggregator.anonymize import anonymized_histogram
from aggregator.noise import p_from_epsilon

from .._data import DISTRIBUTIONS, errors, naive, noisy, theorem9_shape, true_counts
from ..harness import Timer, fmt, mean_se, parser, ratio_se

METHODS = ("alg1", "l2", "joint", "naive")
EXPENSIVE = {"l2", "joint"}
LABEL = {
    "alg1": "Alg. 1 (l1, state-only)",
    "l2": "loss l2 (state-only)",
    "joint": "joint (2 layers)",
    "naive": "naive",
    "thm9": "Thm 9 shape",
}
BASE = dict(D=100_000, n=1_000_000, eps=1.0)
HEADLINE = ("zipf", 100_000, 1_000_000, 1.0)


def grids(quick: bool):
    if quick:
        return {"n": [1_000, 100_000, 1_000_000], "eps": [0.5, 1.0, 4.0], "D": [1_000, 100_000]}
    return {
        "n": [1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000, 10_000_000],
        "eps": [0.25, 0.5, 1.0, 2.0, 4.0, 8.0],
        "D": [1_000, 10_000, 100_000, 1_000_000],
    }


def settings(quick: bool):
    if quick:
        return dict(reps=2, headline_reps=3, budget=4.0, cap=60.0, big_n_reps=2)
    # budget: seconds per expensive method per cell; cap: a single run longer than this
    # stops that method after one repetition.
    return dict(reps=5, headline_reps=10, budget=12.0, cap=30.0, big_n_reps=3)


# --smoke: the quick run's code on one tiny cell per distribution (the headline cell included)
SMOKE_BASE = dict(D=300, n=300, eps=1.0)
SMOKE_GRID = {"n": [300], "eps": [1.0], "D": [300]}
DISTS = DISTRIBUTIONS  # the distributions run (--smoke: zipf only)
SMOKE_SETTINGS = dict(reps=1, headline_reps=1, budget=1.0, cap=10.0, big_n_reps=1)


def run_cell(dist, D, n, eps, reps, budget, cap, seed):
    p = p_from_epsilon(eps)
    res = {m: {"l1": [], "l2sq": [], "time": []} for m in METHODS}
    spent = {m: 0.0 for m in METHODS}
    stopped = set()
    for rep in range(reps):
        rng = np.random.default_rng(
            [seed, DISTRIBUTIONS.index(dist), D, n, int(round(eps * 1000)), rep]
        )
        h = true_counts(rng, dist, D, n)
        x1 = noisy(rng, h, p, 1)
        x2 = x1 + noisy(rng, np.zeros_like(h), p, 1)
        for m in METHODS:
            if m in stopped:
                continue
            with Timer() as t:
                if m == "alg1":
                    est = anonymized_histogram(x1, p)
                elif m == "l2":
                    est = anonymized_histogram(x1, p, loss="l2", n=n)
                elif m == "joint":
                    est = anonymized_histogram(x2, p, layers=2)
                else:
                    est = naive(x1)
            e1, e2 = errors(h, est)
            res[m]["l1"].append(e1)
            res[m]["l2sq"].append(e2)
            res[m]["time"].append(t.s)
            spent[m] += t.s
            if m in EXPENSIVE:
                n_done = len(res[m]["l1"])
                if t.s > cap or (n_done >= 2 and spent[m] + spent[m] / n_done > budget):
                    stopped.add(m)
    res["thm9"] = theorem9_shape(p, n, D)
    res["p"] = p
    return res


def summarize(cell, m, metric):
    return mean_se(cell[m][metric])


def table(cells, key, values, dist, metric, fixed):
    name = {"n": "n", "eps": "eps", "D": "D"}[key]
    cols = ["alg1", "l2", "joint", "naive"]
    head = [name] + [LABEL[c] for c in cols]
    if metric == "l1":
        head += [LABEL["thm9"], "naive / Alg. 1", "joint / Alg. 1", "reps (alg1/l2/joint)"]
    else:
        head += ["naive / Alg. 1", "reps (alg1/l2/joint)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in values:
        cfg = dict(fixed)
        cfg[key] = v
        cell = cells[(dist, cfg["D"], cfg["n"], cfg["eps"])]
        row = [f"{v:g}" if key == "eps" else f"{v:.0e}".replace("e+0", "e")]
        for c in cols:
            row.append(fmt(*summarize(cell, c, metric)))
        r_naive = ratio_se(cell["naive"][metric], cell["alg1"][metric])
        if metric == "l1":
            row.append(f"{cell['thm9']:.3g}")
            row.append(fmt(*r_naive, digits=2))
            row.append(
                fmt(*ratio_se(cell["joint"][metric], cell["alg1"][metric]), digits=2)
                if cell["joint"][metric]
                else "-"
            )
        else:
            row.append(fmt(*r_naive, digits=2))
        row.append("/".join(str(len(cell[c]["l1"])) for c in ("alg1", "l2", "joint")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def timing_table(cells):
    tot = {m: [] for m in METHODS}
    worst = {m: (0.0, None) for m in METHODS}
    for k, cell in cells.items():
        for m in METHODS:
            tot[m].extend(cell[m]["time"])
            if cell[m]["time"] and max(cell[m]["time"]) > worst[m][0]:
                worst[m] = (max(cell[m]["time"]), k)
    lines = [
        "| method | runs | median s | max s | slowest cell (dist, D, n, eps) |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        t = np.array(tot[m])
        lines.append(
            f"| {LABEL[m]} | {len(t)} | {np.median(t):.3f} | {t.max():.2f} | {worst[m][1]} |"
        )
    return "\n".join(lines)


def plot(stat, thm9, key, values, fixed, path):
    """stat(dist, v, method, metric) -> (mean, se); thm9(dist, v) -> shape value."""
    from ..harness import pyplot

    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    style = {
        "alg1": ("C0", "o-"),
        "l2": ("C1", "s--"),
        "joint": ("C2", "^-"),
        "naive": ("C3", "x-"),
        "thm9": ("k", ":"),
    }
    for j, dist in enumerate(DISTS[:3]):  # the figure has three columns
        for i, metric in enumerate(("l1", "l2sq")):
            ax = axes[i, j]
            for m in METHODS:
                xs, ys, es = [], [], []
                for v in values:
                    mu, se = stat(dist, v, m, metric)
                    if not math.isnan(mu):
                        xs.append(v)
                        ys.append(max(mu, 0.5))
                        es.append(0 if math.isnan(se) else se)
                c, ls = style[m]
                ax.errorbar(xs, ys, yerr=es, fmt=ls, color=c, label=LABEL[m], ms=4, capsize=2)
            if metric == "l1":
                ax.plot(
                    values,
                    [thm9(dist, v) for v in values],
                    style["thm9"][1],
                    color="k",
                    label=LABEL["thm9"],
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            if key == "eps":  # under two decades: label the grid points, not minor ticks
                ax.set_xticks(values)
                ax.set_xticklabels([f"{v:g}" for v in values])
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(key)
            ax.set_ylabel("l1 error" if metric == "l1" else "l2^2 error")
            fx = ", ".join(f"{k}={v:g}" for k, v in fixed.items() if k != key)
            ax.set_title(
                f"{dist}: {'l1' if metric == 'l1' else 'l2^2'} vs {key} ({fx})", fontsize=9
            )
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cells(cells, key, values, fixed, path):
    def cell(dist, v):
        cfg = dict(fixed)
        cfg[key] = v
        return cells[(dist, cfg["D"], cfg["n"], cfg["eps"])]

    plot(
        lambda d, v, m, metric: summarize(cell(d, v), m, metric),
        lambda d, v: cell(d, v)["thm9"],
        key,
        values,
        fixed,
        path,
    )


def _parse_pm(text):
    text = text.strip()
    if text == "-":
        return float("nan"), float("nan")
    parts = [t.strip() for t in text.split("±")]
    return float(parts[0]), (float(parts[1]) if len(parts) > 1 else float("nan"))


def replot_from_md(md_path, outdir):
    """Redraw the PNGs from the tables of an existing accuracy_core.md (no recomputation)."""
    import re

    by_label = {v: k for k, v in LABEL.items()}
    data, key, dist, metric, header = {}, None, None, None, None
    for line in open(md_path):
        line = line.rstrip("\n")
        mk = re.match(r"## Error vs (\w+)", line)
        if mk:
            key, dist = mk.group(1), None
            continue
        if line.startswith("## "):
            key, dist = None, None
            continue
        ms = re.match(r"### (\w+): (l1|l2\^2) error vs", line)
        if ms:
            dist, metric, header = ms.group(1), ("l1" if ms.group(2) == "l1" else "l2sq"), None
            continue
        if not line.startswith("|") or key is None or dist is None:
            continue
        cols = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cols
            continue
        if set(cols[0]) <= set("-"):
            continue
        v = float(cols[0])
        for h, c in zip(header[1:], cols[1:]):
            if h in by_label:
                data[(key, dist, v, by_label[h], metric)] = _parse_pm(c)
    for key in ("n", "eps", "D"):
        values = sorted({k[2] for k in data if k[0] == key})
        plot(
            lambda d, v, m, metric: data.get((key, d, v, m, metric), (float("nan"),) * 2),
            lambda d, v: theorem9_shape(
                p_from_epsilon(dict(BASE, **{key: v})["eps"]),
                int(dict(BASE, **{key: v})["n"]),
                int(dict(BASE, **{key: v})["D"]),
            ),
            key,
            values,
            BASE,
            os.path.join(outdir, "img", f"accuracy_vs_{key}.png"),
        )
    print(f"redrew {outdir}/img/accuracy_vs_{{n,eps,D}}.png from {md_path}")


def main(argv=None):
    global BASE, HEADLINE, DISTS
    ap = parser(__doc__, "Zipf, D = n = 300, into out/")
    ap.add_argument("--quick", action="store_true", help="small grid, 2 repetitions")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument(
        "--outdir", default=None, help="output directory (default docs/, or out/ with --quick)"
    )
    ap.add_argument(
        "--replot",
        action="store_true",
        help="only redraw the PNGs from the tables of an existing accuracy_core.md",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.quick = True
        BASE, HEADLINE = SMOKE_BASE, ("zipf", *SMOKE_BASE.values())
        DISTS = DISTRIBUTIONS[:1]
    cmd = "python -m bench.accuracy.accuracy" + (" --quick" if args.quick else "")
    if args.seed != 20240601:
        cmd += f" --seed {args.seed}"
    outdir = args.outdir or ("out" if args.quick else "docs")
    out = os.path.join(outdir, "accuracy_core.md")
    if args.replot:
        replot_from_md(out, outdir)
        return 0
    g = SMOKE_GRID if args.smoke else grids(args.quick)
    st = SMOKE_SETTINGS if args.smoke else settings(args.quick)

    todo = []
    for key, values in g.items():
        for v in values:
            cfg = dict(BASE)
            cfg[key] = v
            for dist in DISTS:
                k = (dist, cfg["D"], cfg["n"], cfg["eps"])
                if k not in todo:
                    todo.append(k)
    cells = {}
    t_start = time.perf_counter()
    for i, k in enumerate(todo):
        dist, D, n, eps = k
        reps = st["headline_reps"] if k == HEADLINE else st["reps"]
        if n >= 3_000_000:
            reps = min(reps, st["big_n_reps"])
        with Timer() as t:
            cells[k] = run_cell(dist, D, n, eps, reps, st["budget"], st["cap"], args.seed)
        c = cells[k]
        print(
            f"[{i + 1}/{len(todo)}] {dist:9s} D={D:.0e} n={n:.0e} eps={eps:<5g} "
            f"alg1={mean_se(c['alg1']['l1'])[0]:.4g} naive={mean_se(c['naive']['l1'])[0]:.4g} "
            f"joint={mean_se(c['joint']['l1'])[0]:.4g} l2={mean_se(c['l2']['l1'])[0]:.4g} "
            f"({t.s:.1f}s, total {time.perf_counter() - t_start:.0f}s)",
            flush=True,
        )
    total = time.perf_counter() - t_start

    os.makedirs(os.path.join(outdir, "img"), exist_ok=True)
    for key, values in g.items():
        fixed = {kk: vv for kk, vv in BASE.items()}
        plot_cells(cells, key, values, fixed, os.path.join(outdir, "img", f"accuracy_vs_{key}.png"))

    hc = cells[HEADLINE]
    r, rse = ratio_se(hc["naive"]["l1"], hc["alg1"]["l1"])
    md = [
        f"# Accuracy of the core estimators{' (QUICK run)' if args.quick else ''}",
        "",
        "Produced by:",
        "",
        "```",
        cmd,
        "```",
        "",
        f"(seed {args.seed}; {len(todo)} cells; {total / 60:.1f} min wall time on a shared "
        "2-core machine. Source: `bench/accuracy/accuracy.py`, helpers `bench/_data.py`.)",
        "",
        "## Headline",
        "",
        f"Zipf(1.1), D = 1e5, n = 1e6, eps = 1 (p = {hc['p']:.6f}), "
        f"{len(hc['alg1']['l1'])} repetitions:",
        "",
        f"* Alg. 1 (state-only, l1) l1 error: **{fmt(*mean_se(hc['alg1']['l1']))}**",
        f"* naive (sort noisy counts, drop <= 0) l1 error: {fmt(*mean_se(hc['naive']['l1']))}",
        f"* **naive / Alg. 1 = {r:.2f} ± {rse:.2f}** (target >= 3x: "
        f"{'met' if r >= 3 else 'NOT met'})",
        f"* joint model (2 layers, deconvolution) l1 error: {fmt(*mean_se(hc['joint']['l1']))}"
        f" ({len(hc['joint']['l1'])} reps)",
        f"* loss l2 variant l1 error: {fmt(*mean_se(hc['l2']['l1']))} ({len(hc['l2']['l1'])} reps)",
        f"* Theorem 9 shape sqrt(C_p (n+D) log n) = {hc['thm9']:.4g}",
        "",
        "## Setup",
        "",
        "* Items are sampled multinomially (n events) over a domain of size D with weights "
        "Zipf 1/i^1.1, uniform, or geometric rho^i with rho = 1 - 10/D.",
        "* Each repetition draws a fresh true histogram h and fresh noise; all methods in a "
        "repetition see the same h and the same first noise layer (the joint model adds a "
        "second, independent layer on top).",
        "* p = exp(-eps/2) rounded up (replace-one neighbors, l1 sensitivity 2).",
        "* l1 error = l1 distance between anonymized histograms (= between cumulative "
        "prevalences); l2^2 error = both histograms sorted decreasing, zero-padded to equal "
        "length, sum of squared differences.",
        "* Entries are mean ± standard error over the repetitions (`reps` column; the expensive "
        f"l2 and joint methods stop early once they used {st['budget']:.0f} s in a cell, or "
        f"after one run longer than {st['cap']:.0f} s).",
        "* **Thm 9 shape** is sqrt(C_p (n + D) log n) with C_p = p^2/(1-p)^5 + p/(1-p) and "
        "constant 1: it shows how the bound scales, it is not a constant-exact bound.",
        "* Noise is drawn from a seeded numpy Generator for reproducibility; the product "
        "draws from the OS CSPRNG.",
        "",
    ]

    fixed_desc = {"n": "D = 1e5, eps = 1", "eps": "D = 1e5, n = 1e6", "D": "n = 1e6, eps = 1"}
    for key, values in g.items():
        md += [
            f"## Error vs {key} ({fixed_desc[key]})",
            "",
            f"![error vs {key}](img/accuracy_vs_{key}.png)",
            "",
        ]
        for dist in DISTS:
            for metric in ("l1", "l2sq"):
                md += [
                    f"### {dist}: {'l1' if metric == 'l1' else 'l2^2'} error vs {key}",
                    "",
                    table(cells, key, values, dist, metric, BASE),
                    "",
                ]

    md += [
        "## State-only vs joint model, per eps",
        "",
        "Ratio of mean l1 errors joint (2 layers, deconvolution) / state-only (Alg. 1), "
        "D = 1e5, n = 1e6. Above 1 means the joint model's extra layer costs accuracy.",
        "",
        "| eps | " + " | ".join(DISTS) + " |",
        "|---|" + "---|" * len(DISTS),
    ]
    for eps in g["eps"]:
        row = [f"{eps:g}"]
        for dist in DISTS:
            c = cells[(dist, BASE["D"], BASE["n"], eps)]
            row.append(fmt(*ratio_se(c["joint"]["l1"], c["alg1"]["l1"]), digits=2))
        md.append("| " + " | ".join(row) + " |")
    md += ["", "## Run time per estimate (this run)", "", timing_table(cells), ""]
    md += observations(cells, g)

    with open(out, "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {out} and {outdir}/img/accuracy_vs_*.png in {total / 60:.1f} min")
    print(f"HEADLINE naive/Alg1 = {r:.2f} ± {rse:.2f}")
    return 0


def observations(cells, g):
    """Automatic, data-driven remarks (where naive wins, where joint wins, l2 vs l1)."""
    out = ["## Observations (computed from this run's numbers)", ""]
    naive_wins, joint_wins, thm_viol = [], [], []
    l2_vs_l1 = []
    for k, c in cells.items():
        a = mean_se(c["alg1"]["l1"])[0]
        nv = mean_se(c["naive"]["l1"])[0]
        j = mean_se(c["joint"]["l1"])[0]
        if nv < a:
            naive_wins.append((k, a, nv))
        if c["joint"]["l1"] and j < a:
            joint_wins.append((k, a, j))
        if a > c["thm9"]:
            thm_viol.append((k, a, c["thm9"]))
        if c["l2"]["l2sq"]:
            l2_vs_l1.append(mean_se(c["l2"]["l2sq"])[0] / max(mean_se(c["alg1"]["l2sq"])[0], 1))

    def key_s(k):
        return f"{k[0]} D={k[1]:.0e} n={k[2]:.0e} eps={k[3]:g}"

    out.append(
        f"* Cells where the naive baseline has lower mean l1 error than Alg. 1: "
        f"{len(naive_wins)} of {len(cells)}" + (":" if naive_wins else ".")
    )
    for k, a, nv in naive_wins:
        out.append(f"  * {key_s(k)}: Alg. 1 {a:.4g}, naive {nv:.4g}")
    out.append(
        f"* Cells where the joint model (2 layers, deconvolution) has lower mean l1 error "
        f"than state-only Alg. 1 (1 layer, threshold): {len(joint_wins)} of {len(cells)}"
        + (":" if joint_wins else ".")
    )
    for k, a, j in joint_wins:
        out.append(f"  * {key_s(k)}: Alg. 1 {a:.4g}, joint {j:.4g}")
    out.append(
        f"* Cells where Alg. 1's mean l1 error exceeds the Thm 9 shape (constant 1): "
        f"{len(thm_viol)} of {len(cells)}" + (":" if thm_viol else ".")
    )
    for k, a, b in thm_viol:
        out.append(f"  * {key_s(k)}: Alg. 1 {a:.4g}, shape {b:.4g}")
    if l2_vs_l1:
        r = np.array(l2_vs_l1)
        out.append(
            f"* l2^2 error of the loss-l2 variant / l2^2 error of Alg. 1, over "
            f"{len(r)} cells: median {np.median(r):.3f}, min {r.min():.3f}, "
            f"max {r.max():.3f}."
        )
    short = [
        (k, len(c["alg1"]["l1"]), len(c["l2"]["l1"]), len(c["joint"]["l1"]))
        for k, c in cells.items()
        if min(len(c["l2"]["l1"]), len(c["joint"]["l1"])) < len(c["alg1"]["l1"])
    ]
    out.append(
        "* No configuration was skipped for any method. Cells where the time budget cut "
        f"the l2 or joint repetitions below Alg. 1's: {len(short)}"
        + (" (reps alg1/l2/joint):" if short else ".")
    )
    for k, a, b, j in short:
        out.append(f"  * {key_s(k)}: {a}/{b}/{j}")
    out.append("")
    return out


if __name__ == "__main__":
    sys.exit(main())
