"""Releases and error bars for fixed seeds, for a bit-for-bit diff of two trees (a refactor of
the estimator core must not change a number: issue 52's split of estimate.py was checked so).

Direct counters at 1-3 layers (every estimator by name, every cap rule, the l2 projection),
hashed counters at 1-2 layers (the EMs and auto), and estimate_with_accuracy's release and
error bars with a seeded bootstrap: 59 results, every float compared by its hex form.

    git worktree add --detach /tmp/before main      # the tree before the change
    PYTHONPATH=/tmp/before python bench/accuracy/bit_identity.py --out /tmp/before.pkl
    PYTHONPATH=. python bench/accuracy/bit_identity.py --out /tmp/after.pkl
    # exit 1 if any differs
    python bench/accuracy/bit_identity.py --diff /tmp/before.pkl /tmp/after.pkl

(Run as a script, so that PYTHONPATH picks the aggregator it measures. About 20 s.)
"""

import pickle
import sys

import numpy as np


def arr(x):
    return np.asarray(x).copy()


def walk(obj):
    """JSON-ish dicts with numpy inside -> plain, comparable by ==/array_equal."""
    if isinstance(obj, dict):
        return {k: walk(v) for k, v in obj.items() if k not in ("release_seconds",)}
    if isinstance(obj, (list, tuple)):
        return [walk(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return ("nd", obj.dtype.str, obj.tobytes())
    if isinstance(obj, float):
        return ("f", float(obj).hex())
    return obj


def run():
    from aggregator.anonymize import anonymized_histogram
    from aggregator.estimators import phi_estimate
    from aggregator.largedomain import hashed_histogram
    from aggregator.noise import discrete_laplace
    from aggregator.release import estimate_with_accuracy

    out = {}
    g = np.random.default_rng(20261128)
    p = float(np.exp(-1.0))
    # direct: a Zipf-ish window, mostly empty counters
    h = np.concatenate([np.minimum(g.zipf(1.3, 600), 400), np.zeros(3_400, np.int64)])
    n = int(h.sum())
    for layers in (1, 2, 3):
        noisy = h.copy()
        for _ in range(layers):
            noisy = noisy + discrete_laplace(p, len(h), rng=g)
        for method in ("threshold", "deconvolution", "mle", "wupagh", "xfit", "auto"):
            if layers > 2 and method in ("auto",):
                continue
            out[("phi", layers, method)] = walk(
                arr(phi_estimate(noisy, p, layers=layers, method=method, n=n))
            )
            out[("hist", layers, method)] = walk(
                arr(anonymized_histogram(noisy, p, layers=layers, n=n, method=method))
            )
        for cap in ("items", "scale", "fitted", "none"):
            try:
                got = anonymized_histogram(
                    noisy, p, layers=layers, n=n, method="deconvolution", cap=cap
                )
            except ValueError:  # "fitted" moved to bench (the branch): the same rule there
                from aggregator.anonymize import anonymized_cumulative
                from aggregator.em import sparse_top
                from aggregator.histograms import checked_cumulative, counts_from_cumulative
                from bench.accuracy.fitted_cap import cap_fitted

                y = anonymized_cumulative(
                    noisy, p, layers=layers, n=n, method="deconvolution", cap="none"
                )
                got = counts_from_cumulative(
                    checked_cumulative(cap_fitted(y, n, sparse_top(noisy, p, layers)))
                )
            out[("cap", layers, cap)] = walk(arr(got))
        if layers <= 2:
            hist, acc = estimate_with_accuracy(
                noisy, p, layers=layers, n=n, reps=4, rng=np.random.default_rng(7)
            )
            out[("ewa", layers)] = walk((hist, acc))
            hist, acc = estimate_with_accuracy(
                noisy, p, layers=layers, n=n, reps=4, method="mle", rng=np.random.default_rng(8)
            )
            out[("ewa-mle", layers)] = walk((hist, acc))
    out[("l2", 1)] = walk(
        arr(
            anonymized_histogram(
                noisy[:800], p, layers=3, n=int(h[:800].sum()), loss="l2", method="deconvolution"
            )
        )
    )
    # hashed
    items = np.minimum(g.zipf(1.2, 2_000), 300)
    nh = int(items.sum())
    B = 2 * nh
    red = np.bincount(g.integers(0, B, len(items)), weights=items, minlength=B).astype(np.int64)
    for layers in (1, 2):
        noisy = red.copy()
        for _ in range(layers):
            noisy = noisy + discrete_laplace(p, B, rng=g)
        for method in ("deconvolution", "mle", "auto"):
            out[("hashed", layers, method)] = walk(
                arr(hashed_histogram(noisy, p, buckets=B, n=nh, layers=layers, method=method))
            )
        hist, acc = estimate_with_accuracy(
            noisy, p, layers=layers, n=nh, buckets=B, reps=4, rng=np.random.default_rng(9)
        )
        out[("hashed-ewa", layers)] = walk((hist, acc))
    return out


def main(argv=None) -> int:
    from bench.harness import parser

    ap = parser(__doc__, "every result once, nothing written")
    ap.add_argument("--out", help="write the results (a pickle) here")
    ap.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two results")
    args = ap.parse_args(argv)
    if args.diff:
        a, b = (pickle.load(open(f, "rb")) for f in args.diff)
        if a.keys() != b.keys():
            print(f"different results: {sorted(map(str, set(a) ^ set(b)))}")
            return 1
        bad = [k for k in a if a[k] != b[k]]
        print(f"{len(a)} results compared, {len(bad)} differ: {bad}")
        return 1 if bad else 0
    if args.smoke:
        print(len(run()), "results")
        return 0
    if not args.out:
        ap.error("--out, --diff or --smoke")
    res = run()
    with open(args.out, "wb") as f:
        pickle.dump(res, f)
    print(len(res), "results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
