"""What every benchmark shares: provenance, timing, statistics, tables and doc sections.

* provenance: :func:`git_rev` (HEAD, and which measured modules the working tree changes),
  :func:`cpu_model`, :func:`versions`, and :func:`provenance`, all three in one line;
* timing: :class:`Timer` (a ``with`` block) and :func:`timed` (repetitions of one call with the
  garbage collector held off, as the release's timings are read);
* statistics: :func:`mean_se`, :func:`ratio_se`, :func:`fmt`;
* tables, plots and docs: :func:`md_table`, :func:`pyplot` (matplotlib without a display) and
  :func:`write_doc_section` (a generated block between markers, so hand-written notes around it
  survive a re-run);
* grids run in parallel processes: :func:`parse_shard` and :func:`shard_of` (which cells
  ``--shard i/N`` runs);
* the command line every bench shares: :func:`parser` (the description from the module's
  docstring, and ``--smoke``: a run at a tiny size, seconds long, that writes nothing into docs/;
  tests/test_bench_smoke.py runs every bench with it) and :data:`ROOT` (the repository root, for
  docs/ and deploy/ paths).

The data the accuracy benchmarks draw (distributions, real profiles, seeded noise) is in
:mod:`bench._data`.

>>> for line in md_table(["cell", "regret"], [["zipf", "1.04"], ["heavy", "1.77"]]):
...     print(line)
| cell | regret |
|---|---|
| zipf | 1.04 |
| heavy | 1.77 |
>>> fmt(*mean_se([1.0, 2.0, 3.0]))
'2 ± 0.577'
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import time
from pathlib import Path

import numpy as np

__all__ = [
    "ROOT",
    "git_rev",
    "cpu_model",
    "versions",
    "provenance",
    "Timer",
    "timed",
    "mean_se",
    "ratio_se",
    "fmt",
    "md_table",
    "write_doc_section",
    "pyplot",
    "parse_shard",
    "shard_arg",
    "shard_of",
    "parser",
    "run_resumable",
]

#: the repository root: benches run from it (``python -m bench.<package>.<name>``)
ROOT = Path(__file__).resolve().parent.parent


def mean_se(xs) -> tuple[float, float]:
    """Mean and its standard error (nan where there are fewer than two values)."""
    x = np.asarray(xs, dtype=np.float64)
    if len(x) == 0:
        return float("nan"), float("nan")
    if len(x) == 1:
        return float(x[0]), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x)))


def ratio_se(a, b) -> tuple[float, float]:
    """Ratio of means and its delta-method standard error (independent samples)."""
    ma, sa = mean_se(a)
    mb, sb = mean_se(b)
    r = ma / mb
    if math.isnan(sa) or math.isnan(sb):
        return r, float("nan")
    return r, r * math.sqrt((sa / ma) ** 2 + (sb / mb) ** 2)


def git_rev(modules) -> str:
    """Short HEAD, noting which of ``modules`` the working tree changes (benchmark provenance)."""
    import subprocess

    root = ROOT
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--name-only", "HEAD", "--", *modules],
            cwd=root,
            text=True,
            capture_output=True,
        ).stdout.split()
        return rev + (f" (working tree differs from it in {', '.join(dirty)})" if dirty else "")
    except Exception:
        return "unknown"


def cpu_model() -> str:
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(packages) -> str:
    """ "Python x.y.z, numpy a.b, ..." for the packages that are installed."""
    import platform
    from importlib.metadata import version

    out = [f"Python {platform.python_version()}"]
    for pkg in packages:
        try:
            out.append(f"{pkg} {version(pkg)}")
        except Exception:
            pass
    return ", ".join(out)


def provenance(modules=("aggregator",), packages=("numpy",)) -> str:
    """One line for a result's header: the git revision (:func:`git_rev` of ``modules``), the CPU
    and its count, and the versions of ``packages``."""
    return f"git {git_rev(modules)}; {os.cpu_count()} CPUs, {cpu_model()}; {versions(packages)}"


def _num(v: float, digits: int) -> str:
    a = abs(v)
    if v == 0:
        return "0"
    if a >= 1e7 or a < 1e-2:
        return f"{v:.{digits - 1}e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def fmt(m: float, se: float, digits: int = 3) -> str:
    """'mean ± se' with readable numbers ('-' when there is no data)."""
    if math.isnan(m):
        return "-"
    return _num(m, digits) if math.isnan(se) else f"{_num(m, digits)} ± {_num(se, digits)}"


class Timer:
    """``with Timer() as t: ...`` then ``t.s``: the block's seconds."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
        return False


def write_doc_section(doc, marker: str, name: str, lines: list[str], title: str = "") -> None:
    """Replace (or append) the block between ``<!-- MARKER NAME begin/end -->`` in ``doc``."""
    import re

    doc = Path(doc)
    begin, end = f"<!-- {marker} {name} begin -->", f"<!-- {marker} {name} end -->"
    block = "\n".join([begin, *lines, end])
    text = doc.read_text() if doc.exists() else f"# {title}\n"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = (
        pat.sub(lambda _: block, text)
        if pat.search(text)
        else text.rstrip("\n") + "\n\n" + block + "\n"
    )
    doc.write_text(text)


def timed(fn, reps: int = 1) -> list[float]:
    """Seconds of ``reps`` calls of ``fn``, each with the garbage collector held off (a
    collection inside a call would be charged to it)."""
    times = []
    for _ in range(int(reps)):
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        finally:
            gc.enable()
    return times


def md_table(header, rows) -> list[str]:
    """A markdown table's lines: ``header`` (column names) then one line per row."""
    out = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only: benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def parse_shard(shard: str = "0/1") -> tuple[int, int]:
    """``"i/N"`` as (i, N), checked (0 <= i < N): one process's part of a grid run by N."""
    try:
        i, n = (int(v) for v in str(shard).split("/"))
    except ValueError:
        raise ValueError(f"--shard {shard!r}: expected i/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {shard!r}: need 0 <= i < N")
    return i, n


def shard_arg(text: str) -> str:
    """argparse ``type=`` for ``--shard``: the text, checked (a bad one is argparse's one-line
    usage error, not a trace)."""
    try:
        parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
    return text


def shard_of(items, shard: str = "0/1") -> list:
    """The items ``--shard i/N`` runs: every N-th, starting at the i-th (0 <= i < N), so that N
    processes started with i = 0 .. N-1 split a grid between them.

    >>> shard_of(range(7), "1/3")
    [1, 4]
    """
    i, n = parse_shard(shard)
    return [x for k, x in enumerate(items) if k % n == i]


def parser(doc: str, smoke: str = "") -> argparse.ArgumentParser:
    """A bench's argument parser: the first line of its docstring ``doc`` as the description,
    and ``--smoke``, a run at a tiny size (``smoke`` says which) that takes seconds and writes
    nothing into docs/: the run tests/test_bench_smoke.py makes of every bench.

    >>> parser("Throughput of one thing.\\n\\nMore.", "100 events").parse_args(["--smoke"]).smoke
    True
    """
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run for the test suite, seconds long, writing no doc"
        + (f" ({smoke})" if smoke else ""),
    )
    return ap


def run_resumable(path: Path, jobs, run_one, label) -> dict:
    """Run each of ``jobs`` ((key, job) pairs) whose key the pickled results at ``path`` do not
    hold yet, saving them after each job (a stopped study resumes where it was); ``label(job)``
    names the job in its progress line. Returns every result at ``path``."""
    done = pickle.loads(path.read_bytes()) if path.exists() else {}
    for key, job in jobs:
        if key in done:
            continue
        t = time.time()
        done[key] = run_one(job)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(done))
        tmp.replace(path)
        print(f"{label(job)}: {time.time() - t:.0f} s", flush=True)
    return done
