"""The state directory's lock: one service per ``checkpoint.dir`` (every mode takes it).

A start claims the directory (:func:`claim_directory`): it makes the directory and holds
``service.lock`` (an flock with the holder's pid inside) for as long as it runs. A start that is
refused afterwards removes what it created (:func:`remove_created`), so that a refused start
leaves the directory as it was (:class:`DirectoryClaim` holds both for one service). Durable
writes here: ``service.lock`` only (a pid, no data).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import ServiceError

__all__ = [
    "DirectoryClaim",
    "claim_directory",
    "lock_directory",
    "remove_created",
    "service_running",
]


def remove_created(paths) -> None:
    """Remove ``paths`` (created by a start, in that order) in reverse: the lock file, then
    directories left empty; one that is not empty, or gone, stays as it is."""
    for path in reversed(paths):
        try:
            path.rmdir() if path.name != "service.lock" else path.unlink()
        except OSError:
            pass


def claim_directory(directory: Path, *later: Path):
    """Make ``directory`` and hold its lock (:func:`lock_directory`) for a start. Returns (the
    paths that did not exist before: ``directory``, ``later`` (paths the start makes after
    this) and the lock file, for :func:`remove_created` after a refused start; the open lock
    file)."""
    directory = Path(directory)
    created = [p for p in (directory, *later, directory / "service.lock") if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return created, lock_directory(directory)


class DirectoryClaim:
    """One service's claim on ``directory`` (and on ``later``, paths its start makes after it):
    :meth:`claim` at the start, :meth:`remove_created` after a refused one, :meth:`release` at
    the stop."""

    def __init__(self, directory: Path, *later: Path):
        self.dir, self.later = Path(directory), later
        self.created: list[Path] = []
        self.lock_file = None

    def claim(self) -> None:
        """Make the directory and hold its lock (:func:`claim_directory`)."""
        self.created, self.lock_file = claim_directory(self.dir, *self.later)

    def remove_created(self) -> None:
        """After a refused start (the lock released): remove what :meth:`claim` created, so
        that the directory is as it was (an empty new directory is removed too)."""
        remove_created(self.created)
        self.created = []

    def release(self) -> None:
        """Release the lock (closing its file)."""
        if self.lock_file is not None:
            self.lock_file.close()
            self.lock_file = None


def lock_directory(directory: Path):
    """Hold ``directory/service.lock`` (flock) for this process, with its pid inside; one line
    naming the other process if it is held. Returns the open file: closing it unlocks."""
    f = open(Path(directory) / "service.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise ServiceError(
            f"another panagg (pid {other}) is running on checkpoint.dir "
            f"{directory}; stop it or use another directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def service_running(checkpoint_dir: str | os.PathLike) -> bool:
    """True if a service holds the lock on ``checkpoint_dir``."""
    path = Path(checkpoint_dir) / "service.lock"
    if not path.exists():
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False
