"""Distinct users through the service (``state.privacy_unit = "user"``): interval coverage and
stated against actual relative error, measured on login files with known truth.

Each run writes a file of ``--windows`` count windows of 5,000 logins (window w: 1,201-3,101
users, each at least once, five heavy users with 300 logins each, the rest spread), runs
``panagg run`` over it in a subprocess (eps 1, ``state.expected_users`` 2,000, OS noise) and
reads the releases against the truth. The same files as tests/test_user_service.py.

    python -m bench.service.user_windows --runs 8       # 192 windows, about 70 s
    python -m bench.service.user_windows --runs 8 --span 4   # and 48 spans of 4 windows

``--span K``: ``window.rollups = ["Kx"]`` beside the windows (docs/privacy_unit.md,
"Rollups"): a density state per span of K windows, ``state.rollup_expected_users`` K x 2,000,
read against the span's truth (the windows' users are distinct, so their sum).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.harness import ROOT, parser

WINDOW = 5000  # logins per count window


def write_logins(path: Path, windows: int, seed: int = 7) -> list[int]:
    """``windows`` windows of :data:`WINDOW` login events (JSON lines ``{"user": ...}``); window
    w has its own users (an odd number from 1,201 to 3,101), every one logging in at least
    once, five heavy users with 300 logins and the rest spread over all. Returns the true
    distinct users of each window."""
    rng = np.random.default_rng(seed)
    truth, lines = [], []
    for w in range(windows):
        users = int(rng.integers(600, 1550)) * 2 + 1
        ids = [f"alice-{w}-{i:05d}" for i in range(users)]
        rest = WINDOW - users - 5 * 300
        stream = (
            ids
            + [u for u in ids[:5] for _ in range(300)]
            + [ids[int(i)] for i in rng.integers(0, users, rest)]
        )
        rng.shuffle(stream)
        lines += [json.dumps({"user": u, "event": "login"}) for u in stream]
        truth.append(users)
    path.write_text("\n".join(lines) + "\n")
    return truth


def run_once(
    directory: Path, windows: int, seed: int, span: int = 0
) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """(truth, the release's ``distinct_users``) of each window of one service run, and of
    each span with ``span`` (window.rollups = ["<span>x"])."""
    truth = write_logins(directory / "logins.jsonl", windows, seed)
    sets = {
        "source.kind": "file",
        "source.path": directory / "logins.jsonl",
        "source.format": "json",
        "item.field": "user",
        "state.privacy_unit": "user",
        "state.expected_users": 2000,
        "window.kind": "count",
        "window.size": WINDOW,
        "ledger.budget_per_user": windows,  # (every window released: eps 1 each)
        "checkpoint.dir": directory / "state",
        "release.dir": directory / "releases",
        "metrics.port": -1,
        "release.on_exhausted": "false",
        # a registry of its own: not the user's, where a rerun's file would be refused
        "ledger.file_registry": directory / "budget-registry.jsonl",
    }
    if span:
        sets.update(
            {
                "window.rollups": f"{span}x",
                "state.rollup_expected_users": 2000 * span,
                "ledger.budget_per_user": windows + windows // span,
            }
        )
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    res = subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    base = directory / "releases" / ("base" if span else "")
    out = []
    for w, users in enumerate(truth):
        doc = json.loads((base / f"release-{w}.json").read_text())
        out.append((users, doc["distinct_users"]))
    spans = []
    for s in range(windows // span if span else 0):
        doc = json.loads((directory / "releases" / f"r{span}x" / f"release-{s}.json").read_text())
        spans.append((sum(truth[s * span : (s + 1) * span]), doc["distinct_users"]))
    return out, spans


def summary(rows: list[tuple[int, dict]], what: str) -> str:
    inside = sum(d["interval"][0] <= u <= (d["interval"][1] or np.inf) for u, d in rows)
    errs = np.array([(d["value"] - u) / u for u, d in rows])
    stated = np.array([d["expected_relative_error"] for _, d in rows])
    rms = float(np.sqrt(np.mean(errs**2)))
    return (
        f"{len(rows)} {what}: 90% interval coverage {inside / len(rows):.3f}; "
        f"RMS relative error {rms:.3f}, mean stated {stated.mean():.3f}, stated / actual "
        f"{stated.mean() / rms:.2f}"
    )


def main() -> None:
    ap = parser(__doc__, "one run of two windows and their span")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--span", type=int, default=0, help='window.rollups = ["<span>x"]')
    args = ap.parse_args()
    runs, windows = (1, 2) if args.smoke else (args.runs, args.windows)
    span = 2 if args.smoke else (min(args.span, windows) if args.span else 0)  # (smoke: both)
    rows, spans = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            d = Path(tmp) / str(r)
            d.mkdir()
            one, more = run_once(d, windows, seed=100 + r, span=span)
            rows += one
            spans += more
    print(summary(rows, f"windows ({runs} runs)"))
    if spans:
        print(summary(spans, f"spans of {span} windows (window.rollups, one state each)"))


if __name__ == "__main__":
    main()
