"""One way to write a file durably: :func:`atomic_write`.

Every file the service must find whole after a crash (checkpoints, the saved ``config.json``,
the ledger after a migration, anchors, exports, release files, the shuffler's state) is written
by this function, in these steps:

1. a temp file ``.<name>.tmp-<pid>-<random>`` is created in the *same directory* as the target
   (a rename is atomic only within one filesystem), with ``O_EXCL``: a leftover of a crashed
   process, or a concurrent writer of the same name (scale-out members share a directory), is
   never reused or truncated;
2. the data is written and the temp file is fsynced: its bytes are on disk before its name is;
3. the temp file is renamed over the target (``os.replace``; with ``exclusive=True`` it is
   hard-linked to the target instead, which fails if the target exists);
4. the directory is fsynced: the new directory entry survives a power loss too.

The guarantee: whatever instant the process is killed or the machine loses power, a reader of
the target sees either the complete old file (or none) or the complete new file, never a torn
or empty one. An exception before step 3 (a full disk, say) removes the temp file and leaves
the target as it was. A process killed before step 3 can leave its temp file behind; it starts
with a dot and never has the target's name, so readers do not see it, and its owner may sweep
``.<name>.tmp-*`` at start (see :class:`state_store.local.LocalStore`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["PRIVATE_MODE", "atomic_write", "fsync_dir"]

PRIVATE_MODE = 0o600  # checkpoints, exports, summaries: views of noisy state, owner only


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the directory ``path`` (makes a rename or a new name in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike,
    data: bytes | str | Iterable[bytes],
    *,
    mode: int | None = PRIVATE_MODE,
    exclusive: bool = False,
    hook: Callable[[str], None] | None = None,
) -> bool:
    """Write ``data`` to ``path`` atomically and durably (the module's docstring says how and
    what a crash leaves). Returns True; with ``exclusive``, False (and nothing written) if
    ``path`` already exists.

    ``data``: bytes, a str (written as UTF-8) or an iterable of bytes-like chunks.
    ``mode``: the file's permission bits whatever the umask; the default is owner-only (a view
    of the state or a service-internal file). ``None`` follows the umask, as ``open(path, "w")``
    does. ``hook(stage)`` is called at ``"mid-write"`` (after the first chunk is flushed),
    ``"before-rename"`` and ``"after-rename"``: the failpoints of crash tests.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> atomic_write(d / "a.json", '{"x": 1}\\n'), (d / "a.json").read_text()
    (True, '{"x": 1}\\n')
    >>> atomic_write(d / "a.json", b"other", exclusive=True), (d / "a.json").read_text()
    (False, '{"x": 1}\\n')
    >>> oct((d / "a.json").stat().st_mode & 0o777), sorted(p.name for p in d.iterdir())
    ('0o600', ['a.json'])
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else PRIVATE_MODE)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # exact bits: the umask may have taken some away
        with os.fdopen(fd, "wb") as f:
            fd = -1  # the file object owns it now
            for i, chunk in enumerate(chunks):
                f.write(chunk)
                if hook is not None and i == 0:
                    f.flush()
                    hook("mid-write")
            f.flush()
            os.fsync(f.fileno())
        if hook is not None:
            hook("before-rename")
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
    finally:
        if fd != -1:
            os.close(fd)
        tmp.unlink(missing_ok=True)  # gone already after a replace; the spare link otherwise
    if hook is not None:
        hook("after-rename")
    fsync_dir(path.parent)
    return True
