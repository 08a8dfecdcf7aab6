"""bench.service.group's CPU figure counts a process's whole tree (a member's release workers
are its spawned children), each process once."""

import subprocess
import sys

import pytest

from bench.service.group import tree_cpu

#: a child that burns 0.3 s of CPU, says so, and sleeps
BURN = (
    "import time, sys\n"
    "while time.process_time() < 0.3: pass\n"
    "print('burnt', flush=True); time.sleep(60)\n"
)
#: a parent that starts BURN as its child, waits for it, and sleeps without using CPU
PARENT = (
    "import subprocess, sys, time\n"
    f"c = subprocess.Popen([sys.executable, '-c', {BURN!r}], stdout=subprocess.PIPE, "
    "text=True)\n"
    "c.stdout.readline(); print('ready', flush=True); time.sleep(60)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tree_cpu_counts_the_children_of_a_process():
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        total = tree_cpu(p.pid)
        assert 0.3 <= total < 0.6  # the child's burn is in, once (and two interpreters' starts)
    finally:
        p.kill()
        p.wait()
