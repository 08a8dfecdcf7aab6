"""The user-unit service (``state.privacy_unit = "user"``) on a file of logins, as the tests run
it: its command line under the test noise seed, and its releases and ledger."""

from __future__ import annotations

import json

from bench.service.user_windows import WINDOW

SEED = 20260


def user_args(tmp_path, path, **overrides):
    cfg = {
        "source.kind": "file",
        "source.path": str(path),
        "source.format": "json",
        "source.max_records": 700,
        "item.field": "user",
        "state.privacy_unit": "user",
        "state.expected_users": 2000,
        "ledger.budget_per_user": 100,
        "window.kind": "count",
        "window.size": WINDOW,
        "checkpoint.dir": tmp_path / "state",
        "release.dir": tmp_path / "releases",
        "metrics.port": -1,
        "testing.noise_seed": SEED,
        "release.on_exhausted": "false",
    }
    cfg.update(overrides)
    out = ["run"]
    for k, v in cfg.items():
        out += ["--set", f"{k}={v}"]
    return out


def releases(tmp_path) -> dict[int, dict]:
    out = {}
    for f in (tmp_path / "releases").glob("release-*.json"):
        doc = json.loads(f.read_text())
        out[doc["window"]] = doc
    return out


def ledger(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()]
