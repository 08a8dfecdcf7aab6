"""The privacy audit table of docs/privacy.md (section 13): every audit of tests/test_privacy*.py
read by both test families, with the negative controls.

    python -m bench.service.privacy_audit            # the whole table (about 35 s on 2 cores)
    python -m bench.service.privacy_audit --no-service
    python -m bench.service.privacy_audit --crash-only   # the crash rows of section 16 (about 60 s)
    python -m bench.service.privacy_audit --worker-only  # service rows, release.workers = 1
    python -m bench.service.privacy_audit --group-only   # a views group on a broker (~4 min)

Columns: runs per neighbouring stream, the older event family (``empirical_epsilon`` in
tests/test_privacy.py: values, thresholds and quadrants of counters and of differences of
consecutive looks), the likelihood-ratio family (tests/lr_audit.py: thresholds on each look's,
each block's and their sums' exact log-likelihood ratio) and the event that attains the latter.
Both are certified lower bounds (Clopper-Pearson, Bonferroni, 1e-6 per audit). The scenarios are
the functions of tests/test_privacy_lr.py, so the table measures what the tests assert on.
Production noise (OS entropy, no seed): readings move by a few hundredths between runs. Figures,
not assertions.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT, parser

if str(ROOT) not in sys.path:  # the scenarios are the tests' (tests/ is not a package on the path)
    sys.path.insert(0, str(ROOT))

from tests import test_privacy_lr as S  # noqa: E402
from tests.lr_audit import lr_epsilon  # noqa: E402
from tests.helpers.privacy import empirical_epsilon  # noqa: E402


def _mechanism_rows():
    yield "single look (state)", "<= eps", 0.5, lambda: S.single_look(0.5)
    yield "single look (state)", "<= eps", 1.0, lambda: S.single_look(1.0)
    yield "single look (state)", "<= eps", 2.0, lambda: S.single_look(2.0)
    yield "joint view: intrusion + release, event before", "<= eps", 1.0, lambda: S.joint("before")
    yield "joint view: intrusion + release, event after", "<= eps", 1.0, lambda: S.joint("after")
    for changed in range(3):
        for intrusion in range(3):
            yield (
                f"2 exports + intrusion + release, event in segment {changed}, intrusion "
                f"after segment {intrusion}",
                "<= eps",
                1.0,
                lambda c=changed, i=intrusion: S.exports(c, i),
            )
    yield "real states: one snapshot", "<= eps", 1.0, S.real_states
    yield "real states: snapshot + release (fresh layer)", "<= eps", 1.0, S.real_joint
    yield "real add-remove snapshots", "<= eps", 1.0, lambda: S.add_remove(1.0)
    yield (
        "real add-remove snapshots, two merged states",
        "<= eps",
        1.0,
        lambda: S.add_remove(1.0, merged=True),
    )
    yield (
        "R3 model: memory read before a crash + release of the replay",
        "<= 2 eps",
        1.0,
        S.crash_replay,
    )
    yield (
        "**control**: two independent eps-looks of one event",
        "~2 eps",
        1.0,
        S.two_independent_looks,
    )
    yield (
        "**control**: noise for eps = 1.25 claimed as 1 (+25 %)",
        "> eps",
        1.0,
        lambda: S.single_look(1.0, noise_eps=1.25),
    )
    yield (
        "**control**: half the noise (loss 2 eps)",
        "> eps",
        1.0,
        lambda: S.single_look(1.0, noise_eps=2.0),
    )
    yield "**control**: a counter without noise", "> eps", 1.0, S.unnoised_counter
    yield (
        "**control**: release without a fresh layer",
        "> eps",
        1.0,
        lambda: S.joint("after", fresh_layer=False),
    )
    yield (
        "**control**: export without its 'before' layer",
        "> eps",
        1.0,
        lambda: S.broken_exports("after-only"),
    )
    yield (
        "**control**: export without its 'after' layer",
        "> eps",
        1.0,
        lambda: S.broken_exports("before-only"),
    )


def _service_rows(tmp: Path):
    snap = {"checkpoint.snapshots_per_window": 2}
    for gap in (1, 2, 3):
        yield (
            f"service: memory + files + release, gap {gap}",
            "<= eps",
            1.0,
            lambda g=gap: S.service(tmp, g),
        )
    for gap in (1, 2, 3):
        yield (
            f"service, 2 layered snapshots per window: gap {gap}",
            "<= eps",
            1.0,
            lambda g=gap: S.service(tmp, g, **snap),
        )
    yield (
        "service: two backups of the state directory + release",
        "<= eps",
        1.0,
        lambda: S.service(tmp, 0, backups=(1, 2), **snap),
    )
    yield (
        "**control** service: checkpoint holding the live noise (old design)",
        "> eps",
        1.0,
        lambda: S.service_old_checkpoints(tmp),
    )
    yield (
        "**control** service: noise for eps = 1.25 claimed as 1 (+25 %)",
        "> eps",
        1.0,
        lambda: S.service(tmp, 2, epsilon=1.25),
    )


def _worker_rows(tmp: Path):
    """The intruder audit with the release in the default release worker (release.workers = 1):
    its input is the release-layered view the spawned worker returns."""
    for gap in (1, 2, 3):
        yield (
            f"service, release.workers = 1: memory + files + release, gap {gap}",
            "<= eps",
            1.0,
            lambda g=gap: S.service(tmp, g, workers=1, **{"release.plan_errors": "false"}),
        )


def _crash_rows(tmp: Path):
    """tests/test_privacy_crash.py: a crash at each step of a window's close, then the restarted
    memory (first read past the replaced event / caught up) + the published release."""
    from functools import lru_cache

    from tests import test_privacy_crash as C

    @lru_cache(maxsize=1)  # one step's views at a time, for its two reads
    def views(step, old=False):
        return C.crash_views(tmp, step, old=old)

    for step in C.STEPS:
        for which in C.READS:
            yield (
                f"service, crash at `{step}`, restarted memory ({which}) + release",
                "<= eps",
                1.0,
                lambda s=step, w=which: C.scenario(views(s), w),
            )
    for which in C.READS:
        yield (
            f"**control** service: old restart (ledgered window replayed), memory ({which}) "
            "+ release",
            "> eps" if which == "first" else "<= eps",
            1.0,
            lambda w=which: C.scenario(views("ledger-after-release", True), w),
        )
    yield (
        "**control**: old replay emulated (fresh real state) + real release",
        "> eps",
        1.0,
        lambda: C.scenario(C.emulated_old_replay(views("ledger-after-release")), "first"),
    )


def _group_rows(tmp: Path, bootstrap: str):
    """tests/integration/test_group_privacy.py: two real members of a views group on a broker;
    one member's memory and files inside the window, every view of it, the release input."""
    from functools import lru_cache

    from tests import group_audit as G

    trials, cycles = 40_000, 4  # 80,000 runs per stream per audit

    @lru_cache(maxsize=1)  # one group run at a time, for its rows
    def run(what):
        sub = tmp / f"group-{what}"
        sub.mkdir()
        if what == "workers=1":
            return G.group_scenarios(bootstrap, sub, trials, cycles)
        if what == "workers=0":
            return G.group_scenarios(bootstrap, sub, trials, cycles // 2, workers=0)
        if what == "unlayered":
            return G.group_scenarios(bootstrap, sub, 20_000, 1, gaps=(1,), unlayered=True)
        return G.group_scenarios(bootstrap, sub, trials, cycles, gaps=(2,), epsilon=1.25)

    where = {"own": "the intruded member's partition", "other": "the other member's partition"}
    when = {1: "after", 2: "before"}
    for workers in (1, 0):
        for kind in G.KINDS:
            for gap in (1, 2):
                yield (
                    f"views group, 2 members, release.workers = {workers}: one member's "
                    f"memory + files + every view + release input, event on {where[kind]}, "
                    f"{when[gap]} the intrusion",
                    "<= eps",
                    1.0,
                    lambda w=workers, k=kind, g=gap: run(f"workers={w}")[k, g],
                )
    yield (
        "**control** views group: views written without their layer",
        "> eps",
        1.0,
        lambda: run("unlayered")["own", 1],
    )
    yield (
        "**control** views group: noise for eps = 1.25 claimed as 1 (+25 %)",
        "> eps",
        1.0,
        lambda: run("weaker")["own", 2],
    )


def main(argv=None) -> None:
    ap = parser(__doc__, "the first audit and the first negative control, no service rows")
    ap.add_argument("--no-service", action="store_true", help="skip the real-service rows")
    ap.add_argument(
        "--crash-only", action="store_true", help="only the rows of tests/test_privacy_crash.py"
    )
    ap.add_argument(
        "--worker-only",
        action="store_true",
        help="only the service rows with release.workers = 1 (about 2 min)",
    )
    ap.add_argument(
        "--group-only",
        action="store_true",
        help="only the rows of a views group on a real broker ($PANAGG_KAFKA_BOOTSTRAP"
        " or one started from deploy/kafka; about 4 min)",
    )
    args = ap.parse_args(argv)
    print("| view | eps | claim | runs per stream | older family | LR family | LR attained at |")
    print("|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        rows = (
            []
            if args.crash_only or args.worker_only or args.group_only
            else list(_mechanism_rows())
        )
        broker = None
        if args.group_only and not args.smoke:
            from bench.service.e2e import start_broker

            bootstrap, broker = start_broker(Path(d))
            rows += list(_group_rows(Path(d), bootstrap))
        if args.group_only:
            args.no_service = True
        if args.worker_only:
            rows += list(_worker_rows(Path(d)))
            args.no_service = True
        if args.smoke:
            rows = [rows[0], next(r for r in rows if r[0].startswith("**control**"))]
            args.no_service = True
        if not args.no_service and not args.crash_only:
            rows += list(_service_rows(Path(d)))
        if not args.no_service:
            rows += list(_crash_rows(Path(d)))
        try:
            for label, claim, eps, build in rows:
                vx, vy, looks, p = build()
                old, _ = empirical_epsilon(vx, vy)
                r = lr_epsilon(vx, vy, looks, p)
                print(
                    f"| {label} | {eps:g} | {claim} | {len(vx[0]):,} | {old:.3f} | "
                    f"{r.eps:.3f} | `{r.where}` |",
                    flush=True,
                )
        finally:
            if broker is not None:
                from bench.service.e2e import stop_broker

                stop_broker(broker)
    print(f"\n{len(rows)} audits in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
