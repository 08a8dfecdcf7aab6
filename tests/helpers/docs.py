"""The fenced blocks of the docs' pages, and the files a page shows: a ``toml`` block whose first
line is ``# NAME.toml...`` is the file NAME.toml that the page's other blocks read."""

from __future__ import annotations

import re
from pathlib import Path

SKIP = re.compile(r"<!--\s*doc-test:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
KEY_PLACEHOLDER = re.compile(r"<[^>]*printed by shuffle-keygen>")
_KEY_FILES = re.compile(r'^(public_key|key_file)\s*=\s*"([^"/][^"]*)"', re.M)


def blocks(page: Path):
    """(language, first line number, text, skip reason or None) of each fenced block."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        above = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        skip = SKIP.search(above)
        yield (
            m.group(1),
            start + 1,
            "\n".join(lines[start + 1 : i]) + "\n",
            skip.group(1) if skip else None,
        )
        i += 1


def write_page_files(
    page: Path, cwd: Path, broker: str | None = None, make_keys: bool = False
) -> None:
    """Write the files ``page`` shows into ``cwd``: the example broker address replaced by
    ``broker``; a ``<... printed by shuffle-keygen>`` placeholder by a fresh public key; with
    ``make_keys``, the relative key files a file names (``public_key``, ``key_file``) made from
    a fresh key pair, for a block that reads them without making them (a shell block makes its
    own with ``panagg shuffle-keygen``)."""
    for lang, _, text, _ in blocks(page):
        m = re.match(r"#\s*(\S+\.toml)\b", text)
        if lang != "toml" or not m:
            continue
        if broker is not None:
            text = text.replace("127.0.0.1:9092", broker)
        if KEY_PLACEHOLDER.search(text) or make_keys and _KEY_FILES.search(text):
            from aggregator.service.shuffle_wire import new_keypair, public_key_hex

            pair = new_keypair()
            text = KEY_PLACEHOLDER.sub(public_key_hex(pair), text)
            for name, rel in _KEY_FILES.findall(text) if make_keys else ():
                (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
                (cwd / rel).write_text(
                    (public_key_hex(pair) if name == "public_key" else bytes(pair).hex()) + "\n"
                )
        (cwd / m.group(1)).write_text(text)
