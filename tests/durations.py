"""The measured length of each test, which `make test-fast` reads to leave the long ones out.

``tests/durations.tsv`` holds one line per test, ``seconds<TAB>node id``: setup, call and
teardown summed, as one run of the whole suite printed them with ``--durations=0``. The
conftest marks ``slow`` every test measured over :data:`SLOW_S` seconds (and every broker test,
whatever its length), and ``make test-fast`` deselects ``slow``. A test the file does not know
(new since the last measurement) runs in the fast lane until the file is measured again::

    python -m pytest -n 2 --dist loadgroup --durations=0 -p no:cacheprovider > suite.log
    python tests/durations.py suite.log

The file is a measurement, not a rule: a test's length on another machine differs, and the fast
lane is a convenience beside `make test` (the suite CI runs), never instead of it.

>>> parse(["1.50s call     tests/test_a.py::test_x@broker",
...        "0.20s setup    tests/test_a.py::test_x@broker",
...        "(2 durations < 0.005s hidden.)"])
{'tests/test_a.py::test_x': 1.7}
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

#: a test longer than this (in seconds, on the 2-core machine CI uses) is ``slow``: at 2 s the
#: fast lane took 188 s here (2,085 tests, 2026-11-30), over its 3 minutes
SLOW_S = 1.0

TSV = Path(__file__).with_name("durations.tsv")

_LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def parse(lines: Iterable[str]) -> dict[str, float]:
    """Seconds per node id from the ``--durations=0`` lines of a pytest log (an xdist group's
    ``@name`` suffix dropped: the id a test has without xdist)."""
    out: dict[str, float] = {}
    for line in lines:
        m = _LINE.match(line)
        if m:
            node = m.group(3).split("@")[0] if "::" in m.group(3) else m.group(3)
            out[node] = round(out.get(node, 0.0) + float(m.group(1)), 3)
    return out


def load(path: Path = TSV) -> dict[str, float]:
    """The measured seconds per node id (empty when the file is missing)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        seconds, _, node = line.partition("\t")
        if node:
            out[node] = float(seconds)
    return out


def broker_lanes(
    tests: Iterable[tuple[str, str]], measured: dict[str, float], lanes: int = 2
) -> dict[str, str]:
    """The xdist group of each file of broker tests (``tests``: (file, node id) pairs): whole
    files, the longest first, each to the lane with the least measured time so far; a test not
    measured counts :data:`SLOW_S`. Lane 0 is "broker", lane k "broker<k+1>". The same input
    gives the same lanes on every worker (xdist needs one collection everywhere).

    >>> broker_lanes([("a.py", "a.py::x"), ("a.py", "a.py::y"), ("b.py", "b.py::z"),
    ...               ("c.py", "c.py::w")], {"a.py::x": 50, "a.py::y": 20, "b.py::z": 40})
    {'a.py': 'broker', 'b.py': 'broker2', 'c.py': 'broker2'}
    >>> broker_lanes([("a.py", "a.py::x")], {}, lanes=1)
    {'a.py': 'broker'}
    """
    per_file: dict[str, float] = {}
    for path, node in tests:
        per_file[path] = per_file.get(path, 0.0) + measured.get(node, SLOW_S)
    load = [0.0] * max(1, lanes)
    out: dict[str, str] = {}
    for path in sorted(per_file, key=lambda f: (-per_file[f], f)):
        k = min(range(len(load)), key=lambda i: (load[i], i))
        load[k] += per_file[path]
        out[path] = "broker" if k == 0 else f"broker{k + 1}"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(
            "usage: python tests/durations.py PYTEST_LOG (a run with --durations=0)",
            file=sys.stderr,
        )
        return 2
    measured = parse(Path(argv[0]).read_text(errors="replace").splitlines())
    if not measured:
        print(
            f"{argv[0]} has no --durations=0 lines: run pytest with --durations=0", file=sys.stderr
        )
        return 2
    TSV.write_text(
        "".join(
            f"{s:.2f}\t{n}\n" for n, s in sorted(measured.items(), key=lambda kv: (-kv[1], kv[0]))
        )
    )
    slow = sum(1 for s in measured.values() if s > SLOW_S)
    print(f"{TSV}: {len(measured)} tests, {slow} over {SLOW_S:g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
