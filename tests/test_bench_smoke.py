"""Every bench runs (issue 46: bench/e2e.py, now bench/service/e2e.py, failed on the
Source.commit signature and nothing ran it, so the Kafka figure went unmeasured; issue 52: every
bench in the suite's smoke lane).

Each bench has ``--smoke`` (bench.harness.parser): a tiny size, seconds long, writing nothing
into docs/. The benches that need no broker run it here, each in a scratch directory (their
out/ files land there); the Kafka ones run it in tests/integration/test_bench_kafka.py on the
session's broker, and bench.service.chaos (which kills its own broker) in
tests/chaos/test_bench_chaos.py. A bench whose smoke needs the ``bench`` extra (real frequency
profiles, OpenDP) is skipped, with the reason, where the extra is not installed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# no main: grid is the accuracy grid's library, fitted_cap the held-out cap rule's
LIBRARIES = {"__init__", "grid", "fitted_cap"}

#: bench -> where its smoke run is: "here", "kafka" (tests/integration) or "chaos" (tests/chaos)
LANE = {
    "accuracy.accuracy": "here",
    "accuracy.accuracy_grid": "here",
    "accuracy.accuracy_report": "here",
    "accuracy.bit_identity": "here",
    "accuracy.calibration": "here",
    "accuracy.changes": "here",
    "accuracy.coverage28": "here",
    "accuracy.estimators": "here",
    "accuracy.grid_extra": "here",
    "accuracy.hashed_universe": "here",
    "accuracy.largedomain": "here",
    "accuracy.layer_cost": "here",
    "accuracy.lofo": "here",
    "accuracy.rollups": "here",
    "accuracy.select_study": "here",
    "accuracy.shuffle": "here",
    "accuracy.views_cost": "here",
    "service.chaos": "chaos",
    "service.e2e": "kafka",
    "service.group": "here",  # its offline part; --throughput in tests/integration
    "service.group_rollup_time": "here",
    "service.handoff": "here",
    "service.hash_timing": "here",
    "service.intake_stall": "kafka",
    "service.item_path": "here",
    "service.multi_agg": "kafka",
    "service.privacy_audit": "here",
    "service.release_intake": "here",
    "service.registry_cost": "kafka",
    "service.release_time": "here",
    "service.shuffler_throughput": "kafka",
    "service.speed": "here",
    "service.user_privacy_audit": "here",
    "service.user_windows": "here",
    "service.views": "here",  # accuracy; recovery in tests/integration
}
#: bench -> modules of the ``bench`` extra its smoke run needs
EXTRAS = {
    "accuracy.accuracy_report": ("wordfreq",),  # the report's real-profile columns
    "service.speed": ("opendp",),  # the sampler section times OpenDP's
}

MODULES = sorted(
    f"{p.parent.name}.{p.stem}" for p in BENCH.glob("*/*.py") if p.stem not in LIBRARIES
)


def run_bench(module, args, cwd, env=None, timeout=300):
    """``python -m bench.<module> *args`` in ``cwd`` with this checkout first on the path."""
    return subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
    )


@pytest.mark.parametrize("module", [m for m in MODULES if LANE.get(m) == "here"])
def test_bench_smoke(module, tmp_path):
    for extra in EXTRAS.get(module, ()):
        pytest.importorskip(extra, reason=f"bench.{module} --smoke needs the bench extra")
    res = run_bench(module, ["--smoke"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("module", [m for m in MODULES if LANE.get(m) != "here"])
def test_bench_parses_its_flags(module, tmp_path):
    """The benches smoke-run in another lane at least import and build their parser here."""
    res = run_bench(module, ["--help"], tmp_path)
    assert res.returncode == 0 and "--smoke" in res.stdout, res.stderr[-3000:]


def test_every_bench_has_a_lane():
    assert set(LANE) == set(MODULES)


#: `python -m bench.X` and `bench/X.py` as written in the docs, the Makefile and the code
REFERENCE = re.compile(r"(?<![\w.])bench([./])((?:accuracy|service)[./])?([a-z_0-9]+)")


def test_every_bench_reference_names_a_module():
    """After the split into bench/accuracy and bench/service, a command or path that names a
    bench names one that exists (a stale `python -m bench.lofo` fails here, not in a reader's
    shell)."""
    pages = [
        ROOT / "README.md",
        ROOT / "Makefile",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(BENCH.rglob("*.py")),
        *sorted((ROOT / "aggregator").rglob("*.py")),
        *sorted(p for p in (ROOT / "tests").rglob("*.py") if p != Path(__file__)),
    ]
    known = {p.stem for p in BENCH.glob("*.py")} | {"accuracy", "service", "harness"}
    stale = []
    for page in pages:
        for m in REFERENCE.finditer(page.read_text(encoding="utf-8")):
            pkg, name = m.group(2), m.group(3)
            if pkg is None:
                ok = name in known
            else:
                ok = any((BENCH / pkg[:-1]).glob(f"{name}.*"))  # a module or its data
            if not ok:
                stale.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert not stale, "\n".join(stale)
