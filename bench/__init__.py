"""Benchmarks, in two packages on one harness (bench/README.md has the table of modules).

* :mod:`bench.accuracy`: the accuracy research notebook: what a release's errors are (estimators,
  the accuracy grid and its leave-one-family-out checks, interval coverage, hashed mode, rollups,
  the shuffle model), offline on seeded data.
* :mod:`bench.service`: what the running service costs: throughput, latency, stalls, hot-path
  timings, recovery, scale-out, faults and the privacy audit of the service code.
* shared, at this level because both packages use them: :mod:`bench.harness` (provenance, the
  common flags, timing, statistics, tables and doc sections) and :mod:`bench._data` (seeded item
  distributions and real frequency profiles; used by accuracy benches and by
  ``service.group``, ``service.release_time`` and ``service.views``).

Every bench runs as ``python -m bench.<package>.<name>`` from the repository root, and with
``--smoke`` at a tiny size (the suite runs them all: tests/test_bench_smoke.py).
"""
