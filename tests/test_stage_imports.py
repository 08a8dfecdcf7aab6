"""The service's modes share stages and do not reach into each other (issue 47).

Modes: the one process (``process``), several aggregations (``multi``), the consumer group
(``group/``) and the shuffle analyzer (``analyzer``). What they share lives in
``aggregator/service/stages/`` and in the service's shared modules. Checked from the source (an
import inside a function counts):

- a stage imports no mode;
- the group and the analyzer import neither another mode nor each other;
- ``multi`` builds on the one process's public :class:`Aggregator` only (no private name).
"""

from __future__ import annotations

import ast
from pathlib import Path

import aggregator.service

SERVICE = Path(aggregator.service.__file__).parent
MODES = {"process", "multi", "group", "analyzer"}


def _imports(path: Path, source: str | None = None) -> list[tuple[str, list[str]]]:
    """(service module imported, names) for each import of ``path`` (or of ``source`` as if it
    were that file) that resolves inside ``aggregator.service`` (relative or absolute)."""
    rel = path.relative_to(SERVICE).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif (node.module or "").startswith("aggregator.service."):
                target = node.module.split(".")[2:]
            else:
                continue
            names = [a.name for a in node.names]
            if not target:  # from . import x
                out.extend((n, []) for n in names)
            else:
                out.append((".".join(target), names))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("aggregator.service."):
                    out.append((".".join(a.name.split(".")[2:]), []))
    return out


def _mode(module: str) -> str | None:
    head = module.split(".")[0]
    return head if head in MODES else None


def test_stages_import_no_mode():
    found = [
        (p.name, m) for p in (SERVICE / "stages").glob("*.py") for m, _ in _imports(p) if _mode(m)
    ]
    assert found == []


def test_the_group_and_the_analyzer_import_no_other_mode():
    files = [*(SERVICE / "group").glob("*.py"), SERVICE / "analyzer.py"]
    found = []
    for p in files:
        own = "group" if p.parent.name == "group" else "analyzer"
        found += [(p.name, m) for m, _ in _imports(p) if _mode(m) not in (None, own)]
    assert found == []


def test_multi_uses_only_public_names_of_the_one_process():
    found = [
        (m, n)
        for m, names in _imports(SERVICE / "multi.py")
        if _mode(m) == "process"
        for n in names
        if n.startswith("_")
    ]
    assert found == []
    assert any(_mode(m) == "process" for m, _ in _imports(SERVICE / "multi.py"))


def test_the_checker_sees_a_relative_import_of_a_mode():
    found = _imports(SERVICE / "group" / "x.py", "def f():\n    from ..process import _x\n")
    assert found == [("process", ["_x"])]
