"""panagg demo: runs the whole pipeline, writes release files; bad flags are one line, exit 2."""

import json
import subprocess
import sys

import numpy as np


def run(*args):
    return subprocess.run([sys.executable, "-m", "aggregator.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_demo_writes_releases(tmp_path):
    out = tmp_path / "rel"
    res = run("demo", "--events", "60000", "--accounts", "3000", "--windows", "2",
              "--output", str(out))
    assert res.returncode == 0, res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["release-0.json", "release-0.png", "release-1.json", "release-1.png"]
    rel = json.loads((out / "release-1.json").read_text())
    assert rel["n"] == 30000 and rel["model"] == "joint" and rel["layers"] == 2
    assert rel["epsilon"] == 1.0 and rel["neighbor"] == "replace-one"
    pairs = np.array(rel["histogram"]["pairs"])
    assert np.all(np.diff(pairs[:, 0]) < 0) and np.all(pairs[:, 1] > 0)
    assert abs(int((pairs[:, 0] * pairs[:, 1]).sum()) - 30000) < 3000
    assert (out / "release-0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "seed" not in json.dumps(rel)


def test_state_only_release_carries_its_caveat(tmp_path):
    res = run("demo", "--events", "5000", "--accounts", "500", "--model", "state-only",
              "--output", str(tmp_path))
    assert res.returncode == 0, res.stderr
    rel = json.loads((tmp_path / "release-0.json").read_text())
    assert rel["layers"] == 1 and "caveat" in rel


def test_bad_flags_are_one_clear_line():
    for args in (["demo", "--events", "-3"], ["demo", "--epsilon", "zero"],
                 ["demo", "--events", "2", "--windows", "5"], ["demo", "--model", "central"]):
        res = run(*args)
        assert res.returncode == 2, args
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert "Traceback" not in res.stderr
        assert lines[-1].startswith(("panagg: error:", "panagg demo: error:")), res.stderr
