"""How ``method="auto"`` should choose: every ingredient of the selection, recorded once per grid
cell, so that selection rules are compared offline on the same draws.

For each direct cell of the accuracy grid (bench/accuracy/grid.py), repetition and layer count,
on the grid's own noisy counters (same seeds, so the same draws as out/grid_results.pkl):

* ``true``: the l1 error against the truth of every candidate (method x cap rule) of
  :data:`aggregator.selection.CANDIDATES`, on the real counters;
* ``boot``: for every stand-in truth (pilot estimator x the cap that brings it to n) and
  :data:`SIMS` simulated states drawn from it, the l1 error of every candidate against the
  stand-in (what ``selection._select`` computes for its two stand-ins and two draws);
* ``loglik``: the log-likelihood of the observed noisy values under each stand-in
  (``counter_model.loglik``).

A rule is then a function of ``boot`` and ``loglik`` (never of ``true``) that returns a
candidate; its error in a cell is ``true`` of that candidate. ``--report`` compares rules by the
grid's criterion: worst-case and geometric-mean regret against the best candidate in hindsight
(the stored grid's admissible candidates and this study's, whichever is lower), and the
"lottery": how often two independent halves of the bootstrap draws pick different candidates.

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.select_study --run \
        [--layers 1,2]
    .venv/bin/python -m bench.accuracy.select_study --report
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.accuracy.select_study --outside
        # cells not chosen on
"""

from __future__ import annotations

import itertools
import pickle
import time
from pathlib import Path

import numpy as np

from aggregator.estimate import cap_total, cumulative_from_counts, cumulative_l1
from aggregator.intervals import simulate_from_cumulative
from aggregator.counter_model import loglik as _loglik
from aggregator.selection import CANDIDATES, _estimates, _minimax, _regrets as _stand_in_regrets
from bench.accuracy import grid
from bench.harness import parser

OUT = Path(__file__).resolve().parents[2] / "out" / "select_study.pkl"
RESULTS = OUT.with_name("grid_results.pkl")
PILOTS = ("deconvolution", "mle")
STANDIN_CAPS = ("scale", "items")
SIMS = 4
METHODS = tuple(dict.fromkeys(m for m, _ in CANDIDATES))


def study_cell(cell, reps, layers) -> dict:
    """{(rep, layers): {"true", "boot", "loglik"}} for one direct cell."""
    out = {}
    p, D, n = cell.p, cell.D, cell.n
    for rep in reps:
        h, _, rng = grid.draw(cell, rep)
        truth = cumulative_from_counts(h)
        for k in grid.LAYERS:  # draw every layer count in the grid's order: same counters
            vc = grid._noisy(rng, h, D - len(h), p, k)
            if k not in layers:
                continue
            fits = _estimates(vc, p, k, METHODS)
            true = {c: cumulative_l1(cap_total(fits[c[0]], n, c[1]), truth) for c in CANDIDATES}
            boot, ll = {}, {}
            srng = np.random.default_rng([rep, k, 12345])
            for pm, sc in itertools.product(PILOTS, STANDIN_CAPS):
                y_p = cap_total(fits[pm], n, sc)
                ll[(pm, sc)] = _loglik(vc, y_p, D, p, k)
                total = int(y_p.sum())
                errs = []
                for _ in range(SIMS):
                    ests = _estimates(simulate_from_cumulative(srng, y_p, D, p, k), p, k, METHODS)
                    errs.append(
                        {
                            c: cumulative_l1(cap_total(ests[c[0]], total, c[1]), y_p)
                            for c in CANDIDATES
                        }
                    )
                boot[(pm, sc)] = errs
            out[(rep, k)] = dict(true=true, boot=boot, loglik=ll)
    return out


def run(layers) -> None:
    with open(RESULTS, "rb") as f:
        stored = pickle.load(f)["results"]
    state = pickle.load(open(OUT, "rb")) if OUT.exists() else {}
    todo = [r for r in stored.values() if r.cell.mode == "direct"]
    todo.sort(key=lambda r: np.mean(r.seconds.get((1, "auto"), [1.0])))  # cheap cells first
    for i, r in enumerate(todo):
        want = [
            k
            for k in layers
            if any(key[0] == k for key in r.l1)
            and any((rep, k) not in state.get(r.cell.key, {}) for rep in range(len(r.items)))
        ]
        if not want:
            continue
        t = time.perf_counter()
        got = study_cell(r.cell, range(len(r.items)), want)
        state.setdefault(r.cell.key, {}).update(got)
        pickle.dump(state, open(OUT.with_suffix(".tmp"), "wb"))
        OUT.with_suffix(".tmp").replace(OUT)
        print(
            f"{i + 1}/{len(todo)} {r.cell.dist} n={r.cell.n} D={r.cell.D} eps={r.cell.eps} "
            f"layers {want}: {time.perf_counter() - t:.1f} s",
            flush=True,
        )


def relik() -> None:
    """Recompute every stored ``loglik`` with the current ``counter_model.loglik`` (the real
    counters' fits only: cheap next to the bootstrap)."""
    with open(RESULTS, "rb") as f:
        stored = pickle.load(f)["results"]
    state = pickle.load(open(OUT, "rb"))
    for key, d in state.items():
        cell = stored[key].cell
        for rep in sorted({rep for rep, _ in d}):
            h, _, rng = grid.draw(cell, rep)
            for k in grid.LAYERS:
                vc = grid._noisy(rng, h, cell.D - len(h), cell.p, k)
                if (rep, k) in d:
                    fits = _estimates(vc, cell.p, k, PILOTS)
                    d[(rep, k)]["loglik"] = {
                        (pm, sc): _loglik(vc, cap_total(fits[pm], cell.n, sc), cell.D, cell.p, k)
                        for pm, sc in itertools.product(PILOTS, STANDIN_CAPS)
                    }
    pickle.dump(state, open(OUT.with_suffix(".tmp"), "wb"))
    OUT.with_suffix(".tmp").replace(OUT)


def outside(reps: int = 6) -> None:
    """The product's ``auto`` against the previous rule (thinned stand-ins, two draws) and
    thinned stand-ins with four draws, on the coverage cells' counters (bench/accuracy/grid.py
    ``coverage_cells``, direct; not the cells the rule was chosen on): mean l1 error per
    rule and layer count."""
    from aggregator import selection as S

    rules = {
        "now": (S._standin_cap, S.SIMS),
        "before": (lambda *a: "scale", 2),
        "thinned, 4 draws": (lambda *a: "scale", 4),
    }
    now = S._standin_cap
    try:
        for cell in [c for c in grid.coverage_cells(False) if c.mode == "direct"]:
            err: dict = {}
            for rep in range(min(cell.reps, reps)):
                h, _, rng = grid.draw(cell, rep)
                truth = cumulative_from_counts(h)
                for k in (1, 2):
                    vc = grid._noisy(rng, h, cell.counters - len(h), cell.p, k)
                    for name, (rule, sims) in rules.items():
                        S._standin_cap = rule
                        y, _ = S.select(vc, cell.p, layers=k, n=cell.n, sims=sims)
                        err.setdefault((name, k), []).append(cumulative_l1(y, truth))
            print(
                f"{cell.dist} n={cell.n:.0e} D={cell.D:.0e} eps={cell.eps:g}: "
                + ", ".join(f"{name} {k}L {np.mean(v):.0f}" for (name, k), v in err.items()),
                flush=True,
            )
    finally:
        S._standin_cap = now


# ---------------------------------------------------------------------------------------------
# rules: (boot, loglik, sims) -> candidate
# ---------------------------------------------------------------------------------------------
def _regrets(boot, standins, candidates, sims) -> dict:
    """{candidate: [regret under each stand-in]}: summed error over the draws ``sims`` against
    the best candidate's under that stand-in."""
    reg = {c: [] for c in candidates}
    for s in standins:
        for c, r in _stand_in_regrets(
            {c: sum(boot[s][i][c] for i in sims) for c in candidates}
        ).items():
            reg[c].append(r)
    return reg


def minimax(boot, standins, candidates, sims):
    """The rule of ``selection._select``: the smallest worst regret over the stand-ins (ties:
    mean regret)."""
    return _minimax(_regrets(boot, standins, candidates, sims))


def meanreg(boot, standins, candidates, sims):
    """The candidate with the smallest mean regret over the stand-ins."""
    reg = _regrets(boot, standins, candidates, sims)
    return min(candidates, key=lambda c: float(np.mean(reg[c])))


def per_pilot_cap(ll, T):
    """Per pilot, the stand-in capped by ``items`` if its log-likelihood beats the one capped by
    ``scale`` by more than T, else the ``scale`` one."""
    return [
        (pm, "items" if ll[(pm, "items")] > ll[(pm, "scale")] + T else "scale") for pm in PILOTS
    ]


def both_or_none(ll, T):
    """Both pilots capped by ``items`` if that beats ``scale`` by more than T for each, else both
    by ``scale``."""
    cap = "items" if all(ll[(pm, "items")] > ll[(pm, "scale")] + T for pm in PILOTS) else "scale"
    return [(pm, cap) for pm in PILOTS]


def some_and_none_against(ll, T):
    """Both pilots capped by ``items`` if that beats ``scale`` by more than T for some pilot and
    loses by more than T for none (a pilot whose total is under n is the same either way)."""
    gaps = [ll[(pm, "items")] - ll[(pm, "scale")] for pm in PILOTS]
    cap = "items" if max(gaps) > T and min(gaps) >= -T else "scale"
    return [(pm, cap) for pm in PILOTS]


def binding_all(ll, T):
    """Both pilots capped by ``items`` if that beats ``scale`` by more than T for every pilot
    whose two capped stand-ins differ (its total exceeds n), and some pilot's do
    (``selection._standin_cap``)."""
    gaps = [ll[(pm, "items")] - ll[(pm, "scale")] for pm in PILOTS]
    gaps = [g for g in gaps if g != 0.0]
    cap = "items" if gaps and min(gaps) > T else "scale"
    return [(pm, cap) for pm in PILOTS]


def plausible(ll, standins, slack):
    """The stand-ins whose log-likelihood is within ``slack`` of the best one's."""
    best = max(ll[s] for s in standins)
    return [s for s in standins if ll[s] >= best - slack]


ITEMS = tuple(c for c in CANDIDATES if c[1] == "items")
ALL_S = tuple(itertools.product(PILOTS, STANDIN_CAPS))
SCALE_S = tuple((pm, "scale") for pm in PILOTS)
ITEMS_S = tuple((pm, "items") for pm in PILOTS)


def rules():
    """name -> f(boot, loglik, sims) (sims: the draws the rule may use)."""
    r = {
        "current (scale stand-ins, 6 cand.)": lambda b, ll, s: minimax(b, SCALE_S, CANDIDATES, s),
        "items stand-ins, 6 cand.": lambda b, ll, s: minimax(b, ITEMS_S, CANDIDATES, s),
        "4 stand-ins, 6 cand.": lambda b, ll, s: minimax(b, ALL_S, CANDIDATES, s),
        "scale stand-ins, items cand.": lambda b, ll, s: minimax(b, SCALE_S, ITEMS, s),
        "4 stand-ins, items cand.": lambda b, ll, s: minimax(b, ALL_S, ITEMS, s),
    }
    for slack in (2.0, 10.0, 50.0):
        r[f"4 stand-ins within {slack:g} loglik, 6 cand."] = lambda b, ll, s, sl=slack: minimax(
            b, plausible(ll, ALL_S, sl), CANDIDATES, s
        )
    r["mean regret, scale stand-ins, 6 cand."] = lambda b, ll, s: meanreg(b, SCALE_S, CANDIDATES, s)
    r["mean regret, 4 stand-ins, 6 cand."] = lambda b, ll, s: meanreg(b, ALL_S, CANDIDATES, s)
    r["likeliest stand-in, 6 cand."] = lambda b, ll, s: minimax(
        b, plausible(ll, ALL_S, 0.0), CANDIDATES, s
    )
    r["likeliest pilot's cap + both pilots, 6 cand."] = lambda b, ll, s: minimax(
        b, [(pm, max(ll, key=ll.get)[1]) for pm in PILOTS], CANDIDATES, s
    )
    for T in (5.0, 20.0, 100.0, 300.0, 1000.0):
        r[f"per pilot: items stand-in if loglik > scale's + {T:g}, 6 cand."] = (
            lambda b, ll, s, T=T: minimax(b, per_pilot_cap(ll, T), CANDIDATES, s)
        )
        r[f"scale stand-ins unless items' loglik > + {T:g} for both, 6 cand."] = (
            lambda b, ll, s, T=T: minimax(b, both_or_none(ll, T), CANDIDATES, s)
        )
        r[f"scale stand-ins unless items' loglik > + {T:g} for every binding pilot"] = (
            lambda b, ll, s, T=T: minimax(b, binding_all(ll, T), CANDIDATES, s)
        )
        r[f"scale stand-ins unless items' loglik > + {T:g} for one, < - {T:g} for none"] = (
            lambda b, ll, s, T=T: minimax(b, some_and_none_against(ll, T), CANDIDATES, s)
        )
    for m in ("deconvolution", "mle"):
        r[f"fixed {m} / items"] = lambda b, ll, s, m=m: (m, "items")
    return r


def report(layers) -> None:
    with open(RESULTS, "rb") as f:
        stored = pickle.load(f)["results"]
    state = pickle.load(open(OUT, "rb"))
    half = (range(0, SIMS // 2), range(SIMS // 2, SIMS))
    for k in layers:
        rows = {}
        lottery = {}
        cells = [key for key, d in state.items() if any(kk == k for (_, kk) in d)]
        for name, rule in rules().items():
            regs, differ = [], 0
            for key in cells:
                d = {rep: v for (rep, kk), v in state[key].items() if kk == k}
                r = stored[key]
                oracle = min(
                    float(np.mean(v))
                    for (kk, m, cap), v in r.l1.items()
                    if kk == k and cap != "none"
                )
                oracle = min(
                    oracle,
                    min(float(np.mean([d[rep]["true"][c] for rep in d])) for c in CANDIDATES),
                )
                e_full = np.mean(
                    [
                        d[rep]["true"][rule(d[rep]["boot"], d[rep]["loglik"], range(SIMS))]
                        for rep in d
                    ]
                )
                e_half = np.mean(
                    [d[rep]["true"][rule(d[rep]["boot"], d[rep]["loglik"], half[0])] for rep in d]
                )
                differ += sum(
                    rule(d[rep]["boot"], d[rep]["loglik"], half[0])
                    != rule(d[rep]["boot"], d[rep]["loglik"], half[1])
                    for rep in d
                )
                regs.append(
                    (
                        e_full / oracle if oracle > 0 else 1.0,
                        e_half / oracle if oracle > 0 else 1.0,
                        key,
                    )
                )
            a = np.array([x[0] for x in regs])
            b = np.array([x[1] for x in regs])
            worst = max(regs, key=lambda x: x[0])
            rows[name] = (
                a.max(),
                np.exp(np.log(a).mean()),
                b.max(),
                np.exp(np.log(b).mean()),
                worst[2],
                int((a > 1.1).sum()),
                int((a > 2).sum()),
            )
            lottery[name] = differ
        print(f"\n### direct, {k} layer{'s' if k > 1 else ''} ({len(cells)} cells)\n")
        print(
            f"| rule | worst regret ({SIMS} draws) | geo-mean | worst ({SIMS // 2} draws) | "
            f"geo-mean | worst cell | cells > 1.1 | cells > 2 | halves disagree |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for name, v in sorted(rows.items(), key=lambda kv: kv[1][0]):
            print(
                f"| {name} | {v[0]:.2f} | {v[1]:.3f} | {v[2]:.2f} | {v[3]:.3f} | "
                f"{v[4][1]} n={v[4][2]:.0e} D={v[4][3]:.0e} eps={v[4][4]:g} | {v[5]} | {v[6]} | "
                f"{lottery[name]} |"
            )


# the three worst cells of bench.accuracy.lofo (docs/accuracy_grid.md, "Sixteen repetitions"):
# (dist, n, D, eps, layers); the early-stopped EM is best in the second, the NPMLE in the first
LR_CELLS = (
    ("heavy", 10**5, 10**6, 0.5, 2),
    ("zipf1.5", 10**5, 10**6, 2.0, 1),
    ("zipf0.7", 10**5, 10**6, 0.5, 2),
)


def lr_check(reps: int = 4, sims: int = 4) -> None:
    """Can the counters tell which stand-in is nearer the truth? A calibrated likelihood-ratio
    check: G = LL(NPMLE fit) - LL(early-stopped EM fit) on the counters, against G on states
    simulated from each stand-in (as ``selection._select`` simulates them); a stand-in whose
    simulated G is far from the observed one (|z| large) would be implausible and could leave the
    minimax. Prints, per window, G, each stand-in's simulated G (mean +- sd, z) and the two fits'
    l1 errors against the truth."""
    from aggregator.counter_model import loglik, simulate_from_cumulative
    from aggregator.estimate import _data_seed, cumulative_from_counts, noisy_value_counts
    from aggregator.selection import PILOTS, _estimates, _standin_cap

    from .grid import Cell, _noisy, draw

    print(
        "| cell | window | G observed | EM stand-in: G simulated, z | NPMLE stand-in: G "
        "simulated, z | l1 error EM / NPMLE (items cap) |"
    )
    print("|---|---|---|---|---|---|")
    for dist, n, D, eps, k in LR_CELLS:
        cell = Cell("direct", dist, n, D, eps, reps)
        p = cell.p
        for rep in range(reps):
            h, _, rng = draw(cell, rep)
            truth = cumulative_from_counts(h)
            for kk in (1, 2):  # the grid's draws: the 1-layer counters first
                vc = noisy_value_counts(_noisy(rng, h, D - len(h), p, kk))
                if kk == k:
                    break
            fits = _estimates(vc, p, k, ["deconvolution", "mle"])
            g_obs = loglik(vc, fits["mle"], D, p, k) - loglik(vc, fits["deconvolution"], D, p, k)
            cap = _standin_cap(vc, fits, PILOTS, n, p, k)
            srng = np.random.default_rng(_data_seed(vc))
            cols = []
            for pm in PILOTS:
                y_p = cap_total(fits[pm], n, cap)
                g = []
                for _ in range(sims):
                    sim = simulate_from_cumulative(srng, y_p, D, p, k)
                    e = _estimates(sim, p, k, ("deconvolution", "mle"))
                    g.append(
                        loglik(sim, e["mle"], D, p, k) - loglik(sim, e["deconvolution"], D, p, k)
                    )
                g = np.array(g)
                z = (g_obs - g.mean()) / max(float(g.std(ddof=1)), 1e-9)
                cols.append(f"{g.mean():.1f} +- {g.std(ddof=1):.1f}, z = {z:+.1f}")
            errs = [cumulative_l1(cap_total(fits[m], n, "items"), truth) for m in PILOTS]
            print(
                f"| {dist} n={n:.0e} D={D:.0e} eps={eps:g}, {k} layer{'s' * (k > 1)} | {rep} | "
                f"{g_obs:.1f} | {cols[0]} | {cols[1]} | {errs[0]:,.0f} / {errs[1]:,.0f} |"
            )


def em_tail(reps: int = 2) -> None:
    """The heavy cell of LR_CELLS (where the converged NPMLE is best): each fit's l1 error with
    the ``items`` cap, and where the early-stopped EM's error sits (phi_{>=r} at a few r);
    the EM held to n (bench.accuracy.lofo's ``em_held``, ``auto_em_held``) beside the library's."""
    from aggregator.estimate import cap_total, cumulative_from_counts, cumulative_l1

    from . import lofo
    from .grid import Cell, _noisy, draw

    dist, n, D, eps, _ = LR_CELLS[0]
    cell = Cell("direct", dist, n, D, eps, reps)
    methods = ("deconvolution", "mle", "auto", "em_held", "auto_em_held")
    rs = (1, 2, 3, 5, 10, 15, 30)
    print("| repetition, layers | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    shapes = []
    for rep in range(reps):
        h, _, rng = draw(cell, rep)
        truth = cumulative_from_counts(h)
        for k in (1, 2):  # the grid's draws: the 1-layer counters first
            vc = _noisy(rng, h, D - len(h), cell.p, k)
            row = []
            for m in methods:
                y = lofo._estimate_y("direct", vc, cell.p, k, m, n, None)
                capped = cap_total(y, n, "items")
                row.append(f"{cumulative_l1(capped, truth):,.0f} (total {y.sum() / n:.2f} n)")
                if rep == 0 and k == 1 and m in ("deconvolution", "mle"):
                    shapes.append((m, y, capped))
            print(f"| {rep + 1}, {k} | " + " | ".join(row) + " |", flush=True)
    at = lambda y, r: y[r - 1] if r - 1 < len(y) else 0  # noqa: E731
    h, _, _ = draw(cell, 0)
    truth = cumulative_from_counts(h)
    print("\n| r | " + " | ".join(str(r) for r in rs) + " |")
    print("|---" * (len(rs) + 1) + "|")
    for name, y in [("truth", truth)] + [
        (f"{m}{', items cap' if c else ''}", yy)
        for m, y, capped in shapes
        for c, yy in ((False, y), (True, capped))
    ]:
        print(f"| {name} | " + " | ".join(f"{at(y, r):,.0f}" for r in rs) + " |")


def starts(reps: int = 2) -> None:
    """The early-stopped EM from its two starts on the three cells of LR_CELLS (repetitions
    1-2, 1 and 2 layers, the grid's draws): the l1 error with the better of the two caps, and
    the counters' log-likelihood of each fit capped at n by ``items`` (what bench.accuracy.lofo's
    ``em_likelier`` compares). The shrunk start with direct mode's 1e-4 of the smoothed one
    mixed in (``estimate.DIRECT_START_SMOOTH_SHARE``); hashed mode's 5% share beside it."""
    from aggregator.counter_model import loglik
    from aggregator.estimate import (
        cap_total,
        cumulative_from_counts,
        cumulative_l1,
        deconvolved_prevalence,
        project_l1,
    )

    from . import lofo
    from .grid import Cell, _noisy, draw

    print(
        "| cell | repetition, layers | smoothed start: error, LL | shrunk, 5% smoothed: error "
        "| shrunk, 1e-4 smoothed: error, LL | LL(shrunk) - LL(smoothed) |"
    )
    print("|---|---|---|---|---|---|")
    for dist, n, D, eps, _ in LR_CELLS:
        cell = Cell("direct", dist, n, D, eps, reps)
        for rep in range(reps):
            h, _, rng = draw(cell, rep)
            truth = cumulative_from_counts(h)
            for k in (1, 2):  # the grid's draws: the 1-layer counters first
                vc = _noisy(rng, h, D - len(h), cell.p, k)
                fits = [
                    project_l1(deconvolved_prevalence(vc, cell.p, layers=k)),
                    project_l1(deconvolved_prevalence(vc, cell.p, layers=k, shrunk_start=True)),
                    lofo._shrunk_em(vc, cell.p, k),
                ]
                err = [
                    min(cumulative_l1(cap_total(y, n, c), truth) for c in ("items", "scale"))
                    for y in fits
                ]
                ll = [loglik(vc, cap_total(y, n, "items"), D, cell.p, k) for y in fits]
                print(
                    f"| {dist} n = {n:.0e}, D = {D:.0e}, eps {eps:g} | {rep + 1}, {k} | "
                    f"{err[0]:,.0f}, {ll[0]:,.1f} | {err[1]:,.0f} | {err[2]:,.0f}, {ll[2]:,.1f} "
                    f"| {ll[2] - ll[0]:+.1f} |",
                    flush=True,
                )


def smoke() -> None:
    """--smoke: the grid's direct smoke cell run (1 layer) into out/, as the stored grid this
    study reads, then --run and --report on it."""
    global OUT, RESULTS
    OUT = Path("out") / "select_study_smoke.pkl"
    RESULTS = OUT.with_name("grid_results_select_smoke.pkl")
    OUT.parent.mkdir(exist_ok=True)
    OUT.unlink(missing_ok=True)
    cells = [c for c in grid.grid_cells("smoke") if c.mode == "direct"]
    RESULTS.write_bytes(
        pickle.dumps({"results": {c.key: grid.run_cell(c, layers=(1,)) for c in cells}})
    )
    run([1])
    report([1])


def main(argv=None) -> None:
    ap = parser(__doc__, "the grid's direct smoke cell, 1 layer, --run and --report, in out/")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--relik", action="store_true", help="recompute the stored log-likelihoods")
    ap.add_argument(
        "--outside",
        action="store_true",
        help="auto now vs before on the coverage cells (not the study's cells)",
    )
    ap.add_argument(
        "--lr-check",
        action="store_true",
        help="can a calibrated likelihood ratio tell the stand-ins apart? (the "
        "three worst cells of bench.accuracy.lofo)",
    )
    ap.add_argument(
        "--em-tail",
        action="store_true",
        help="the heavy cell: where the early-stopped EM's error sits, and the EM "
        "held to n (tried, not adopted)",
    )
    ap.add_argument(
        "--starts",
        action="store_true",
        help="the early-stopped EM from the smoothed and the shrunk start on the "
        "three worst cells of bench.accuracy.lofo: errors and likelihoods",
    )
    ap.add_argument("--layers", default="1,2,3,6")
    a = ap.parse_args(argv)
    if a.smoke:
        smoke()
        return
    layers = [int(x) for x in a.layers.split(",")]
    if a.run:
        run(layers)
    if a.relik:
        relik()
    if a.report:
        report(layers)
    if a.outside:
        outside()
    if a.lr_check:
        lr_check()
    if a.em_tail:
        em_tail()
    if a.starts:
        starts()


if __name__ == "__main__":
    main()
