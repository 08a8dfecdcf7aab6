"""Driver of the accuracy grid (bench/accuracy/grid.py): run it, choose the defaults, write the
report.

Run from the repository root (one process; on a shared machine with ``nice``)::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 nice -n 15 \
        .venv/bin/python -m bench.accuracy.accuracy_grid
    ... -m bench.accuracy.accuracy_grid --quick     # smoke run: out/accuracy_grid.md, out/img/
    ... -m bench.accuracy.accuracy_grid --report    # re-render from out/grid_results.pkl, no run

The run is resumable: every finished cell is saved to out/grid_results.pkl (out/ is git-ignored)
and skipped on the next start. Writes docs/accuracy_grid.md, docs/img/grid_regret.png,
docs/img/grid_snr.png and bench/accuracy/grid_defaults.json (the chosen defaults, which
tests/test_grid_defaults.py checks against aggregator.estimators.DEFAULT_METHODS).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

from aggregator.estimators import default_cap, default_method

from . import grid
from ..harness import cpu_model, git_rev, mean_se, parse_shard, parser, shard_arg, versions

METHODS = grid.METHODS

T0 = time.perf_counter()
RESULTS = Path("out") / "grid_results.pkl"
DEFAULTS_JSON = Path("bench") / "accuracy" / "grid_defaults.json"


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def load(path: Path) -> dict:
    if path.exists():
        with open(path, "rb") as f:
            return pickle.load(f)
    return {"results": {}, "runs": []}


def save(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(state, f)
    os.replace(tmp, path)


def cell_cost(c) -> float:
    """Rough relative run time of a grid cell (for ordering only)."""
    span = 1.0 + (c.n / c.D if c.D else 1.0)
    return c.reps * min(span, 30.0) / (1.0 - c.p) * math.log10(max(c.counters, 10))


def shard_paths(path: Path) -> list:
    return sorted(path.parent.glob(path.stem + "_shard*.pkl"))


def merge_shards(path: Path) -> dict:
    """Fold the results of ``--shard`` runs into the main results file."""
    state = load(path)
    for sp in shard_paths(path):
        part = load(sp)
        for key, res in part["results"].items():
            state["results"].setdefault(key, res)
        for key, res in part.get("coverage", {}).items():
            state.setdefault("coverage", {}).setdefault(key, res)
        state["runs"] += [r for r in part["runs"] if r not in state["runs"]]
    save(state, path)
    return state


def run(quick: bool, path: Path, shard: str | None = None) -> dict:
    state = load(path)
    cells = grid.grid_cells(quick)
    done = set(state["results"])
    if shard:  # "i/N": every N-th cell not yet in the main file, into a file of its own
        i, N = parse_shard(shard)
        others = set()
        for sp in shard_paths(path):
            others |= set(load(sp)["results"])
        # cheapest first (wide noise, long value spans and many counters cost most), so that a
        # run cut short loses the most expensive cells, not a whole part of the design
        cells = sorted(
            (c for c in cells if c.key not in done and c.key not in others), key=cell_cost
        )[i::N]
        path = path.with_name(f"{path.stem}_shard{i}of{N}b.pkl")
        state = load(path)
    todo = [c for c in cells if c.key not in state["results"] and c.key not in done]
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load0 = os.getloadavg()
    log(f"{len(cells)} cells, {len(todo)} to run -> {path}")
    t_run = time.perf_counter()
    for i, cell in enumerate(todo):
        t = time.perf_counter()
        state["results"][cell.key] = grid.run_cell(cell, layers=LAYERS)
        save(state, path)
        log(
            f"{i + 1}/{len(todo)} {cell.mode} {cell.dist} n={cell.n:g} D={cell.D or '-'} "
            f"eps={cell.eps} reps={cell.reps}: {time.perf_counter() - t:.1f} s"
        )
    if todo:
        state["runs"].append(
            dict(
                started=started,
                seconds=time.perf_counter() - t_run,
                cells=len(todo),
                load0=load0,
                load1=os.getloadavg(),
                rev=git_rev(["aggregator", "bench"]),
            )
        )
        save(state, path)
    return state


# --------------------------------------------------------------------------------------------
# timing at D = 1e7 and coverage runs
# --------------------------------------------------------------------------------------------
TIME_REPS = 3
TIME_LAYERS = (1, 2, 3, 4, 5, 6)


def _timed(fn) -> float:
    """Seconds of one cold call (nothing is kept between calls: a release's memo goes with it)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_timing(quick: bool) -> dict:
    """Release time on full counter arrays: direct D = 1e7 counters (n = 1e7 Zipf(1.1) events
    over them, as docs/speed.md) and hashed n = 1e7, B = choose_buckets(n) = 2e7; eps = 1; each
    layer count; every method with the default cap and the defaults; np.bincount over the same
    array as the baseline; repetitions interleaved, medians."""
    from aggregator import largedomain as ld
    from aggregator.anonymize import anonymized_histogram
    from aggregator.intervals import error_bars
    from aggregator.noise import p_from_epsilon

    from .._data import true_counts
    from .largedomain import dlap, items_counts

    n = 10**5 if quick else 10**7
    eps = 1.0
    p = p_from_epsilon(eps)
    rng = np.random.default_rng([grid.SEED, 99])
    setups = {"direct": (true_counts(rng, "zipf", n, n), None)}
    _, h = items_counts(rng, n, "zipf")
    B = ld.choose_buckets(n, eps)
    setups["hashed"] = (
        np.bincount(rng.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64),
        B,
    )
    rows = []
    for mode, (true, buckets) in setups.items():
        for k in TIME_LAYERS:
            x = true + dlap(rng, p, len(true), k)
            calls = {
                "bincount": lambda: np.bincount(x - x.min()),
                "default": lambda: anonymized_histogram(x, p, layers=k, n=n, buckets=buckets),
            }
            for m in METHODS + ("xfit",) if k <= 2 else ("threshold",):
                calls[m] = lambda m=m: anonymized_histogram(
                    x, p, layers=k, n=n, buckets=buckets, method=m
                )
            if k <= 2 and mode == "direct":
                calls["error bars (10 reps)"] = lambda: error_bars(
                    x, p, layers=k, n=n, buckets=buckets, reps=10, rng=0
                )
            times = {name: [] for name in calls}
            for i in range(TIME_REPS if not quick else 1):
                for name, fn in calls.items():
                    if i and name not in ("bincount", "default", "threshold", "wupagh"):
                        continue  # one run of the slow calls (minutes in all otherwise)
                    times[name].append(_timed(fn))
            rows.append(
                dict(
                    mode=mode,
                    layers=k,
                    counters=len(x),
                    method=default_method(mode, k),
                    times=times,
                    load=os.getloadavg(),
                )
            )
            log(
                f"timing {mode} k={k}: "
                + ", ".join(f"{a} {np.median(b):.2f}s" for a, b in times.items())
            )
            x = None  # free the counters before the next layer count
    return dict(
        n=n,
        eps=eps,
        B=B,
        rows=rows,
        started=datetime.datetime.now().isoformat(timespec="seconds"),
        rev=git_rev(["aggregator", "bench"]),
    )


def refine(state: dict, path: Path, factor: float = 1.5, top: int = 3, min_reps: int = 8) -> None:
    """One round of extra repetitions in the cells that decide each (mode, layers) choice
    (``grid.decisive_cells``): each such cell goes to max(2 reps, ``min_reps``) repetitions."""
    results = ordered(state)
    an = analyse(results)
    todo = set()
    for a in an.values():
        todo |= grid.decisive_cells(a["reg"], ADMISSIBLE, factor, top)
    log(f"refining {len(todo)} cells")
    done = []
    for i in sorted(todo):
        r = results[i]
        have = len(r.items)
        want = max(2 * have, min_reps)
        t = time.perf_counter()
        extra = grid.run_cell(r.cell, reps=range(have, want))
        state["results"][r.cell.key] = grid.merge(r, extra)
        done.append((r.cell.key, have, want))
        save(state, path)
        log(
            f"refined {cell_label(r.cell)} ({r.cell.mode}): {have} -> {want} reps, "
            f"{time.perf_counter() - t:.0f} s"
        )
    after = analyse(ordered(state))
    state.setdefault("refined", []).append(
        dict(
            cells=done,
            factor=factor,
            top=top,
            min_reps=min_reps,
            rev=git_rev(["aggregator", "bench"]),
            started=datetime.datetime.now().isoformat(timespec="seconds"),
            before={k: a["choice"] for k, a in an.items()},
            after={k: a["choice"] for k, a in after.items()},
        )
    )
    save(state, path)


RERUN = RESULTS.with_name("grid_rerun.pkl")
RERUN_METHODS = ("deconvolution", "mle", "auto")  # the candidates an EM change moves
RERUN_LAYERS = (1, 2)


def rerun_path(path: Path) -> Path:
    return path.with_name(path.stem.replace("grid_results", "grid_rerun") + ".pkl")


def _run_again(todo: list, part: dict, out: Path, methods, layers, what: str) -> None:
    """Run ``methods`` at ``layers`` (those each cell was stored with) on the stored cells
    ``todo`` with their own repetitions, so the same noisy counters, into ``part``, saved to
    ``out`` after each cell (resumable) and recorded with the code this process imported."""
    log(f"{what} of {tuple(methods)} at layers {tuple(layers)}: {len(todo)} cells -> {out}")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t_run, rev = time.perf_counter(), git_rev(["aggregator", "bench"])
    for i, r in enumerate(todo):
        t = time.perf_counter()
        have = tuple(k for k in layers if any(key[0] == k for key in r.l1))
        part["results"][r.cell.key] = grid.run_cell(
            r.cell, layers=have, methods=methods, reps=range(len(r.items))
        )
        save(part, out)
        log(
            f"{what} {i + 1}/{len(todo)} {r.cell.mode} {cell_label(r.cell)}: "
            f"{time.perf_counter() - t:.1f} s"
        )
    if todo:
        part["runs"].append(
            dict(
                started=started,
                seconds=time.perf_counter() - t_run,
                cells=len(todo),
                rev=rev,
                methods=list(methods),
                layers=list(layers),
                load=os.getloadavg(),
            )
        )
        save(part, out)


def run_rerun(state: dict, path: Path, modes=("direct", "hashed")) -> dict:
    """The EM-based candidates again, with the current code, on every stored cell of ``modes``
    and the same noisy counters (each repetition's generator draws the counters of layers 1, 2,
    3, 6 in that order, so layers 1 and 2 come out the same): an estimator change measured cell
    by cell against the stored run. Resumable; saved to out/grid_rerun.pkl."""
    rr = load(path)
    todo = [r for r in ordered(state) if r.cell.mode in modes and r.cell.key not in rr["results"]]
    _run_again(todo, rr, path, RERUN_METHODS, RERUN_LAYERS, "rerun")
    return rr


def replace_path(path: Path, shard: str) -> Path:
    i, N = parse_shard(shard)
    return path.with_name(f"{path.stem}_replace{i}of{N}.pkl")


def run_replace(state: dict, path: Path, methods, layers, shard: str = "0/1") -> None:
    """Re-run ``methods`` at ``layers`` with the current code on every stored cell's own noisy
    counters (the grid's seeds: the same draws) into a file of its own, every N-th cell of shard
    i/N (cheapest first); ``--replace-merge`` then puts them in place of the stored entries. For
    an estimator change that the whole report should show, not only the ``--rerun`` section."""
    i, N = parse_shard(shard)
    out = replace_path(path, shard)
    part = load(out)
    mine = sorted(ordered(state), key=lambda r: cell_cost(r.cell))[i::N]
    _run_again(
        [r for r in mine if r.cell.key not in part["results"]],
        part,
        out,
        methods,
        layers,
        "replace",
    )


def merge_replace(path: Path) -> None:
    """Put the ``--replace`` files' entries in place of the stored ones (same cells, same
    repetitions, same counters), and record what was replaced for the report's header."""
    state = load(path)
    for rp in sorted(path.parent.glob(path.stem + "_replace*of*.pkl")):
        part = load(rp)
        for key, new in part["results"].items():
            old = state["results"][key]
            if new.items != old.items:
                raise SystemExit(f"{rp.name}: {key} has other draws than the stored run")
            for name in ("l1", "seconds", "total"):
                getattr(old, name).update(getattr(new, name))
        state.setdefault("replaced", []).extend(
            dict(r, cells=len(part["results"])) for r in part["runs"]
        )
        save(state, path)
        rp.rename(rp.with_suffix(".merged"))


def run_coverage(quick: bool, state: dict, path: Path, cells=None) -> dict:
    cov = state.setdefault("coverage", {})
    for cell in grid.coverage_cells(quick) if cells is None else cells:
        if cell.key in cov:
            continue
        t = time.perf_counter()
        cov[cell.key] = dict(
            cell=cell,
            out=grid.run_coverage(cell),
            rev=git_rev(["aggregator", "bench"]),
            defaults={k: default_method(cell.mode, k) for k in (1, 2)},
        )
        save(state, path)
        log(f"coverage {cell_label(cell)}: {time.perf_counter() - t:.0f} s")
    return cov


# --------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------
ADMISSIBLE = tuple((m, c) for m in METHODS for c in grid.ADMISSIBLE_CAPS)


#: the layer counts run (--smoke: 1 and 2)
LAYERS = grid.LAYERS
#: the grid whose order the report follows (--smoke: its own two cells; the full grid's real
#: profiles need the bench extra)
ORDER: bool | str = False


def ordered(state: dict) -> list:
    """Results in grid order (cells of the current grid first, then any others)."""
    res = state["results"]
    keys = [c.key for c in grid.grid_cells(ORDER) if c.key in res]
    keys += [k for k in res if k not in set(keys)]
    return [res[k] for k in keys]


def cell_label(cell) -> str:
    size = f"D={cell.D:.0e}" if cell.mode == "direct" else f"B={cell.counters:.0e}"
    return f"{cell.dist} n={cell.n:.0e} {size} eps={cell.eps:g}".replace("e+0", "e")


def cand_label(c) -> str:
    return f"{c[0]} / {c[1]}"


def analyse(results: list) -> dict:
    """Per (mode, layers): regrets of the admissible candidates, the choice, the code default."""
    out = {}
    for mode in ("direct", "hashed"):
        for k in grid.LAYERS:
            err = grid.mean_errors(results, mode, k)
            if not err:
                continue
            reg = grid.regrets(err, ADMISSIBLE)
            worst = grid.worst_regret(reg, ADMISSIBLE)
            geo = grid.geo_regret(reg, ADMISSIBLE)
            cells = sorted({c for (_, c) in reg})
            best_in = {m: sum(1 for c in cells if reg[(m, c)] == 1.0) for m in ADMISSIBLE}
            secs = {
                m: float(
                    np.mean(
                        [
                            s
                            for r in results
                            if r.cell.mode == mode
                            for s in r.seconds.get((k, m), [])
                        ]
                    )
                )
                for m in METHODS
            }
            se = grid.regret_se(results, k, reg, ADMISSIBLE)
            out[(mode, k)] = dict(
                err=err,
                reg=reg,
                worst=worst,
                geo=geo,
                cells=cells,
                se=se,
                best_in=best_in,
                secs=secs,
                tied=grid.tied(reg, ADMISSIBLE, se),
                choice=grid.choose(reg, ADMISSIBLE, se),
                code=(default_method(mode, k), default_cap(mode, k)),
            )
    add_rules(results, out)
    return out


# --------------------------------------------------------------------------------------------
# a rule on the public signal-to-noise ratio (none adopted: the release has no code for one)
# --------------------------------------------------------------------------------------------
def log_snr(cell, k: int) -> float:
    from aggregator.intervals import signal_to_noise

    return math.log(max(signal_to_noise(cell.n, cell.counters, cell.p, k), 1e-6))


def fit_rule(reg: dict, cells: list, feat: dict, cands) -> tuple:
    """(worst regret, geo regret, low candidate, high candidate, cut on log SNR) of the best
    one-split rule: candidate ``low`` below the cut, ``high`` at or above; lowest worst-case
    regret over ``cells``, ties to the lowest geometric mean."""
    cs = sorted(cells, key=lambda c: feat[c])
    f = np.array([feat[c] for c in cs])
    Rm = np.array([[reg[(m, c)] for c in cs] for m in cands])  # cand x cell
    L = np.log(Rm)
    best = (math.inf, math.inf, None, None, None)
    splits = [j for j in range(1, len(cs)) if f[j] > f[j - 1]] + [0, len(cs)]
    for i, lo in enumerate(cands):
        pre = np.maximum.accumulate(Rm[i])
        pre_l = np.cumsum(L[i])
        for j2, hi in enumerate(cands):
            suf = np.maximum.accumulate(Rm[j2][::-1])[::-1]
            suf_l = np.cumsum(L[j2][::-1])[::-1]
            for j in splits:  # cells [0, j) get lo, [j, end) get hi
                w = max(pre[j - 1] if j else 1.0, suf[j] if j < len(cs) else 1.0)
                g = ((pre_l[j - 1] if j else 0.0) + (suf_l[j] if j < len(cs) else 0.0)) / len(cs)
                if (w, g) < best[:2]:
                    cut = (
                        -math.inf
                        if j == 0
                        else math.inf
                        if j == len(cs)
                        else 0.5 * (f[j - 1] + f[j])
                    )
                    best = (w, g, lo, hi, cut)
    return best


def lodo(reg: dict, cells: list, feat: dict, cands, group: dict) -> tuple:
    """Leave one distribution out: fit the rule without a distribution's cells, read its regret
    on them. (worst held-out regret, cell)."""
    worst = (0.0, None)
    for g in sorted({group[c] for c in cells}):
        train = [c for c in cells if group[c] != g]
        test = [c for c in cells if group[c] == g]
        if not train:
            continue
        _, _, lo, hi, cut = fit_rule(reg, train, feat, cands)
        for c in test:
            v = reg[(lo if feat[c] < cut else hi, c)]
            worst = max(worst, (v, c))
    return worst


def add_rules(results: list, an: dict) -> None:
    """Per (mode, layers): the best SNR rule, its leave-one-distribution-out worst case, and the
    effective default (the rule if its held-out worst case beats the fixed choice's worst case,
    else the fixed choice)."""
    for (mode, k), a in an.items():
        cells = a["cells"]
        feat = {c: log_snr(results[c].cell, k) for c in cells}
        group = {c: results[c].cell.dist for c in cells}
        w, g, lo, hi, cut = fit_rule(a["reg"], cells, feat, ADMISSIBLE)
        held = lodo(a["reg"], cells, feat, ADMISSIBLE, group)
        held_fixed = a["worst"][a["choice"]][0]
        a["rule"] = dict(
            worst=w,
            geo=g,
            low=lo,
            high=hi,
            cut=cut,
            lodo=held[0],
            lodo_cell=held[1],
            adopted=bool(held[0] < held_fixed and lo != hi),
        )
        a["effective"] = {
            c: ((lo if feat[c] < cut else hi) if a["rule"]["adopted"] else a["choice"])
            for c in cells
        }
        a["eff_reg"] = {c: a["reg"][(a["effective"][c], c)] for c in cells}


def defaults_json(an: dict) -> dict:
    out = {}
    for (mode, k), a in an.items():
        m, cap = a["choice"]
        w, i = a["worst"][a["choice"]]
        out.setdefault(mode, {})[str(k)] = dict(
            method=m,
            cap=cap,
            worst_regret=round(w, 4),
            geo_regret=round(a["geo"][a["choice"]], 4),
            cells=len(a["cells"]),
            tied=[f"{tm} / {tc}" for tm, tc in a["tied"] if (tm, tc) != (m, cap)],
        )
    return out


def rules_json(an: dict) -> dict:
    out = {}
    for (mode, k), a in an.items():
        r = a.get("rule")
        if r and r["adopted"]:
            out.setdefault(mode, {})[str(k)] = dict(
                snr_cut=round(math.exp(r["cut"]), 4),
                low=list(r["low"]),
                high=list(r["high"]),
                worst_regret=round(r["worst"], 4),
                lodo_worst_regret=round(r["lodo"], 4),
            )
    return out


def snr_rows(results: list, an: dict) -> list:
    """(mode, layers, cell, SNR, relative l1 error of the chosen default, of the best candidate)."""
    from aggregator.intervals import signal_to_noise

    rows = []
    for (mode, k), a in an.items():
        for i in a["cells"]:
            c = results[i].cell
            snr = signal_to_noise(c.n, c.counters, c.p, k)
            rel = a["err"][(a["choice"], i)] / max(c.n, 1)
            best = min(a["err"][(m, i)] for m in ADMISSIBLE) / max(c.n, 1)
            rows.append((mode, k, c, snr, rel, best))
    return rows


def snr_cutoff(rows, col: int = 5, bad: float = 0.5) -> float:
    """Largest SNR at which a cell's relative error (column ``col``: 4 = the chosen default,
    5 = the best candidate) is at least ``bad``."""
    over = [r[3] for r in rows if r[col] >= bad]
    return max(over) if over else 0.0


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def fmt(x: float) -> str:
    if math.isnan(x):
        return "-"
    a = abs(x)
    return f"{x:.3g}" if a < 1000 else f"{x:.0f}"


def write_report(state: dict, outdir: Path, quick: bool = False) -> None:
    results = ordered(state)
    an = analyse(results)
    (outdir / "img").mkdir(parents=True, exist_ok=True)
    _plot_regret(an, outdir / "img" / "grid_regret.png")
    rows = snr_rows(results, an)
    _plot_snr(rows, outdir / "img" / "grid_snr.png")
    dj = defaults_json(an)
    if not quick:
        DEFAULTS_JSON.write_text(
            json.dumps(
                dict(
                    rule="lowest worst-case regret over the grid's cells of the mode and layer "
                    "count; candidates within two standard errors "
                    "of it are tied, and a tie goes to the "
                    "lowest geometric-mean regret",
                    source="docs/accuracy_grid.md",
                    defaults=dj,
                    rules=rules_json(an),
                ),
                indent=1,
            )
            + "\n"
        )
    lines: list[str] = []
    w = lines.append
    runs = state["runs"]
    wall = sum(r["seconds"] for r in runs)
    w("# Accuracy grid: every estimator on the same noisy counters, defaults by worst-case regret")
    w("")
    w("Produced by:")
    w("")
    run = (
        "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 nice -n 15 "
        ".venv/bin/python -m bench.accuracy.accuracy_grid"
    )
    q = " --quick" if quick else ""
    w("```")
    w(f"{run}{q} --run-only             # the grid (resumable)")
    for _ in state.get("refined", []):
        w(f"{run}{q} --refine --run-only    # one refinement round")
    if state.get("coverage"):
        w(f"{run}{q} --coverage --run-only  # error-bar coverage")
    if state.get("timing"):
        w(f"{run}{q} --timing --run-only    # release time at D = 1e7")
    if state.get("replaced"):
        w(f"{run}{q} --replace auto --shard i/2  # an estimator re-run (i = 0, 1), then:")
        w(f"{run}{q} --replace-merge")
    w(f"{run}{q} --report               # this file and bench/accuracy/grid_defaults.json")
    w("```")
    w("")
    for r in runs:
        w(
            f"(run started {r['started']} at commit {r['rev']}; {r['cells']} cells in "
            f"{r['seconds'] / 60:.1f} min; load average {r['load0'][0]:.2f} at start, "
            f"{r['load1'][0]:.2f} at end.)"
        )
    for r in state.get("replaced", []):
        w(
            f"(then {', '.join(r['methods'])} at layers {', '.join(map(str, r['layers']))} re-run "
            f"on the same counters with the code of commit {r['rev']} and put in place of the "
            f"stored entries (`--replace`, started {r['started']}; {r['cells']} cells in "
            f"{r['seconds'] / 60:.1f} min, load average {r['load'][0]:.2f} at end).)"
        )
    w(
        f"({cpu_model()}, {os.cpu_count()} cores; {versions(['numpy', 'scipy'])}; "
        f"{wall / 60:.0f} min of grid in total. Source: `bench/accuracy/grid.py` (cells, pairing, "
        "regret), `bench/accuracy/accuracy_grid.py` (this report). Raw results: "
        "out/grid_results.pkl.)"
    )
    w("")
    w("## Setup")
    w("")
    n_cells = {m: sum(1 for r in results if r.cell.mode == m) for m in ("direct", "hashed")}
    w(
        f"* **Cells** (what a deployment does not choose; {n_cells['direct']} direct, "
        f"{n_cells['hashed']} hashed; `grid.grid_cells`). Direct mode: D counters, items "
        "multinomial over [D] (`bench/_data.py`): Zipf with exponents 0.7, 1.1, 1.5, 2, "
        "geometric, uniform, and *heavy* (5 items holding half the events over a long tail of "
        "singletons), at (D, n) with D/n from 0.01 to 33 and n from 1e3 to 1e7; empty and "
        "near-empty windows (n = 0, 10, 100 over D = 1e5 and 1e6); ten real frequency profiles "
        "shipped in PyPI packages (wordfreq 3.1 English, German, Japanese, Arabic; pyspellchecker "
        "0.9 Spanish, Russian, Persian, Latvian; symspellpy 6.10 English unigrams and bigrams; D = "
        "their vocabulary, n = D/10 and 10 D). Hashed mode: items over an unbounded domain "
        "(Zipf(1.1), Zipf(1.01), Zipf(1.5), mostly distinct; `bench/accuracy/largedomain.py "
        "items_counts`), B = choose_buckets(n) = 2 n counters, n = 1e3..1e7. eps from 0.25 to 4 "
        "(rotating over the cells; p = exp(-eps/2) rounded up, replace-one); 1, 2, 3 and 6 DLap "
        "layers (state-only release; joint model; joint model after one and after four audit "
        "exports). Repetitions: 1-3 per cell (fewer where a cell is expensive)."
    )
    w(
        "* **Candidates** (what the code chooses): the estimator of phi_{>=r} (`threshold`: Lemma "
        "10's inverse filter = seed 001 Algorithm 1/5's estimate; `deconvolution`: EM NPMLE "
        "stopped early, tol 1e-5; `mle`: the same EM run to convergence; `wupagh`: Wu and Pagh "
        "(ICML 2024), the circulant inverse of the noise projected onto the simplex; `auto`: the "
        "estimator and cap chosen from the counters by minimax bootstrap regret, "
        "`aggregator.selection`) x the rule capping the total at the public n (`items`: keep the "
        "largest items; `scale`: thin every level; `estimate.cap_total`). `none` (no cap) is "
        "measured too but is not admissible: it can release more events than n. (`xfit`, the "
        "cross-fitted EM, is selectable but not in the grid: see the notes.) The issue's oracle "
        "also ranges over B in hashed mode; this grid keeps B = choose_buckets(n) "
        "(docs/large_domains.md has the B sweep)."
    )
    w(
        "* **Pairing**: per repetition one draw of the items and, per layer count, one draw of the "
        "noisy counters, shared by every candidate. Error: l1 distance of the released and true "
        "anonymized histograms (= of their cumulative prevalences). Empty counters' noise is one "
        "multinomial over the exact pmf; hashing puts each distinct item in a uniformly random "
        "bucket. Seeded numpy noise (benchmark only)."
    )
    w(
        "* **Rule**: regret(m, c) = E(m, c) / min over admissible m' of E(m', c), E = mean l1 "
        "error over the cell's repetitions. Default for (mode, layers) = lowest worst-case regret "
        "over that mode's cells; within 1% of it, lowest geometric-mean regret. Worst case because "
        "a deployment does not know in advance which cell it is in."
    )
    w("")
    w("## Defaults chosen")
    w("")
    w(
        "| mode | layers | cells | chosen (method / cap) "
        "| worst-case regret ± se (cell) | geo-mean "
        "regret | tied with (within 2 se) | code default when reported | its worst-case regret |"
    )
    w("|---|---|---|---|---|---|---|---|---|")
    for (mode, k), a in an.items():
        ch = a["choice"]
        wv, wi = a["worst"][ch]
        best_c = min(ADMISSIBLE, key=lambda m: a["err"][(m, wi)])
        se = a["se"][(ch, wi)]
        others = [cand_label(m) for m in a["tied"] if m != ch]
        code = a["code"]
        cw = a["worst"].get(code, (float("nan"), None))
        w(
            f"| {mode} | {k} | {len(a['cells'])} | **{cand_label(ch)}** | {wv:.2f} ± {fmt(se)} "
            f"({cell_label(results[wi].cell)}; best there: {cand_label(best_c)}) | "
            f"{a['geo'][ch]:.3f} | {', '.join(others) or '-'} | {cand_label(code)} | "
            f"{fmt(cw[0])}"
            + (f" ({cell_label(results[cw[1]].cell)})" if cw[1] is not None else "")
            + " |"
        )
    w("")
    w(
        "(± is the standard error of the worst cell's regret, a ratio of means over the same "
        "repetitions: paired delta method, `grid.regret_se`.)"
    )
    w("")
    _write_refinement(w, state.get("refined", []))
    w("## All candidates")
    w("")
    for (mode, k), a in an.items():
        w(f"### {mode} mode, {k} layer{'s' if k > 1 else ''} ({len(a['cells'])} cells)")
        w("")
        w(
            "| candidate | worst-case regret ± se | worst "
            "cell | geo-mean regret | lowest error in | "
            "mean s per estimate |"
        )
        w("|---|---|---|---|---|---|")
        for m in sorted(ADMISSIBLE, key=lambda m: (a["worst"][m][0], a["geo"][m])):
            wv, wi = a["worst"][m]
            mark = "**" if m == a["choice"] else ""
            w(
                f"| {mark}{cand_label(m)}{mark} | {wv:.2f} ± {fmt(a['se'][(m, wi)])} | "
                f"{cell_label(results[wi].cell)} | "
                f"{a['geo'][m]:.3f} | {a['best_in'][m]} | {a['secs'][m[0]]:.3f} |"
            )
        w("")
    w("![regret per candidate](img/grid_regret.png)")
    w("")
    _write_rules(w, results, an)
    _write_targets(w, results, an, state)
    _write_misses(w, results, an)
    _write_caps(w, results, an)
    _write_snr(w, rows)
    _write_coverage(w, state.get("coverage", {}))
    _write_timing(w, state.get("timing"))
    _write_rerun(w, results, state.get("rerun"))
    _write_cells(w, results, an)
    target = outdir / "accuracy_grid.md"
    notes = ""
    if target.exists():  # keep the hand-written notes of an earlier report
        old = target.read_text()
        at = old.find("\n## Notes (hand-written")
        notes = old[at:] if at >= 0 else ""
    target.write_text("\n".join(lines) + "\n" + notes)
    log(f"wrote {outdir / 'accuracy_grid.md'}")


def _write_rules(w, results, an) -> None:
    w("## A rule on the public signal-to-noise ratio")
    w("")
    w(
        "No fixed candidate is good everywhere, so the "
        "grid also fits, per (mode, layers), the best "
        "one-split rule on SNR = `intervals.signal_to_noise(n, counters, p, layers)` (public: "
        "computable before any data arrives): one candidate below a cut, another above "
        "(`fit_rule`: lowest worst-case regret over the cells, ties to the geometric mean). "
        "In-sample the rule is fitted to these very cells, so it is judged out of sample: "
        "*held out* = leave one distribution out (fit on the other distributions' cells, read the "
        "regret on the held-out distribution's cells; the worst over all). The rule becomes the "
        "default (the release would then apply it) only if its held-out worst case beats the fixed "
        "choice's in-sample worst case."
    )
    w("")
    w(
        "| mode | layers | fixed choice: worst | rule (below cut / above cut) | SNR cut "
        "| rule: worst in-sample | rule: worst held out (cell) | adopted |"
    )
    w("|---|---|---|---|---|---|---|---|")
    for (mode, k), a in an.items():
        r = a["rule"]
        cut = "-" if not math.isfinite(r["cut"]) else f"{math.exp(r['cut']):.3g}"
        lc = cell_label(results[r["lodo_cell"]].cell) if r["lodo_cell"] is not None else "-"
        w(
            f"| {mode} | {k} | {a['worst'][a['choice']][0]:.2f} ({cand_label(a['choice'])}) | "
            f"{cand_label(r['low'])} / {cand_label(r['high'])} | {cut} | {r['worst']:.2f} | "
            f"{r['lodo']:.2f} ({lc}) | {'yes' if r['adopted'] else 'no'} |"
        )
    w("")


def _paired_worse(a_errs, b_errs, z: float = 2.0) -> bool:
    """mean(a) > mean(b) by more than z standard errors of the paired difference."""
    d = np.asarray(a_errs, float) - np.asarray(b_errs, float)
    if len(d) < 2:
        return bool(d.mean() > 0.05 * max(np.mean(b_errs), 1e-9))
    return bool(d.mean() > z * d.std(ddof=1) / math.sqrt(len(d)))


def _write_targets(w, results, an, state) -> None:
    w("## The issue's targets, measured")
    w("")
    w(
        "The *default* below is the effective release default per cell: the SNR rule where "
        "adopted, else the fixed choice."
    )
    w("")
    w(
        "| mode | layers | cells | worst regret of the default (cell) | cells > 1.10 | geo-mean "
        "regret | worse than Algorithm 1 (threshold, no cap) by > 2 se | worse than Wu-Pagh "
        "(no cap) by > 2 se |"
    )
    w("|---|---|---|---|---|---|---|---|")
    for (mode, k), a in an.items():
        er = a["eff_reg"]
        wc = max(er, key=er.get)
        over = sum(1 for v in er.values() if v > 1.10)
        geo = math.exp(np.mean([math.log(v) for v in er.values()]))
        worse_alg1 = worse_wp = 0
        for c in a["cells"]:
            r = results[c]
            m, cap = a["effective"][c]
            mine = r.l1[(k, m, cap)]
            worse_alg1 += _paired_worse(mine, r.l1[(k, "threshold", "none")])
            worse_wp += _paired_worse(mine, r.l1[(k, "wupagh", "none")])
        w(
            f"| {mode} | {k} | {len(er)} | {er[wc]:.2f} ({cell_label(results[wc].cell)}) | {over} "
            f"| {geo:.3f} | {worse_alg1} | {worse_wp} |"
        )
    w("")
    w(
        "Joint model (2 layers) against state-only (1 layer), same cells and items, each with its "
        "own default: geometric mean over the cells of E(2 layers) / E(1 layer) (target <= 1.3):"
    )
    w("")
    for mode in ("direct", "hashed"):
        if (mode, 1) not in an or (mode, 2) not in an:
            continue
        a1, a2 = an[(mode, 1)], an[(mode, 2)]
        rs, best = [], []
        for c in a1["cells"]:
            if c in a2["effective"]:
                e1 = np.mean(results[c].l1[(1,) + a1["effective"][c]])
                e2 = np.mean(results[c].l1[(2,) + a2["effective"][c]])
                if e1 > 0 and e2 > 0:
                    rs.append(e2 / e1)
                # the same ratio for the best admissible candidate in hindsight at each layer
                # count: what no choice among the candidates can beat
                o1, o2 = (
                    min(
                        np.mean(results[c].l1[(k,) + m])
                        for m in ADMISSIBLE
                        if (k,) + m in results[c].l1
                    )
                    for k in (1, 2)
                )
                if o1 > 0 and o2 > 0:
                    best.append(o2 / o1)
        if rs:
            w(
                f"* {mode}: {math.exp(np.mean(np.log(rs))):.2f} (range {min(rs):.2f} .. "
                f"{max(rs):.2f}, {len(rs)} cells); the per-cell best candidate in hindsight at "
                f"each layer count: {math.exp(np.mean(np.log(best))):.2f} (range "
                f"{min(best):.2f} .. {max(best):.2f})"
            )
    w("")


def _write_misses(w, results, an, over: float = 2.0) -> None:
    w(f"## Where the chosen defaults lose more than {over:g}x")
    w("")
    w(
        f"Cells where the chosen default's mean error is more than {over:g}x the best candidate's "
        "(regret ± se; the best candidate in brackets):"
    )
    w("")
    for (mode, k), a in an.items():
        ch = a["choice"]
        bad = sorted(
            ((a["reg"][(ch, i)], i) for i in a["cells"] if a["reg"][(ch, i)] > over), reverse=True
        )
        head = f"* {mode}, {k} layer{'s' if k > 1 else ''} ({cand_label(ch)}): "
        if not bad:
            w(head + "none")
            continue
        parts = []
        for v, i in bad:
            best = min(ADMISSIBLE, key=lambda m: a["err"][(m, i)])
            parts.append(
                f"{cell_label(results[i].cell)} {v:.2f} ± {fmt(a['se'][(ch, i)])} "
                f"[{cand_label(best)}]"
            )
        w(head + f"{len(bad)} of {len(a['cells'])}: " + "; ".join(parts))
    w("")


def _write_refinement(w, rounds: list) -> None:
    if not rounds:
        return
    w(
        "Refinement: the maximum of noisy ratios is biased upwards and jumps between cells, so "
        "after the first pass the cells that decide each choice (`grid.decisive_cells`: the three "
        "highest-regret cells of every candidate within 1.5x of the lowest worst-case regret) got "
        "more repetitions (max(2 reps, 8)), in rounds:"
    )
    w("")
    for j, r in enumerate(rounds, 1):
        line = f"* round {j} ({r['started']}, {r['rev']}): {len(r['cells'])} cells"
        if "before" in r:
            changed = [
                f"{m} {k}: {cand_label(r['before'][(m, k)])} -> {cand_label(r['after'][(m, k)])}"
                for (m, k) in r["after"]
                if r["before"].get((m, k)) != r["after"][(m, k)]
            ]
            line += "; choices changed: " + ("; ".join(changed) if changed else "none")
        w(line)
    w("")


def _write_caps(w, results, an) -> None:
    w("## Capping the total at n")
    w("")
    w(
        "Per method: how often the uncapped estimate held more than n events (cells where its mean "
        "total exceeds n), and the error of each cap rule relative to no cap on the same "
        "projections (geometric mean over the cells, and the range)."
    )
    w("")
    w(
        "| mode | layers | method | cells with total > n | items / none (geo, range) | "
        "scale / none (geo, range) |"
    )
    w("|---|---|---|---|---|---|")
    for (mode, k), a in an.items():
        for m in METHODS:
            over = sum(
                1 for i in a["cells"] if np.mean(results[i].total[(k, m)]) > results[i].cell.n
            )
            parts = []
            for cap in grid.ADMISSIBLE_CAPS:
                rs = [
                    a["err"][((m, cap), i)] / a["err"][((m, "none"), i)]
                    for i in a["cells"]
                    if a["err"][((m, "none"), i)] > 0
                ]
                g = float(np.exp(np.mean(np.log(rs))))
                parts.append(f"{g:.3f} ({min(rs):.2f}..{max(rs):.2f})")
            w(f"| {mode} | {k} | {m} | {over} of {len(a['cells'])} | {parts[0]} | {parts[1]} |")
    w("")


def _write_snr(w, rows) -> None:
    from aggregator.intervals import SNR_MIN

    w("## Signal below noise")
    w("")
    w(
        "SNR = n / sqrt(C / chi2_k) "
        "(`aggregator.intervals.signal_to_noise`: C counters, chi2_k the "
        "chi-square divergence between the k-layer noise "
        "pmf and its shift by one; sqrt(C / chi2_k) "
        "is the Cramer-Rao standard error for the number of items when nearly every counter is "
        "empty). Relative error = mean l1 error / n, per cell and layer count, of the chosen "
        "default and of the best candidate in the cell."
    )
    w("")
    edges = [0, 0.5, 1, 2, 4, 8, 16, 64, math.inf]
    w(
        "| SNR | cells | default: median relative error | default: max | best candidate: median "
        "| best candidate: max |"
    )
    w("|---|---|---|---|---|---|")
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [r for r in rows if lo <= r[3] < hi]
        if not sel:
            continue
        rel, best = [r[4] for r in sel], [r[5] for r in sel]
        w(
            f"| {lo:g} .. {hi:g} | {len(sel)} | {np.median(rel):.3f} | {max(rel):.3f} | "
            f"{np.median(best):.3f} | {max(best):.3f} |"
        )
    w("")
    below = [r for r in rows if r[3] < SNR_MIN]
    above = [r for r in rows if r[3] >= SNR_MIN]
    w(
        f"The best candidate's relative error reached 1/2 only at SNR <= {snr_cutoff(rows, 5):.2f} "
        f"(the chosen default's: up to SNR {snr_cutoff(rows, 4):.2f}). With the flag at "
        f"`SNR_MIN` = {SNR_MIN:g} (`intervals.signal_below_noise`): {len(below)} flagged cells, "
        f"{sum(1 for r in below if r[5] >= 0.5)} of them with the best relative error >= 1/2 and "
        f"{sum(1 for r in below if r[4] >= 0.5)} with the default's >= 1/2; {len(above)} cells "
        f"not flagged, {sum(1 for r in above if r[5] >= 0.5)} with the best relative error >= 1/2 "
        f"and {sum(1 for r in above if r[4] >= 0.5)} with the default's (estimator regret, not "
        "noise: the best candidate stayed below 1/2 there)."
    )
    w("")
    w("![relative error vs SNR](img/grid_snr.png)")
    w("")


COVERAGE_NAMES = ("l1", "distinct", "entropy", "coverage", "phi", "phi_r", "bands")


def coverage_summary(rec: dict) -> dict:
    """Coverage fractions of one (cell, layers) record of grid.run_coverage."""

    def frac(ds):
        return float(np.mean([v for d in ds for v in d.values()])) if any(ds) else math.nan

    return dict(
        l1=float(np.mean(np.array(rec["l1"]) <= np.array(rec["bound"]))),
        distinct=float(np.mean(rec["distinct"])),
        entropy=float(np.mean(rec["entropy"])),
        coverage=float(np.mean(rec.get("coverage", [math.nan]))),
        phi=frac(rec["phi"]),
        phi_r=frac(rec.get("phi_r", [])),
        bands=frac(rec.get("bands", [])),
    )


def coverage_check(dists: list[str], quick: bool = False) -> None:
    """Coverage of the chosen coverage cells with the code as it is now, as a markdown table
    (rows per cell and layer count, then the averages), on the study's seeds: comparable row by
    row with an earlier table of the same cells."""
    cells = [c for c in grid.coverage_cells(quick) if c.dist in dists]
    if not cells:
        raise SystemExit(f"no coverage cell has a distribution in {dists}")
    print(f"(at {git_rev(['aggregator', 'bench'])}, {datetime.datetime.now():%Y-%m-%d %H:%M})")
    print("| cell | layers | " + " | ".join(COVERAGE_NAMES) + " | distinct width |")
    print("|---|---|" + "---|" * (len(COVERAGE_NAMES) + 1))
    rows: dict[int, list] = {}
    for cell in cells:
        for k, rec in sorted(grid.run_coverage(cell).items()):
            v = coverage_summary(rec)
            rows.setdefault(k, []).append(v)
            width = float(np.mean(rec["width_distinct"]))  # (upper - lower) / true items
            print(
                f"| {cell_label(cell)} | {k} | "
                + " | ".join(f"{v[name]:.3g}" for name in COVERAGE_NAMES)
                + f" | {width:.3g} |",
                flush=True,
            )
    for k, vs in sorted(rows.items()):
        print(
            f"| average | {k} | "
            + " | ".join(f"{np.nanmean([v[name] for v in vs]):.3f}" for name in COVERAGE_NAMES)
            + " | |"
        )


def _write_coverage(w, cov: dict) -> None:
    if not cov:
        return
    level = 0.9
    w("## Error bars: measured coverage")
    w("")
    w(
        "`aggregator.intervals.error_bars(counters, p, layers=k, n=n, buckets=B, reps=16, "
        "level=0.9)` (stand-in truths: the early-stopped "
        "EM's and the converged NPMLE's histograms, "
        'union of the two intervals, `model="both"`; no interval shorter than the counters\' '
        "information allows, `intervals.information_floor`, and every interval reaching the "
        "likelihood region's extremes, `intervals.plausible_extremes`, from commit 0f255d0 on) on "
        "fresh data and noise per repetition "
        "(release defaults), against the truth: *l1 bound* = fraction of repetitions whose true l1 "
        "error is at most the bound (nominal 0.90, one-sided); *distinct*, *entropy*, *S_2n* "
        "(support coverage at m = 2n) = fraction inside the two-sided 90% interval; *phi_{>=r}* = "
        f"pointwise coverage at r in {grid.COVERAGE_R} (where r exists), averaged; *phi_r* = the "
        f"same for phi_r at r in {grid.COVERAGE_PHI_R}; *rank bands* = the events held by ranks "
        "1, 2-10, 11-100, ... (`intervals.RANK_BANDS`), averaged over the bands that exist; "
        "*width* = mean (upper - lower) / true number of items."
    )
    w("")
    w(
        "| cell | layers | default | reps | l1 bound | distinct | entropy | S_2n | phi_{>=r} | "
        "phi_r | rank bands | width | s per call |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    tot: dict = {}
    for key, c in cov.items():
        cell = c["cell"]
        for k, rec in c["out"].items():
            v = coverage_summary(rec)
            for name in COVERAGE_NAMES:
                tot.setdefault((k, name), []).append(v[name])
            w(
                f"| {cell_label(cell)} ({cell.mode}) | {k} | {c['defaults'][k]} | "
                f"{len(rec['l1'])} | "
                + " | ".join(fmt(v[nm]) for nm in COVERAGE_NAMES)
                + f" | {np.mean(rec['width_distinct']):.3f} | {np.mean(rec['seconds']):.2f} |"
            )
    w("")
    w("Averages over the cells (nominal " + f"{level:.2f}" + "; target: within 0.02):")
    w("")
    w("| layers | " + " | ".join(COVERAGE_NAMES) + " |")
    w("|---|" + "---|" * len(COVERAGE_NAMES))
    for k in sorted({k for k, _ in tot}):
        w(
            f"| {k} | "
            + " | ".join(fmt(float(np.nanmean(tot[(k, nm)]))) for nm in COVERAGE_NAMES)
            + " |"
        )
    w("")


def _write_timing(w, tm: dict | None) -> None:
    if not tm:
        return
    w("## Release time at D = 1e7")
    w("")
    w(
        f"Full int64 counter arrays, eps = {tm['eps']:g}: direct mode D = {tm['n']:.0e} counters "
        f"holding n = {tm['n']:.0e} Zipf(1.1) events; hashed mode n = {tm['n']:.0e} events of "
        f"Zipf(1.1) items in B = {tm['B']:.0e} buckets. `anonymized_histogram(x, p, layers=k, "
        "n=n, buckets=B or None, method=...)`; `default` = no method named (the table "
        "`estimators.DEFAULTS`: method and cap rule per "
        "mode and layers); baseline `np.bincount(x - "
        f"x.min())`. Medians of {TIME_REPS} interleaved repetitions of bincount, the default, "
        f"threshold and wupagh; one run of the others (error bars: direct mode, 1-2 layers); "
        "every call cold (what `auto` keeps for the error bars lives in the release's memo, "
        f"none here); run {tm['started']} at {tm['rev']}."
    )
    w("")
    names = list(dict.fromkeys(a for row in tm["rows"] for a in row["times"]))
    w("| mode | layers | default method | " + " | ".join(names) + " | default / bincount |")
    w("|---|---|---|" + "---|" * len(names) + "---|")
    for row in tm["rows"]:
        med = {a: float(np.median(b)) for a, b in row["times"].items()}
        w(
            f"| {row['mode']} | {row['layers']} | {row['method']} | "
            + " | ".join(f"{med[a]:.2f} s" if a in med else "-" for a in names)
            + f" | {med['default'] / med['bincount']:.1f}x |"
        )
    loads = [r["load"][0] for r in tm["rows"]]
    w("")
    w(
        f"(1-minute load average during the timing: {min(loads):.2f} .. {max(loads):.2f} on 2 "
        "cores; other jobs inflate the times.)"
    )
    w("")


def _union_best(old, new, k: int) -> float:
    """The per-cell oracle over both runs: the lowest mean error of any admissible candidate,
    stored or re-run (the same denominator for the old and the new default)."""
    errs = [
        np.mean(v) for (kk, m, cap), v in old.l1.items() if kk == k and cap in grid.ADMISSIBLE_CAPS
    ]
    errs += [
        np.mean(v) for (kk, m, cap), v in new.l1.items() if kk == k and cap in grid.ADMISSIBLE_CAPS
    ]
    return float(min(errs))


def _write_rerun(w, results, rr: dict | None) -> None:
    """Old against new default (and each re-run method) on the same cells and noisy counters."""
    if not rr or not rr.get("results"):
        return
    w("## The EM change, re-measured on the grid")
    w("")
    runs = rr["runs"]
    w(
        f"`{', '.join(RERUN_METHODS)}` re-run with the current code at layers "
        f"{', '.join(map(str, RERUN_LAYERS))} on the stored cells' own noisy counters "
        "(`--rerun`; "
        + "; ".join(
            f"run {r['started']} at {r['rev']}, {r['cells']} cells in {r['seconds'] / 60:.1f} min"
            for r in runs
        )
        + "). "
        "Old = the stored run above, new = the re-run. Regret here is against the lowest error "
        "of any admissible candidate of either run (one denominator for both). The sections "
        "above still show the stored run."
    )
    w("")
    w(
        "| mode | layers | candidate | cells | worst "
        "regret old -> new | geo-mean regret old -> new "
        "| geo-mean error new / old (range) | new worse by > 2 se (paired) | new better by > 2 se "
        "| s per estimate old -> new |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|")
    from aggregator.estimators import DEFAULTS

    by_key = {r.cell.key: r for r in results}
    for mode in ("direct", "hashed"):
        for k in RERUN_LAYERS:
            cap = DEFAULTS[(mode, k)][1]
            for m in RERUN_METHODS:
                reg_o, reg_n, ratio, worse, better, so, sn = [], [], [], 0, 0, [], []
                for key, new in rr["results"].items():
                    old = by_key.get(key)
                    if old is None or old.cell.mode != mode or (k, m, cap) not in new.l1:
                        continue
                    best = _union_best(old, new, k)
                    eo, en = old.l1[(k, m, cap)], new.l1[(k, m, cap)]
                    if best > 0:
                        reg_o.append(np.mean(eo) / best)
                        reg_n.append(np.mean(en) / best)
                    if np.mean(eo) > 0 and np.mean(en) > 0:
                        ratio.append(np.mean(en) / np.mean(eo))
                    worse += _paired_worse(en, eo)
                    better += _paired_worse(eo, en)
                    so += old.seconds.get((k, m), [])
                    sn += new.seconds.get((k, m), [])
                if not reg_o:
                    continue
                geo = lambda xs: math.exp(np.mean(np.log(xs)))  # noqa: E731
                label = f"{m} / {cap}" + (" (default)" if DEFAULTS[(mode, k)][0] == m else "")
                w(
                    f"| {mode} | {k} | {label} | {len(reg_o)} | {max(reg_o):.2f} -> "
                    f"{max(reg_n):.2f} | {geo(reg_o):.3f} -> {geo(reg_n):.3f} | {geo(ratio):.3f} "
                    f"({min(ratio):.2f} .. {max(ratio):.2f}) | {worse} | {better} | "
                    f"{np.mean(so):.3f} -> {np.mean(sn):.3f} |"
                )
    w("")


def _write_cells(w, results, an) -> None:
    w("## Every cell")
    w("")
    w(
        "Mean l1 error ± standard error over the "
        "repetitions, each method with the chosen default's "
        "cap rule; regret of the chosen default; D_items = mean number of distinct items."
    )
    w("")
    for (mode, k), a in an.items():
        cap = a["choice"][1]
        w(f"<details><summary>{mode} mode, {k} layer{'s' if k > 1 else ''} (cap: {cap})</summary>")
        w("")
        w("| cell | reps | D_items | " + " | ".join(METHODS) + " | chosen / n | regret |")
        w("|---|---|---|" + "---|" * len(METHODS) + "---|---|")
        for i in a["cells"]:
            r = results[i]
            ms = [mean_se(r.l1[(k, m, cap)]) for m in METHODS]
            best = min(x for x, _ in ms)
            cells = [(f"**{fmt(x)}**" if x == best else fmt(x)) + f" ± {fmt(s)}" for x, s in ms]
            w(
                f"| {cell_label(r.cell)} | {r.cell.reps} | {np.mean(r.items):.0f} | "
                + " | ".join(cells)
                + f" | {a['err'][(a['choice'], i)] / max(r.cell.n, 1):.3f} | "
                f"{a['reg'][(a['choice'], i)]:.2f} |"
            )
        w("")
        w("</details>")
        w("")


def _plot_regret(an: dict, path: Path) -> None:
    from ..harness import pyplot

    plt = pyplot()

    keys = list(an)
    fig, axes = plt.subplots(
        1, len(keys), figsize=(3.2 * len(keys), 4.2), dpi=100, sharey=True, squeeze=False
    )
    for ax, key in zip(axes[0], keys):
        a = an[key]
        for j, m in enumerate(ADMISSIBLE):
            vals = [a["reg"][(m, c)] for c in a["cells"]]
            x = j + np.linspace(-0.25, 0.25, len(vals))
            ax.scatter(x, vals, s=6, alpha=0.5, color="tab:red" if m == a["choice"] else "tab:blue")
            ax.plot([j - 0.3, j + 0.3], [max(vals)] * 2, color="k", lw=1)
        ax.set_xticks(range(len(ADMISSIBLE)))
        ax.set_xticklabels([cand_label(m) for m in ADMISSIBLE], rotation=70, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{key[0]}, {key[1]} layer{'s' if key[1] > 1 else ''}", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("regret = error / best error in the cell")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_snr(rows, path: Path) -> None:
    from ..harness import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=100)
    marks = {1: "o", 2: "s", 3: "^", 4: "D", 5: "P", 6: "v"}
    for mode, color in (("direct", "tab:blue"), ("hashed", "tab:orange")):
        for k in grid.LAYERS:
            sel = [r for r in rows if r[0] == mode and r[1] == k]
            if sel:
                ax.scatter(
                    [r[3] for r in sel],
                    [r[4] for r in sel],
                    s=12,
                    marker=marks[k],
                    color=color,
                    alpha=0.6,
                    label=f"{mode}, {k} layer(s)",
                )
    ax.axhline(0.5, color="k", lw=0.8, ls=":")
    from aggregator.intervals import SNR_MIN

    ax.axvline(SNR_MIN, color="tab:red", lw=0.8, ls="--", label="SNR_MIN (flag below)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("SNR = n / sqrt(C / chi2_k)")
    ax.set_ylabel("l1 error of the default / n")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = parser(__doc__, "two tiny cells, 1 and 2 layers, one repetition, into out/")
    ap.add_argument("--quick", action="store_true", help="a few small cells; writes under out/")
    ap.add_argument(
        "--shard", type=shard_arg, help="i/N: run every N-th remaining cell into its own file"
    )
    ap.add_argument("--merge", action="store_true", help="fold the --shard files into the main one")
    ap.add_argument("--report", action="store_true", help="only re-render the saved results")
    ap.add_argument("--run-only", action="store_true", help="run (resume) the grid, no report")
    ap.add_argument(
        "--refine",
        action="store_true",
        help="one round of extra repetitions in the cells that decide the choices",
    )
    ap.add_argument(
        "--coverage",
        action="store_true",
        help="run (resume) the error-bar coverage study into the results file",
    )
    ap.add_argument(
        "--coverage-check",
        metavar="DISTS",
        help="comma-separated distributions (e.g. geometric,uniform,heavy,sc-ru): run "
        "only those coverage cells, afresh, and print their coverage table "
        "(a quick check of an interval change; nothing is saved in the results)",
    )
    ap.add_argument(
        "--rerun",
        action="store_true",
        help="re-run the EM-based candidates (layers 1-2) on every stored cell with "
        "the current code into out/grid_rerun.pkl (resumable; the report "
        "compares them with the stored run)",
    )
    ap.add_argument(
        "--replace",
        metavar="METHODS",
        help="comma-separated estimators to re-run with the current code on every "
        "stored cell (same counters) into a file of its own (with --shard i/N: "
        "that shard); --replace-merge puts them in place of the stored entries",
    )
    ap.add_argument("--replace-layers", default="1,2,3,6", help="layer counts for --replace")
    ap.add_argument("--replace-merge", action="store_true")
    ap.add_argument(
        "--timing",
        action="store_true",
        help="time the release at D = 1e7 (full arrays) into the results file",
    )
    args = ap.parse_args(argv)
    global ORDER, LAYERS
    if args.smoke:
        args.quick = ORDER = "smoke"  # grid.grid_cells: the smoke cells; the quick outputs
        LAYERS = (1, 2)
    path = (
        RESULTS.with_name(f"grid_results_{'smoke' if args.smoke else 'quick'}.pkl")
        if args.quick
        else RESULTS
    )
    if args.merge:
        merge_shards(path)
    if args.coverage_check:
        coverage_check(args.coverage_check.split(","), args.quick)
        return 0
    if args.shard and args.coverage:  # the coverage cells i, i + N, ... into a shard file
        i, N = parse_shard(args.shard)
        sp = path.with_name(f"{path.stem}_shardcov{i}of{N}.pkl")
        part = load(sp)
        mine = grid.coverage_cells(args.quick)[i::N]
        run_coverage(args.quick, part, sp, cells=mine)
        return 0
    if args.replace:
        run_replace(
            load(path),
            path,
            tuple(args.replace.split(",")),
            tuple(int(k) for k in args.replace_layers.split(",")),
            args.shard or "0/1",
        )
        return 0
    if args.replace_merge:
        merge_replace(path)
        return 0
    if args.shard:
        run(args.quick, path, args.shard)
        return 0
    if args.rerun:
        run_rerun(load(path), rerun_path(path))
        return 0
    state = load(path) if (args.report or args.merge) else run(args.quick, path)
    if args.refine:
        refine(state, path)
    if args.coverage:
        run_coverage(args.quick, state, path)
    if args.timing:
        state["timing"] = run_timing(args.quick)
        save(state, path)
    if args.run_only:
        return 0
    outdir = Path("out") if args.quick else Path("docs")
    if rerun_path(path).exists():  # read for the report only (its own file, not the results)
        state = dict(state, rerun=load(rerun_path(path)))
    write_report(state, outdir, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
