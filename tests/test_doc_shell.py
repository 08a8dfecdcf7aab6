"""Every ```sh block of README.md and docs/*.md runs as written, or is listed here with why it
cannot (issue 54: the docs' shell snippets were checked, never run).

Each block has one row in :data:`BLOCKS`, keyed by its page and first line:

- ``fast``: run here, with bash (``-e -o pipefail``), in a fresh directory laid out as a clone of
  this checkout (symlinks to its code, Makefile and deploy/; none of its state: no var/, out/),
  where ``panagg``, ``python`` and ``.venv/bin/panagg`` are this checkout's;
- ``broker``: run the same way by tests/integration/test_doc_shell.py against the session's
  broker, services stopped by SIGTERM once they answer;
- ``listed``: not run, for the reason given (Docker, a cluster, root, a bench's long matrix:
  its ``--smoke`` run is named, from tests/test_bench_smoke.py's table).

A block with no row fails :func:`test_every_shell_block_is_run_or_listed`, so the docs cannot grow
a snippet that nothing runs. Only what the pages call placeholders is filled in
(``127.0.0.1:PORT`` and the example address ``127.0.0.1:9092``: the broker); the reader's own
input files a block names (``logins.jsonl``, ``events.jsonl``) are written first (:data:`INPUTS`);
and the lines of :data:`SUPPLIED` are done by the test instead, each for its reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_bench_smoke import LANE as BENCH_SMOKE_LANE
from tests.test_doc_commands import PAGES, ROOT, sh_blocks

_SMOKE_WHERE = {
    "here": "tests/test_bench_smoke.py",
    "kafka": "tests/integration",
    "chaos": "tests/chaos/test_bench_chaos.py",
}


def _bench(module: str, size: str) -> tuple[str, str]:
    """A bench block: listed, its smoke run named from tests/test_bench_smoke.py's table (a
    bench missing there fails at import)."""
    return (
        "listed",
        f"a bench run of {size} as written; its --smoke run is in "
        f"{_SMOKE_WHERE[BENCH_SMOKE_LANE[module]]} (--smoke replaces the block's "
        "modes and sizes, so running it here would repeat that test, not this "
        "block)",
    )


_DEPLOY_WHY = (
    "no Docker engine or Kubernetes cluster on the test machine; "
    "docs/deploy.md ('The shell blocks of this page') says which check covers it"
)
#: (page, first line of the block) -> (lane, why it is not run here, or the run's note)
BLOCKS: dict[tuple[str, str], tuple[str, str]] = {
    (
        "README.md",
        "panagg run --set source.kind=file --set source.path=logins.jsonl --set "
        "source.format=json \\",
    ): ("fast", ""),
    (
        "README.md",
        "make demo        # writes out/releases/release-0.json and release-0.png (a "
        "later run: a new",
    ): ("fast", ""),
    (
        "README.md",
        "make test        # what CI runs (.ci/run); fails loudly if no test is collected",
    ): (
        "listed",
        "`make test` is this suite (this test included): a run inside the run, ~40 "
        "min on 2 cores; CI runs it as written (.ci/run's last line)",
    ),
    ("README.md", "make setup"): ("broker", ""),
    ("README.md", "for k in 1 2 3; do"): ("broker", ""),
    (
        "README.md",
        "panagg demo --events 1000000 --accounts 100000 --epsilon 1 --model joint "
        "--windows 1 --output out/releases",
    ): (
        "listed",
        "a reference card, one line per command, not a sequence: its lines need "
        "inputs the card does not make (panagg.toml, FILE, counts.csv, shuffle.toml, "
        "a running service for `release`) and three run until stopped; every line "
        "is parsed and its settings loaded by tests/test_doc_commands.py",
    ),
    (
        "docs/api.md",
        "python examples/kafka_consumer.py --bootstrap 127.0.0.1:9092 --topic "
        "logins --state-dir var/api \\",
    ): ("broker", ""),
    (
        "docs/chaos.md",
        "python -m bench.service.chaos --modes count,time,event_time,several,"
        "rollups_sum,rollups_hybrid,rollups_tree,count_confluent,"
        "several_confluent --faults kill9 --seeds 2 --seconds 40 "
        "--faults-per-run 10",
    ): _bench("service.chaos", "39 runs of 40-75 s, 35 min of production alone, killing brokers"),
    (
        "docs/chaos.md",
        "python -m bench.service.chaos --modes group2 --faults "
        "broker_restart,broker_kill --seeds 1 --seconds 75 --faults-per-run 4",
    ): _bench("service.chaos", "8 runs of 40-75 s each, about 8 min, killing brokers"),
    (
        "docs/chaos.md",
        "python -m bench.service.chaos --modes group_items_count2,"
        "group_items_event2 --faults none,kill9,broker_restart --seeds 2 "
        "--seconds 20",
    ): _bench("service.chaos", "18 runs of 20 s each, over 6 min, restarting brokers"),
    (
        "docs/chaos.md",
        "python -m bench.service.chaos --modes group_items_count3,"
        "group_items_event3 --faults none,kill9 --seeds 1 --seconds 20",
    ): _bench("service.chaos", "6 runs of 20 s each, over 2 min, killing a broker"),
    (
        "docs/chaos.md",
        "python -m bench.service.chaos --modes group_items_count2,"
        "group_items_event2,shuffle --faults broker_kill --seeds 1 --first-seed "
        "1001 --seconds 30",
    ): _bench("service.chaos", "3 runs of 30 s each, killing a broker"),
    (
        "docs/chaos.md",
        "python -m bench.service.chaos --modes group_snapshots2 --faults kill9 --seeds 2",
    ): _bench("service.chaos", "2 runs of 40-75 s, killing members"),
    ("docs/privacy_unit.md", "python -m bench.service.user_windows --runs 8"): _bench(
        "service.user_windows", "192 windows, about 70 s (its docstring)"
    ),
    ("docs/deploy.md", "cd deploy"): ("listed", _DEPLOY_WHY + " (docker compose)"),
    ("docs/deploy.md", "docker compose logs -f aggregator-1"): (
        "listed",
        _DEPLOY_WHY + " (docker compose)",
    ),
    (
        "docs/deploy.md",
        "docker build -f deploy/Dockerfile -t REGISTRY/panagg:0.1.0 . && "
        "docker push REGISTRY/panagg:0.1.0",
    ): ("listed", _DEPLOY_WHY + " (kubectl, a registry, a SASL cluster)"),
    (
        "docs/deploy.md",
        "useradd --system --home-dir /var/lib/panagg --shell /usr/sbin/nologin panagg",
    ): (
        "listed",
        "installs a system user, /etc and a systemd unit (root, systemd as PID 1); "
        "docs/deploy.md ('The shell blocks of this page') says which check "
        "covers it",
    ),
    (
        "docs/operations.md",
        "deploy/kafka/kafka.sh start var/kafka        # prints "
        "bootstrap=127.0.0.1:PORT (real KRaft broker)",
    ): ("broker", ""),
    ("docs/operations.md", "promtool check rules deploy/prometheus/alerts.yml"): ("fast", ""),
    ("docs/privacy.md", "mkdir -p archive && mv events.jsonl archive/events-1.jsonl"): ("fast", ""),
    ("docs/privacy.md", "PYTHONPATH=. python tests/test_density.py              # this table"): (
        "fast",
        "",
    ),
    (
        "docs/privacy_unit.md",
        "panagg plan --set state.privacy_unit=user --set "
        "state.expected_users=5000 --set ledger.budget_per_user=30",
    ): ("fast", ""),
    ("docs/scale-out.md", "for k in 1 2 3; do"): ("broker", ""),
    (
        "docs/shuffle.md",
        "mkdir -p keys      # in production a directory only the analyzer's "
        "user reads: /etc/panagg",
    ): (
        "listed",
        "the analyzer alone, over the analyzer topic a deployment makes with "
        "`panagg shuffle-topics` (its start refuses a missing topic in one line, "
        "tests/integration/test_kafka_start_errors.py); the page's walk-through "
        "below makes the keys and topics and starts the analyzer, and runs here",
    ),
    (
        "docs/shuffle.md",
        "panagg shuffle-recover --config shuffle.toml --state-dir var/analyzer --window 1 \\",
    ): (
        "listed",
        "needs a state directory holding a refused window; "
        "tests/integration/test_shuffle_params_kafka.py makes one and runs the "
        "recovery",
    ),
    ("docs/shuffle.md", "mkdir -p keys var"): ("broker", ""),
}
#: files a block reads as the reader's own input (the page does not make them): name -> lines
INPUTS = {
    "logins.jsonl": [json.dumps({"user": f"u{k % 700}", "item": k % 900}) for k in range(3000)],
    "events.jsonl": [json.dumps({"item": k % 900}) for k in range(3000)],
}
#: lines the test does instead of the block, each with why (a pattern of the whole line)
SUPPLIED = [
    (
        re.compile(r"^deploy/kafka/kafka\.sh (start|stop) var/kafka\b.*$", re.M),
        "the session's broker (tests/conftest.py's kafka_broker, started by this same script) is "
        "the block's broker: a second one per block would add a broker start (the fixture's "
        "setup: 10.7 s here) for nothing the fixture's own start does not already test",
    ),
]
#: clone entries the fresh directory links to (code, Makefile, deploy/, tests/, bench/)
CLONE = (
    "aggregator",
    "consumers",
    "state_store",
    "bench",
    "tests",
    "examples",
    "deploy",
    "docs",
    "Makefile",
    "pyproject.toml",
)


def blocks():
    """(page key, first line, line number, text) of every ```sh block of the docs."""
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for no, text in sh_blocks(page):
            yield name, text.splitlines()[0].strip(), no, text


def lane(page: str, first: str) -> tuple[str, str]:
    return BLOCKS.get((page, first), ("none", ""))


def cases(which: str):
    return [
        pytest.param(page, no, text, id=f"{page}:{no}")
        for page, first, no, text in blocks()
        if lane(page, first)[0] == which
    ]


def clone(tmp: Path, broker: str = "127.0.0.1:9092") -> tuple[Path, dict[str, str]]:
    """A fresh directory laid out as a clone, and the environment a reader's shell has there:
    ``panagg``/``python`` on PATH and ``.venv/bin/panagg`` are this checkout's (``make setup``
    finds the venv made: its stamp is newer than pyproject.toml)."""
    work, shims = tmp / "clone", tmp / "bin"
    for d in (work / ".venv" / "bin", shims):
        d.mkdir(parents=True)
    for name in CLONE:
        (work / name).symlink_to(ROOT / name)
    shim = {
        "panagg": f'exec "{sys.executable}" -m aggregator.service.cli "$@"\n',
        "python": f'exec "{sys.executable}" "$@"\n',
    }
    for d in (shims, work / ".venv" / "bin"):
        for name, body in shim.items():
            (d / name).write_text("#!/bin/sh\n" + body)
            (d / name).chmod(0o755)
    (shims / "python3").symlink_to(shims / "python")
    (work / ".venv" / ".installed").touch()
    for name, lines in INPUTS.items():
        (work / name).write_text("\n".join(lines) + "\n")
    # a block that names no metrics port serves on a free one, not the default 9464 another
    # test's service may hold at the time (a flag of the block still wins: the group loops')
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "PANAGG_METRICS_PORT": "0",
    }
    return work, env


def script(text: str, broker: str) -> str:
    """The block as bash runs it: placeholders filled, supplied lines replaced by a comment."""
    text = re.sub(r"127\.0\.0\.1:(PORT|9092)\b", broker, text)
    for line, _why in SUPPLIED:
        text = line.sub("# (supplied by the test: tests/test_doc_shell.py's SUPPLIED)", text)
    return text


def run_block(
    work: Path, env: dict[str, str], text: str, broker: str = "127.0.0.1:9092", timeout: float = 300
):
    (work.parent / "block.sh").write_text(script(text, broker))
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", str(work.parent / "block.sh")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_shell_block_is_run_or_listed():
    found = list(blocks())
    unplaced = [f"{p}:{no}: {first}" for p, first, no, _ in found if lane(p, first)[0] == "none"]
    assert not unplaced, (
        "shell blocks nothing runs: add each to tests/test_doc_shell.py's "
        "BLOCKS (fast, broker, or listed with why)\n" + "\n".join(unplaced)
    )
    stale = set(BLOCKS) - {(p, first) for p, first, _, _ in found}
    assert not stale, f"BLOCKS rows whose block is gone: {sorted(stale)}"
    assert sum(lane(p, f)[0] in ("fast", "broker") for p, f, _, _ in found) >= 9


def test_each_listed_block_says_why():
    """A listed block has a reason; one that points to a section of a page points to one that
    exists (docs/deploy.md's table of what checks its blocks)."""
    for page, first, no, _ in blocks():
        kind, why = lane(page, first)
        assert kind != "listed" or len(why) > 40, f"{page}:{no}: listed without a reason"
        for target, heading in re.findall(r"(docs/[\w-]+\.md) \('([^']+)'\)", why):
            assert re.search(rf"^#+ {re.escape(heading)}$", (ROOT / target).read_text(), re.M), (
                f"{page}:{no}: {target} has no section {heading!r}"
            )


@pytest.mark.parametrize("page, line, text", cases("fast"))
def test_shell_block_runs(page, line, text, tmp_path):
    work, env = clone(tmp_path)
    t0 = time.monotonic()
    res = run_block(work, env, text)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{page}:{line} exit {res.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"{page}:{line}:\n{out[-3000:]}"
    # what the block's own comments promise, where it promises a file
    if "make demo" in text:
        assert (work / "out" / "releases" / "release-0.json").exists(), out[-2000:]
    if "archive/events-1.jsonl" in text:
        assert not (work / "events.jsonl").exists() and (work / "var" / "panagg").is_dir()
        assert list((work / "releases").glob("release-*.json")), out[-2000:]
    print(f"{page}:{line}: {time.monotonic() - t0:.1f} s")
