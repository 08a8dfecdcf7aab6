"""The one-process service on files, as the tests run it: its settings under the test-only
noise seed (``testing.noise_seed``, honoured under PANAGG_TESTING=1), the state and release that
seed makes of known items, the CLI as a subprocess, and its checkpoints and ledger."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.release import make_release
from aggregator.service import Aggregator
from aggregator.service.config import load_config
from aggregator.state import PanPrivateHistogram
from consumers.file_source import FileSource
from state_store.audit import read_export
from state_store.local import LocalStore

D = 500

SEED = 4242

KEY_HEX = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"


def expected_noise(window=0, size=D, eps=1.0):
    return discrete_laplace(p_from_epsilon(eps), size, rng=np.random.default_rng([SEED, 0, window]))


def write_events(path: Path, items, bad=()):
    """JSON lines: good events, plus bad lines inserted at given positions."""
    lines = [json.dumps({"item": int(i), "ts": k}) for k, i in enumerate(items)]
    for pos, raw in bad:
        lines.insert(pos, raw)
    path.write_text("\n".join(lines) + "\n")


#: what is counted, checkpointed and ledgered is under test here, not the estimator (tested on
#: its own and in tests/test_release_accuracy.py): the services below and the releases they are
#: compared with use the fastest one
ESTIMATOR = "threshold"


def cfg_for(tmp_path, path, **overrides):
    sets = [
        "source.kind=file",
        f"source.path={path}",
        "source.format=json",
        "source.max_records=1000",
        f"state.domain_size={D}",
        "window.kind=count",
        "window.size=1000000",
        f"checkpoint.dir={tmp_path / 'state'}",
        f"release.dir={tmp_path / 'releases'}",
        "metrics.port=-1",
        f"testing.noise_seed={SEED}",
        "release.workers=0",
        f"release.estimator={ESTIMATOR}",
    ]
    sets += [f"{k}={v}" for k, v in overrides.items()]
    return load_config(None, sets)


def durable(tmp_path):
    """The latest checkpoint of the service in ``tmp_path``."""
    return LocalStore(tmp_path / "state" / "checkpoints").load_latest()


def ledger_entries(tmp_path):
    return [json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()]


def expected_state(items, window=0, eps=1.0) -> PanPrivateHistogram:
    """What the service's state of ``window`` must hold: the test noise plus exactly ``items``."""
    state = PanPrivateHistogram(eps, size=D, rng=np.random.default_rng([SEED, 0, window]))
    state.add_indices(np.asarray(items, dtype=np.int64))
    return state


def expected_release(items, window, model="joint"):
    return make_release(
        expected_state(items, window),
        model=model,
        window=window,
        rng=np.random.default_rng([SEED, 1, window]),
        method=ESTIMATOR,
    )


def live_counts_via_export(tmp_path, extra_env=None):
    """The open window's counters of a stopped service: an offline audit export replays the
    window from the source; its snapshot minus the (test-seeded) layer drawn before it."""
    res = run_cli(
        [
            "audit",
            "export",
            "--state-dir",
            str(tmp_path / "state"),
            "--set",
            f"testing.noise_seed={SEED}",
        ],
        {"PANAGG_AUDIT_KEY": KEY_HEX, **(extra_env or {})},
    )
    assert res.returncode == 0, res.stderr
    doc = read_export(res.stdout.strip().splitlines()[-1], bytes.fromhex(KEY_HEX))
    state = PanPrivateHistogram.deserialize(doc["state"])
    before = discrete_laplace(
        p_from_epsilon(1.0), D, rng=np.random.default_rng([SEED, 2, doc["window"]["id"], 1001, 0])
    )
    return state.counts - before, state, doc


def run_cli(args, env_extra=None, timeout=300):
    env = dict(os.environ, PANAGG_TESTING="1", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def cli_sets(tmp_path, path, **overrides):
    cfg = {
        "source.kind": "file",
        "source.path": str(path),
        "source.format": "json",
        "source.max_records": 500,
        "state.domain_size": D,
        "window.kind": "count",
        "window.size": 100000,
        "checkpoint.dir": tmp_path / "state",
        "release.dir": tmp_path / "releases",
        "metrics.port": -1,
        "testing.noise_seed": SEED,
        # these tests walk the close's synchronous checkpoint sequence (the release in the
        # loop, as event-time windows, snapshots and scale-out do); tests/test_release_worker.py
        # walks the release worker's
        "release.workers": 0,
        "release.estimator": ESTIMATOR,
    }
    cfg.update(overrides)
    out = ["run"]
    for k, v in cfg.items():
        out += ["--set", f"{k}={v}"]
    return out


def pause_line_said_once(cfg, path, caplog) -> tuple[Aggregator, str]:
    """A restart of ``cfg`` over the file at ``path`` whose budget is spent: a finite source is
    not paused (files run to their end), an endless one is, twice asked and said once (one
    ERROR). The restarted aggregator (not ready, for the caller's checks) and that line."""
    agg = Aggregator(cfg, FileSource(str(path), "json", batch=1000, progress=False))
    agg.restore()
    assert not agg.paused_for_budget(0.01, finite=True)  # files run to their end
    caplog.clear()  # (the run's own lines: a release below its noise floor logs an ERROR)
    with caplog.at_level("ERROR", logger="panagg.service"):
        assert agg.paused_for_budget(0.01, finite=False)
        assert agg.paused_for_budget(0.01, finite=False)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    return agg, msgs[0]


@contextlib.contextmanager
def generator_service(
    tmp_path, env, *, events, rate, metrics_port="-1", ready="service.lock", settle=1.5
):
    """A ``panagg run`` over the rate-limited generator in a subprocess: yields the process once
    ``ready`` exists in its state dir (plus ``settle`` s of counting), waits for it to end."""
    state_dir = tmp_path / "state"
    args = [
        "run",
        "--set",
        "source.kind=generator",
        "--set",
        f"source.generator_events={events}",
        "--set",
        f"source.generator_rate={rate}",
        "--set",
        "source.max_records=500",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.size=1000000",
        "--state-dir",
        str(state_dir),
        "--release-dir",
        str(tmp_path / "releases"),
        "--metrics-port",
        metrics_port,
        "--set",
        "release.on_exhausted=false",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not (state_dir / ready).exists() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(settle)
        yield proc
    finally:
        proc.wait(timeout=120)


def charge_by_position(state_dir: Path, part: str, n: int) -> np.ndarray:
    """Epsilon charged to each of the first ``n`` positions of ``part`` by the releases in
    every aggregation's ledger under ``state_dir``."""
    charge = np.zeros(n)
    for led in sorted(state_dir.glob("*/ledger.jsonl")):
        for e in (json.loads(x) for x in led.read_text().splitlines()):
            if e["kind"] == "release":
                lo, hi = e["ranges"].get(part, [0, 0])
                charge[lo:hi] += e["epsilon_spent"]
    return charge
