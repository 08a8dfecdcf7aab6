"""The ```sh blocks of README.md and docs/*.md that need Kafka, run as written against the
session's broker (issue 54; the table of every block is tests/test_doc_shell.py's BLOCKS).

Each block runs with bash in a fresh clone-like directory, ``127.0.0.1:PORT`` filled in with the
broker's address. The topic the blocks name, ``logins``, is made fresh with a few hundred
records, and the group ``panagg``'s topics and offsets of an earlier block are removed, as are
the ``/tmp/panagg-$k`` directories the group loops name. A block
that starts services (``panagg run`` in the foreground, the README's ``for k in 1 2 3; do ...
& done`` group loop) runs until every service's ``/ready`` answers 200 on the metrics port its
start line names (the block's own; a free one where the block gives none, rather than the
default 9464 another test may hold), or, for docs/api.md's example (no metrics), until it prints
its first release; then each service gets SIGTERM and must exit 0,
with no traceback in the block's output.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

from tests.helpers.docs import write_page_files
from tests.test_doc_shell import ROOT, cases, clone, script

TOPIC = "logins"  # the topic every block names
GROUP = "panagg"  # source.group's default: the group loops' group
RECORDS = 600
#: blocks whose service has no /ready (the API example, no metrics): the records to produce
#: and the line of its output that shows it answered (its first release)
ANSWERS = {"docs/api.md": (100_000, re.compile(r"^window 0: n=100000 ", re.M))}
#: appended to a block that leaves background jobs: marks the block's own lines done, then
#: waits for the jobs, whose exit statuses become the script's
EPILOGUE = (
    "\n# -- tests/integration/test_doc_shell.py: wait for the block's background jobs\n"
    'touch "{done}"\n'
    'rc=0; for p in $(jobs -p); do wait "$p" || rc=$?; done; exit $rc\n'
)


def _fresh_topic(bootstrap: str, records: int) -> None:
    """``logins`` made anew (3 partitions: one per member of the loops) with ``records``;
    the group's internal topics and committed offsets of an earlier block removed."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        old = [t for t in admin.list_topics() if t == TOPIC or t.startswith(f"{GROUP}.panagg")]
        if old:
            admin.delete_topics(old)
        groups = [g["group_id"] if isinstance(g, dict) else g[0] for g in admin.list_groups()]
        groups = [g for g in groups if g.startswith(GROUP)]
        if groups:
            admin.delete_groups(groups)
        deadline = time.monotonic() + 60
        # deletion is asynchronous: a member starting now would find a topic going away
        while set(old) & set(admin.list_topics()):
            assert time.monotonic() < deadline, f"{old} not deleted in 60 s"
            time.sleep(0.5)
        while True:
            try:
                admin.create_topics([NewTopic(TOPIC, num_partitions=3, replication_factor=1)])
                break
            except TopicAlreadyExistsError:  # still being deleted
                assert time.monotonic() < deadline, "topic logins not deleted in 60 s"
                time.sleep(0.5)
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    for k in range(records):
        producer.send(TOPIC, value=msgpack.packb({"item": k % 500}), partition=k % 3)
    producer.flush()
    producer.close()


def _service_count(text: str) -> int:
    """How many services the block starts: one per turn of its ``for k in ...`` loop, else one
    per ``panagg run`` or ``panagg shuffle`` line it sends to the background, else one."""
    loop = re.search(r"for k in ([\d ]+); do", text)
    if loop:
        return len(loop.group(1).split())
    return len(re.findall(r"^panagg (?:run|shuffle) .*&\s*(?:#.*)?$", text, re.M)) or 1


def _metrics_ports(output: str) -> list[int]:
    """The ports the services serve /ready on, from their ``metrics on URL`` start lines."""
    return [
        int(p) for p in re.findall(r"^metrics on http://127\.0\.0\.1:(\d+)/metrics$", output, re.M)
    ]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _children(pid: int) -> list[int]:
    """The block's services: what its shell runs now (a foreground command, background jobs)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _block_tmp_dirs(body: str) -> list[Path]:
    """The /tmp directories a block names (the group loops' ``/tmp/panagg-$k``), expanded."""
    loop = re.search(r"for k in ([\d ]+); do", body)
    found = []
    for path in set(re.findall(r"(/tmp/[\w.$-]+)", body)):
        ks = loop.group(1).split() if loop and "$k" in path else [""]
        found += [Path(path.replace("$k", k)) for k in ks]
    return found


@pytest.mark.parametrize("page, line, text", cases("broker"))
def test_shell_block_runs_against_kafka(page, line, text, kafka_broker, tmp_path):
    records, answer = ANSWERS.get(page, (RECORDS, None))
    _fresh_topic(kafka_broker, records)
    work, env = clone(tmp_path, kafka_broker)
    write_page_files(ROOT / page, work, broker=kafka_broker)  # the files the page shows
    body = script(text, kafka_broker)
    scratch = _block_tmp_dirs(body)  # outside the fresh directory: made fresh here too
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)
    done = tmp_path / "block-lines-done"
    if re.search(r"&\s*(?:#.*)?$", body, re.M):
        body += EPILOGUE.format(done=done)
    else:
        done.touch()  # a foreground service: the block's last line is the one running
    (tmp_path / "block.sh").write_text(body)
    log = tmp_path / "block.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        shell = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", str(tmp_path / "block.sh")],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        count, ports = _service_count(text), []

        def answered() -> bool:
            nonlocal ports
            if answer is not None:
                return bool(answer.search(log.read_text()))
            ports = _metrics_ports(log.read_text())
            return len(ports) == count and all(_ready(p) for p in ports)

        deadline = time.monotonic() + 120
        while not (done.exists() and answered()):
            assert shell.poll() is None, (
                f"{page}:{line} ended (exit {shell.returncode}) before /ready:\n"
                + log.read_text()[-4000:]
            )
            assert time.monotonic() < deadline, (
                f"{page}:{line}: no answer ({ports or answer}) in 120 s:\n{log.read_text()[-4000:]}"
            )
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        services = _children(shell.pid)
        assert len(services) == count, (services, ports)
        # the block's own status line, once more now that the services are up: it answers,
        # and (within a minute: the group may still be rebalancing) names every member ready
        for cmd in re.findall(r"^(?:\.venv/bin/)?panagg status .*$", body, re.M):
            deadline = time.monotonic() + 60
            while True:
                res = subprocess.run(
                    ["bash", "-c", cmd],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert res.returncode == 0, f"{cmd}:\n{res.stdout}{res.stderr}"
                if "--group" not in cmd or (
                    f"members ({count}, group Stable)" in res.stdout
                    and res.stdout.count("; ready, reported") == count
                ):
                    break
                assert time.monotonic() < deadline, f"{cmd}:\n{res.stdout}"
                time.sleep(2)
        for pid in services:
            os.kill(pid, signal.SIGTERM)
        rc = shell.wait(timeout=120)
    finally:  # whatever is left of the block (its shell may have exited, its jobs not)
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
    output = log.read_text()
    assert rc == 0, f"{page}:{line}: exit {rc} after SIGTERM:\n{output[-4000:]}"
    assert "Traceback" not in output, f"{page}:{line}:\n{output[-4000:]}"
    # panagg's own error lines (kafka-python logs a fenced leader producer at ERROR when the
    # group's leadership moves, as it does when members start together: fencing at work)
    assert not re.search(r"ERROR panagg\b", output), f"{page}:{line}:\n{output[-4000:]}"
    print(f"{page}:{line}: ready in {ready_s:.1f} s, {time.monotonic() - t0:.1f} s in all")
