"""Several aggregations over one JSON login stream, as tests/test_multi.py and the tests that
reuse its stream run them: the TOML of the aggregations, the stream, and a loaded config."""

from __future__ import annotations

import json
import random

from aggregator.service.config import load_config

BASE = """
[source]
kind = "file"
path = "{path}"
format = "json"
[release]
error_bar_reps = 0
# what is counted and ledgered is under test here, not the estimator: the fastest one
estimator = "threshold"
[window]
kind = "count"
size = 700
"""


def login_aggregations(domain_size: int, expected_n: int, sizes: dict) -> str:
    """The [ledger] and [aggregations.*] TOML of a JSON login stream (also the real-broker
    test's): per account (direct, epsilon 1), per IP and per device of logins only (hashed,
    epsilon 0.5 each), under a per-event budget of 2; ``sizes`` sets window.size by name."""
    tables = {
        "account": ['item.field = "user.id"', f"state.domain_size = {domain_size}"],
        "ip": ['item.field = "ip"'],
        "device": [
            'item.field = "device"',
            'item.filter_field = "event"',
            'item.filter_value = "login"',
        ],
    }
    lines = ["[ledger]", "budget_per_event = 2.0"]
    for name, keys in tables.items():
        lines += [f"[aggregations.{name}]", *keys]
        if name != "account":
            lines += [
                'state.mode = "hashed"',
                f"state.expected_n = {expected_n}",
                "state.epsilon = 0.5",
            ]
        if name in sizes:
            lines.append(f"window.size = {sizes[name]}")
    return "\n".join(lines) + "\n"


def write_events(path, count, seed, start=0):
    r = random.Random(seed)
    with open(path, "a") as f:
        for i in range(start, start + count):
            ev = {
                "user": {"id": r.randrange(200)},
                "ip": f"10.0.{r.randrange(9)}.{r.randrange(99)}",
                "device": f"d{r.randrange(60)}",
                "event": r.choice(["login", "login", "logout"]),
            }
            if i % 101 == 0:
                ev.pop("ip")  # a reject for ip only
            f.write(json.dumps(ev) + "\n")


def config(tmp_path, *sets):
    toml = tmp_path / "multi.toml"
    toml.write_text(
        BASE.format(path=tmp_path / "events.jsonl") + login_aggregations(200, 700, {"ip": 900})
    )
    return load_config(
        str(toml),
        [
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            *sets,
        ],
        env={},
    )
