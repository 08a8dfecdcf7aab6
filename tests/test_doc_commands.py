"""Every shell command of README.md and docs/*.md names what exists (issue 54). The ```sh blocks
are run as written by tests/test_doc_shell.py (and tests/integration/test_doc_shell.py on a real
broker), or listed there with why they cannot be (Docker, a cluster, root, a long bench); this
module checks each line of every block, listed ones included, as far as it can without running
it:

- ``panagg ...`` (also ``.venv/bin/panagg``, ``docker compose exec SVC panagg``) parses with the
  CLI's own parser, and a ``run`` line without ``--config`` loads its ``--set`` settings and flags
  as the service would (unknown keys, bad values and refused combinations fail here);
- ``python -m MODULE`` and ``python FILE.py`` name a module or a file of the repository;
- ``make TARGET`` names a Makefile target; a ``deploy/...``, ``tests/...`` or ``examples/...``
  path exists.

Placeholders the page explains (``PORT``, ``FILE``, ``BROKER``, ``$k``) are filled in first.
"""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from aggregator.service.cli import UsageError, _load, build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FILL = [
    (re.compile(r"\$\(\(\s*9463\s*\+\s*k\s*\)\)"), "9464"),
    (re.compile(r"\$k\b"), "1"),
    (re.compile(r"127\.0\.0\.1:PORT"), "127.0.0.1:9092"),
    (re.compile(r"\$\(openssl rand -\w+ \d+\)"), "00ff"),
]
RUN_FLAGS = (
    ("bootstrap", "source.bootstrap"),
    ("topic", "source.topic"),
    ("epsilon", "state.epsilon"),
    ("state_dir", "checkpoint.dir"),
    ("release_dir", "release.dir"),
    ("metrics_port", "metrics.port"),
)


SH_FENCES = ("```sh", "```bash", "```shell")


def sh_blocks(page: Path):
    """(first line number, text) of each ```sh block of ``page`` (also one indented in a list
    item: its indent is removed); tests/test_doc_shell.py runs these."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() not in SH_FENCES:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        start = i + 1
        i = start
        while i < len(lines) and not lines[i].strip().startswith("```"):
            i += 1
        yield start + 1, "\n".join(ln[indent:] for ln in lines[start:i]) + "\n"
        i += 1


def _commands(page: Path):
    """(line number, command words) of each command of each ```sh block of ``page``."""
    for start, block in sh_blocks(page):
        yield from _block_commands(start, block)


def _block_commands(start: int, block: str):
    joined, first = "", 0
    for no, line in enumerate(block.splitlines(), start):
        if not joined:
            first = no
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        text, joined = joined + line, ""
        for old, new in FILL:
            text = old.sub(new, text)
        try:
            words = shlex.split(text, comments=True)
        except ValueError:
            continue
        # one command per piece of a pipe, a list or a loop body
        piece: list[str] = []
        redirect = False  # a redirection's file is not a word of the command
        for w in [*words, ";"]:
            if redirect or w in (">", ">>", "<", "2>", "2>>"):
                redirect = not redirect
                continue
            if w in (";", "&&", "||", "|", "&", "do", "done", "then"):
                if piece:
                    yield first, piece
                piece = []
            else:
                piece.append(w)


CASES = [
    pytest.param(page, no, words, id=f"{page.relative_to(ROOT)}:{no}:{words[0]}")
    for page in PAGES
    for no, words in _commands(page)
]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def _panagg_args(words: list[str]) -> list[str] | None:
    """The CLI's arguments when ``words`` run panagg (directly, from a venv, in a container)."""
    if words[:2] == ["docker", "compose"] and "exec" in words:
        words = words[words.index("exec") + 2 :]  # exec SERVICE panagg ...
    if words and (words[0] == "panagg" or words[0].endswith("bin/panagg")):
        return words[1:]
    return None


@pytest.mark.parametrize("page, line, words", CASES)
def test_a_shell_command_of_the_docs_names_what_exists(page, line, words):
    where = f"{page.relative_to(ROOT)}:{line}: {' '.join(words)}"
    args = _panagg_args(words)
    if args is not None:
        try:
            parsed = build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"the CLI refuses {where}")
        if parsed.command == "run" and not getattr(parsed, "config", None):
            extra = [
                f"{key}={getattr(parsed, flag)}"
                for flag, key in RUN_FLAGS
                if getattr(parsed, flag, None) is not None
            ]
            try:
                _load(parsed, extra)
            except UsageError as exc:
                pytest.fail(f"{where}: {exc}")
        return
    head = words[0]
    if head.endswith("python") or head.startswith("python3"):
        if len(words) > 2 and words[1] == "-m":
            module = words[2]
            path = ROOT / Path(*module.split("."))
            assert (
                path.with_suffix(".py").exists()
                or (path / "__main__.py").exists()
                or importlib.util.find_spec(module) is not None
            ), f"{where}: no module {module}"
        elif len(words) > 1 and words[1].endswith(".py"):
            assert (ROOT / words[1]).exists(), f"{where}: no file {words[1]}"
    elif head == "make" and len(words) > 1:
        assert words[1] in _make_targets(), f"{where}: no Makefile target {words[1]}"
    for w in words:
        if re.match(r"^(deploy|tests|examples|bench)/[\w./-]+$", w) and "var/" not in w:
            assert (ROOT / w).exists(), f"{where}: no {w} in the repository"


def test_the_shell_blocks_were_found():
    """The reader above sees the README's own commands (it cannot silently read nothing)."""
    readme = [words for page, _, words in (c.values for c in CASES) if page.name == "README.md"]
    assert any(w[:2] == ["make", "demo"] for w in readme)
    assert sum(_panagg_args(w) is not None for w in readme) >= 10
