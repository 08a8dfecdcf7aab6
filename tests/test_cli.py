"""panagg demo: runs the whole pipeline, writes release files; bad flags are one line, exit 2."""

import os
import json
import subprocess
import sys

import numpy as np


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=None if env is None else {**os.environ, **env},
    )


def test_demo_writes_releases(tmp_path):
    out = tmp_path / "rel"
    res = run(
        "demo",
        "--events",
        "60000",
        "--accounts",
        "3000",
        "--windows",
        "2",
        "--output",
        str(out),
        env={"PANAGG_RELEASE_PLOTS": "true"},
    )  # (conftest: false)
    assert res.returncode == 0, res.stderr
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith(".panagg-ledger-head-"))
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
    res = run(
        "demo",
        "--events",
        "5000",
        "--accounts",
        "500",
        "--model",
        "state-only",
        "--output",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    rel = json.loads((tmp_path / "release-0.json").read_text())
    assert rel["layers"] == 1 and "caveat" in rel


def test_bad_flags_are_one_clear_line():
    for args in (
        ["demo", "--events", "-3"],
        ["demo", "--epsilon", "zero"],
        ["demo", "--events", "2", "--windows", "5"],
        ["demo", "--model", "central"],
    ):
        res = run(*args)
        assert res.returncode == 2, args
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert "Traceback" not in res.stderr
        assert lines[-1].startswith(("panagg: error:", "panagg demo: error:")), res.stderr


def test_central_from_csv_counts_and_json_prevalences(tmp_path):
    counts = tmp_path / "counts.csv"
    counts.write_text("count\n" + "\n".join(str(c) for c in [400, 200, 120] + [3] * 50 + [1] * 300))
    res = run(
        "central",
        "--input",
        str(counts),
        "--epsilon",
        "2",
        "--output",
        str(tmp_path),
        "--name",
        "a",
    )
    assert res.returncode == 0, res.stderr
    rel = json.loads((tmp_path / "release-a.json").read_text())
    assert rel["model"] == "central" and rel["algorithm"] == "dpanonhist" and rel["n"] is None
    assert (tmp_path / "release-a.png").exists()
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"prevalences": [[1, 3000], [2, 800], [50, 4]]}))
    res = run(
        "central",
        "--input",
        str(prev),
        "--epsilon",
        "0.5",
        "--output",
        str(tmp_path),
        "--name",
        "b",
    )
    assert res.returncode == 0, res.stderr
    rel = json.loads((tmp_path / "release-b.json").read_text())
    assert rel["algorithm"] == "privhist"
    total = sum(r * c for r, c in rel["histogram"]["pairs"])
    assert abs(total - (3000 + 1600 + 200)) < 1500


def test_central_bad_inputs_are_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3\n4,5,6\n")
    neg = tmp_path / "neg.json"
    neg.write_text("[3, -1]")
    for args in (
        ["central", "--input", str(bad), "--epsilon", "1"],
        ["central", "--input", str(neg), "--epsilon", "1"],
        ["central", "--input", str(tmp_path / "missing.csv"), "--epsilon", "1"],
        ["central", "--input", str(neg), "--epsilon", "0.5", "--algorithm", "dpanonhist"],
    ):
        res = run(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert "Traceback" not in res.stderr and res.stderr.strip().startswith("panagg")
        assert len(res.stderr.strip().splitlines()) == 1


def test_central_two_column_csv_needs_its_form(tmp_path):
    """A headed account,count CSV was once read as (r, phi_r): n_hat 58.7M for 40k events."""
    per_item = tmp_path / "accounts.csv"
    counts = [5, 3, 3, 2] + [1] * 40
    per_item.write_text("\n".join(f"{1000 + i},{c}" for i, c in enumerate(counts)) + "\n")
    res = run("central", "--input", str(per_item), "--epsilon", "2", "--output", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"panagg: error: {per_item}: two columns and no header: say what they are with --form "
        "per-item (item, count: one line per item) or --form prevalences (r, phi_r: how many "
        "items were seen r times)"
    )
    res = run(
        "central",
        "--input",
        str(per_item),
        "--epsilon",
        "2",
        "--form",
        "per-item",
        "--output",
        str(tmp_path),
        "--name",
        "p",
        "--public-n",
        str(sum(counts)),
    )
    assert res.returncode == 0, res.stderr
    rel = json.loads((tmp_path / "release-p.json").read_text())
    assert rel["n_in_histogram"] < 3 * sum(counts)  # per item, not (r, phi_r) pairs
    # a header that names the columns decides; one that does not is refused
    headed = tmp_path / "headed.csv"
    headed.write_text("account,count\n" + per_item.read_text())
    res = run(
        "central",
        "--input",
        str(headed),
        "--epsilon",
        "2",
        "--output",
        str(tmp_path),
        "--name",
        "h",
        "--public-n",
        str(sum(counts)),
    )
    assert res.returncode == 0, res.stderr
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b\n" + per_item.read_text())
    res = run("central", "--input", str(odd), "--epsilon", "2", "--output", str(tmp_path))
    assert res.returncode == 2 and "two columns and header 'a,b'" in res.stderr
    # prevalences with a repeated r are not prevalences
    repeated = tmp_path / "repeated.csv"
    repeated.write_text("1,5\n2,3\n1,4\n")
    res = run(
        "central",
        "--input",
        str(repeated),
        "--epsilon",
        "2",
        "--form",
        "prevalences",
        "--output",
        str(tmp_path),
    )
    assert res.returncode == 2
    assert res.stderr.strip().endswith(
        "some r repeats: is it an (item, count) file? use --form per-item"
    )
    prev = tmp_path / "prev.csv"
    prev.write_text("r,phi_r\n1,300\n2,40\n7,2\n")
    res = run(
        "central", "--input", str(prev), "--epsilon", "2", "--output", str(tmp_path), "--name", "v"
    )
    assert res.returncode == 0, res.stderr


def test_kafka_client_tracebacks_are_one_line_and_ours_are_kept():
    # kafka-python logs errors it recovers from (a socket closed under a pending read) with a
    # traceback; the service log condenses those, but never its own
    code = (
        "import logging\n"
        "from aggregator.service.cli import _setup_logging\n"
        "_setup_logging()\n"
        "try:\n"
        "    None.recv(4096)\n"
        "except AttributeError:\n"
        "    logging.getLogger('kafka.net.transport').exception('%s: Error receiving', 'conn-1')\n"
        "try:\n"
        "    raise ValueError('ours')\n"
        "except ValueError:\n"
        "    logging.getLogger('aggregator.service').exception('window close failed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    kafka_line = [ln for ln in lines if "kafka.net.transport" in ln]
    assert len(kafka_line) == 1
    assert kafka_line[0].endswith(
        "conn-1: Error receiving (AttributeError: 'NoneType' object has no attribute 'recv')"
    )
    assert out.stderr.count("Traceback") == 1  # ours
    assert out.stderr.index("window close failed") < out.stderr.index("Traceback")
    assert "ValueError: ours" in out.stderr


def test_repeated_kafka_client_lines_are_condensed_and_ours_are_not():
    # the client may repeat a line many times a minute (a rebalance storm; a broker outage's
    # reconnect lines are left out altogether: test_operator_mistakes.py): one line per minute
    # per kind is shown, the next says how many were held back; panagg's own lines all pass
    code = (
        "import logging\n"
        "from aggregator.service import cli\n"
        "cli._setup_logging()\n"
        "for h in logging.getLogger().handlers:\n"
        "    for f in h.filters:\n"
        "        if isinstance(f, cli._RepeatedLibraryLines):\n"
        "            f.window_s = 0.5\n"
        "import time\n"
        "for i in range(50):\n"
        "    logging.getLogger('kafka.coordinator').error('Heartbeat failed: %s', "
        "'UnknownMemberIdError')\n"
        "    logging.getLogger('panagg.service').warning('ours %d', i)\n"
        "time.sleep(0.6)\n"
        "logging.getLogger('kafka.coordinator').error('Heartbeat failed: %s', "
        "'UnknownMemberIdError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    kafka = [ln for ln in lines if "kafka.coordinator" in ln]
    assert len(kafka) == 2
    assert kafka[1].endswith(
        "Heartbeat failed: UnknownMemberIdError (and 49 like it in the last 0 s)"
    )
    assert sum("panagg.service: ours" in ln for ln in lines) == 50


def test_central_never_overwrites_another_release(tmp_path):
    counts = tmp_path / "c.csv"
    counts.write_text("\n".join(str(c) for c in [5, 3, 3, 1]) + "\n")
    first = run("central", "--input", str(counts), "--epsilon", "2", "--output", str(tmp_path))
    assert first.returncode == 0, first.stderr
    again = run("central", "--input", str(counts), "--epsilon", "2", "--output", str(tmp_path))
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "a different release is already in this file" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def test_a_second_demo_run_writes_beside_the_first_not_over_it(tmp_path):
    out = tmp_path / "rel"
    assert (
        run("demo", "--events", "3000", "--accounts", "300", "--output", str(out)).returncode == 0
    )
    first = (out / "release-0.json").read_bytes()
    res = run("demo", "--events", "3000", "--accounts", "300", "--output", str(out))
    assert res.returncode == 0, res.stderr
    assert (out / "release-0.json").read_bytes() == first
    (again,) = out.glob("run-*/release-0.json")
    assert str(again) in res.stdout


def test_version_flag_and_build_info_metric():
    from importlib.metadata import version

    from prometheus_client import generate_latest

    from aggregator.service.metrics import Metrics

    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"panagg {version('panagg')}"
    text = generate_latest(Metrics().registry).decode()
    assert (
        f'panagg_build_info{{python="{sys.version.split()[0]}",version="{version("panagg")}"}} 1.0'
    ) in text


def _run_with_path(extra_path, *args):
    import os

    env = dict(os.environ, PYTHONPATH=str(extra_path))
    elsewhere = extra_path / "cwd"  # not the source tree: as an installed panagg runs
    elsewhere.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=elsewhere,
    )


def test_a_foreign_package_with_one_of_our_names_is_refused(tmp_path):
    """aggregator, consumers and state_store are generic names: another install that shadows
    one of them must not run silently under panagg's name."""
    (tmp_path / "consumers").mkdir()
    (tmp_path / "consumers" / "__init__.py").write_text("")
    res = _run_with_path(tmp_path, "ledger", "show", "--state-dir", str(tmp_path))
    assert res.returncode == 2
    line = res.stderr.strip()
    assert line.startswith("panagg: error: panagg's packages come from different places (")
    assert f"consumers from {tmp_path.resolve()}" in line
    assert line.endswith("install panagg in its own virtual environment (python -m venv)")


def test_another_distribution_declaring_our_names_is_refused(tmp_path):
    dist = tmp_path / "otherlib-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: otherlib\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("state_store\n")
    (dist / "RECORD").write_text("")
    res = _run_with_path(tmp_path, "ledger", "show", "--state-dir", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "panagg: error: top-level package names of panagg are installed by other distributions "
        "too ('state_store' also by otherlib): one overwrote the other's files; install panagg "
        "in its own virtual environment (python -m venv)"
    )


def test_plan_prints_the_accuracy_plan_and_fails_below_the_noise():
    ok = run("plan", "--set", "state.domain_size=1000000", "--set", "window.size=40000")
    assert ok.returncode == 0 and ok.stdout.startswith("accuracy plan: 1,000,000 counters (D)")
    low = run("plan", "--set", "state.domain_size=100000000", "--set", "window.size=40000")
    assert low.returncode == 1 and "BELOW THE NOISE at 40,000 events" in low.stdout


def test_status_of_a_group_members_scratch_dir_points_to_the_group(tmp_path):
    # a member of a Kafka-only group keeps only scratch files: its state is in the group's topics
    saved = {
        "source": {"kind": "kafka", "group": "logins", "bootstrap": "10.0.0.5:9092"},
        "scale": {"partitioned": True},
        "window": {"kind": "time", "size": 60},
    }
    (tmp_path / "config.json").write_text(json.dumps(saved))
    res = run("status", "--state-dir", str(tmp_path))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert lines == [
        f"panagg: error: {tmp_path} is the scratch directory of a member of group "
        "'logins', whose state is in Kafka: run panagg status --group logins "
        "--bootstrap 10.0.0.5:9092"
    ], lines


def test_group_status_of_a_starting_group_says_so():
    """``panagg status --group`` run just after the members start (the README's group loop)
    finds the group's topics before any member wrote the identity: it says the group is starting
    instead of printing "None mode, None counters ... eps None"."""
    from aggregator.service.group.status import format_group_status

    starting = {"group": "panagg", "identity": {}, "members": [], "state": "Dead"}
    lines = format_group_status(starting)
    assert lines[0].startswith("group panagg (Kafka-only store): starting")
    assert "None" not in "\n".join(lines) and lines[1] == "members (0, group Dead):"
    ident = {
        "mode": "exact",
        "size": 1000,
        "partitions": 3,
        "epsilon": 1.0,
        "window_kind": "time",
        "window_size": 3600,
    }
    started = format_group_status({**starting, "identity": ident})
    assert started[0] == (
        "group panagg (Kafka-only store): exact mode, 1000 counters in 3 "
        "slices, eps 1.0, windows of 3600 s"
    )
