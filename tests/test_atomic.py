"""state_store.atomic.atomic_write on real files: a crash between the write and the rename leaves
the old file whole and no temp file under a name a reader looks for; the file and then its
directory are fsynced; the service's durable files are all written by it."""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from state_store import atomic
from state_store.atomic import atomic_write

ROOT = Path(__file__).resolve().parent.parent


class Crash(Exception):
    pass


def visible(d: Path) -> list[str]:
    """What a reader of ``d`` sees: the names that do not start with a dot."""
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


@pytest.fixture
def fsyncs(monkeypatch):
    """Every os.fsync: ("dir", inode) or ("file", inode)."""
    seen = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        seen.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_write_fsyncs_the_file_then_its_directory(tmp_path, fsyncs):
    target = tmp_path / "config.json"
    assert atomic_write(target, '{"a": 1}') is True
    assert target.read_text() == '{"a": 1}'
    assert fsyncs == [("file", target.stat().st_ino), ("dir", tmp_path.stat().st_ino)]
    assert os.listdir(tmp_path) == ["config.json"]  # no temp file left


def test_a_crash_at_the_rename_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    target.write_text("old")

    def replace(src, dst):
        raise Crash("killed between write and rename")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        atomic_write(target, "new" * 10000)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["config.json"]


@pytest.mark.parametrize("stage", ["mid-write", "before-rename"])
def test_a_failure_before_the_rename_keeps_the_old_file(tmp_path, stage):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    def hook(at):
        if at == stage:
            raise Crash(at)

    with pytest.raises(Crash):
        atomic_write(target, [b"new-1", b"new-2"], hook=hook)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failing_write_removes_its_temp_file(tmp_path, monkeypatch):
    """A full disk: the write raises, the target is unchanged, the partial temp file is gone."""
    target = tmp_path / "ckpt"
    target.write_bytes(b"old")

    def chunks():
        yield b"x" * 1000
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, chunks())
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["ckpt"]


_KILLED_AT_THE_RENAME = """
import os, signal, sys
from state_store.atomic import atomic_write
def hook(stage):
    if stage == "before-rename":
        os.kill(os.getpid(), signal.SIGKILL)
atomic_write(sys.argv[1], b"new" * 100000, hook=hook)
"""


def test_a_process_killed_at_the_rename_leaves_the_old_file_to_readers(tmp_path):
    """A real SIGKILL after the temp file is written and fsynced: the target is the old file;
    the temp file stays (nothing ran to remove it) but under a dot name of its own."""
    target = tmp_path / "config.json"
    target.write_text("old")
    res = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_THE_RENAME, str(target)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == -9
    assert target.read_text() == "old"
    assert visible(tmp_path) == ["config.json"]
    [left] = [p for p in tmp_path.iterdir() if p.name != "config.json"]
    assert left.name.startswith(".config.json.tmp-") and left.stat().st_size == 300000


def test_exclusive_never_replaces(tmp_path, fsyncs):
    target = tmp_path / "release-0.json"
    assert atomic_write(target, b"first", mode=0o644, exclusive=True) is True
    assert ("dir", tmp_path.stat().st_ino) in fsyncs
    assert atomic_write(target, b"second", mode=0o644, exclusive=True) is False
    assert target.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["release-0.json"]


def test_the_mode_is_exact_whatever_the_umask_or_follows_it(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "public", b"x", mode=0o644)
        atomic_write(tmp_path / "private", b"x")
        atomic_write(tmp_path / "as-open", b"x", mode=None)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"public": 0o644, "private": 0o600, "as-open": 0o600}
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "as-open", b"y", mode=None)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "as-open").stat().st_mode) == 0o644


def test_the_config_json_writers_fsync_the_file_and_the_directory(tmp_path, fsyncs):
    """The saved config of the service, as its writers call the helper (the analyzer, a group
    member and a multi-aggregation service write theirs the same way)."""
    from aggregator.service.cli import _note_metrics_url
    from aggregator.service.config import load_config
    from aggregator.service.process import Aggregator

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'state'}"])
    agg = Aggregator.__new__(Aggregator)  # only what the writer reads: no source, no start
    agg.cfg, agg.dir = cfg, tmp_path / "state"
    agg.dir.mkdir()
    agg.save_effective_config()
    saved = json.loads((agg.dir / "config.json").read_text())
    assert saved["checkpoint"]["dir"] == str(tmp_path / "state")
    assert fsyncs == [
        ("file", (agg.dir / "config.json").stat().st_ino),
        ("dir", agg.dir.stat().st_ino),
    ]
    _note_metrics_url(cfg, "http://127.0.0.1:1/metrics")
    assert fsyncs[-1] == ("dir", agg.dir.stat().st_ino)
    assert visible(agg.dir) == ["config.json", "metrics.url"]
    assert [p.name for p in agg.dir.iterdir() if p.name.startswith(".")] == []


# -- every durable write goes through the helper -----------------------------------------------

#: writes that are not replacing a durable file, with the reason
NOT_DURABLE = {
    ("aggregator/service/ledger.py", "open"): "appends one fsynced line (the ledger's format)",
    ("aggregator/service/ledger.py", "link"): "keeps the v1 ledger as a backup before migrate "
    "replaces it (its directory fsync covers both)",
    ("aggregator/service/event_time.py", "open"): "appends one fsynced line to the positions",
    ("state_store/registry.py", "open"): "appends one fsynced line under an flock (the file "
    "budget registry, shared by every run of a user)",
    ("aggregator/service/stages/state_dir.py", "open"): "service.lock: an flock with the pid "
    "inside",
    ("aggregator/service/cli.py", "write_text"): "an empty control request (its name is all)",
    ("aggregator/service/cli.py", "save"): "np.save of the counters a user asked for (--counters)",
    ("aggregator/service/status.py", "savefig"): "the plot `panagg status --plot` draws",
    ("aggregator/release.py", "savefig"): "draws into the buffer plot_release writes",
    ("aggregator/service/settings_doc.py", "write_text"): "regenerates docs/configuration.md "
    "and the example config (in git)",
}


def _writes(path: Path):
    """(call name, line) of every call in ``path`` that writes or renames a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        base = f.value if isinstance(f, ast.Attribute) else None
        base = base.id if isinstance(base, ast.Name) else ""
        if name in ("write_text", "write_bytes", "rename", "link", "fdopen", "savefig") or (
            name == "save"
            and base == "np"
            and not (node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "buf")
        ):
            yield name, node.lineno
        elif (
            name == "replace"
            and len(node.args) + len(node.keywords) == 1
            or name == "replace"
            and base == "os"
        ):
            yield name, node.lineno
        elif name == "open" and base in ("", "os"):
            flags = ast.unparse(node)
            if (
                base == "os"
                and "O_WRONLY" in flags
                or base == ""
                and any(
                    isinstance(a, ast.Constant)
                    and isinstance(a.value, str)
                    and set(a.value) & set("wax+")
                    for a in node.args[1:]
                )
            ):
                yield name, node.lineno


def test_every_durable_write_is_the_atomic_helper():
    found = []
    for pkg in ("aggregator", "consumers", "state_store"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "state_store/atomic.py":
                continue
            for name, line in _writes(path):
                if (rel, name) not in NOT_DURABLE:
                    found.append(f"{rel}:{line} {name}")
    assert found == [], "write these with state_store.atomic.atomic_write: " + ", ".join(found)


def test_the_write_finder_sees_a_hand_written_atomic_write(tmp_path):
    """Negative control: the pattern the helper replaced is found."""
    src = tmp_path / "w.py"
    src.write_text(
        "import os\n"
        "def save(d, text):\n"
        "    tmp = d / '.config.json.tmp'\n"
        "    tmp.write_text(text)\n"
        "    os.replace(tmp, d / 'config.json')\n"
        "    with open(d / 'x', 'w') as f:\n"
        "        f.write(text)\n"
        "    name = text.replace('a', 'b')\n"
    )
    assert [n for n, _ in _writes(src)] == ["write_text", "replace", "open"]
    assert atomic.__all__ == ["PRIVATE_MODE", "atomic_write", "fsync_dir"]
