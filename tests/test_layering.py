"""The estimator core is layered: no module of ``aggregator`` imports, at any depth (a lazy import
inside a function counts), a module that imports it back.

Why: estimate, intervals, largedomain, selection and wupagh used to import each other in a circle
through function-level imports, so no one of them could be read, tested or replaced alone. The
layers now (each imports only those above it in this list):

    noise, occupancy, properties, hashing      no sibling
    density                                    user-level distinct users: noise, hashing
    counters, histograms, convolution          the core's base: value counts, noise pmf,
                                               histograms, convolution with one kernel
    threshold, em, projection, cap, memo       the core: inverse filter, EM, projections, cap
    deconvolution, crossfit                    the EM's stopping rules
    estimator                                  an estimator as an object; the count-only ones
    counter_model                              simulation, likelihood, information of counters
    wupagh, selection                          estimators built on the core
    estimators                                 every estimator by name (the registry), defaults
    bucket_likelihood, largedomain             hashed mode
    anonymize                                  the release's histogram, direct or hashed
    intervals                                  error bars
    release, ...                               the release document
    api                                        the public Python API (issue 54): it drives the
                                               service (aggregator.service) and nothing of the
                                               package, the service included, imports it

``estimate`` is no layer: it lists the core's names for code outside the package, and no module
of the package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aggregator

PKG = Path(aggregator.__file__).parent

#: the estimator core (what estimate.py was): it imports nothing else of the package
CORE = {
    "counters",
    "histograms",
    "convolution",
    "threshold",
    "em",
    "projection",
    "cap",
    "memo",
    "deconvolution",
    "crossfit",
    "estimator",
}


def _imports(path: Path) -> set[str]:
    """The sibling modules of ``aggregator`` that a module imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import a, b
                out.update(a.name for a in node.names)
            elif node.level == 0 and (node.module or "").startswith("aggregator."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("aggregator."):
                    out.add(a.name.split(".")[1])
    return out


def graph() -> dict[str, set[str]]:
    mods = {p.stem: p for p in PKG.glob("*.py") if p.stem != "__init__"}
    return {m: _imports(p) & set(mods) - {m} for m, p in mods.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_modules_import_each_other_without_a_cycle():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_estimator_core_imports_nothing_above_it():
    g = graph()
    assert CORE <= set(g)
    above = {m: sorted(g[m] - CORE) for m in CORE if g[m] - CORE}
    assert not above, f"core modules importing modules above the core: {above}"


def test_no_module_of_the_package_imports_the_old_core_module():
    g = graph()
    assert not [m for m in g if "estimate" in g[m]]


def test_the_cycle_finder_sees_a_lazy_import_cycle():
    """Negative control: the graph of the package with the EM reaching back to selection (as
    the old estimate.py did inside phi_estimate) is reported as a cycle."""
    g = graph()
    g["em"] = g["em"] | {"selection"}
    found = cycle(g)
    assert found is not None and found[0] == found[-1] and "em" in found
    assert _imports(PKG / "selection.py") >= {"em", "counter_model"}


def test_the_public_api_is_the_top_layer():
    """aggregator/api.py sits on the service (aggregator.service imports the core): no module
    of the package or of the service imports it back, at any depth."""
    users = [
        str(p.relative_to(PKG))
        for p in sorted(PKG.rglob("*.py"))
        if p.stem != "api" and "api" in _imports(p) | _service_imports(p)
    ]
    assert not users, f"modules importing aggregator.api: {users}"


def _service_imports(path: Path) -> set[str]:
    """``api`` if a module of aggregator.service imports it (``from ..api import``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level >= 2
            and (node.module or "").split(".")[0] == "api"
        ):
            return {"api"}
        if (
            isinstance(node, ast.ImportFrom)
            and node.level >= 2
            and not node.module
            and any(a.name == "api" for a in node.names)
        ):
            return {"api"}
    return set()


#: (importing test module, imported test module) pairs kept, each for its reason; every other
#: shared helper lives in tests/helpers/ (issue 52)
TEST_IMPORTS_KEPT = {
    (
        "tests/test_doc_shell.py",
        "tests.test_doc_commands",
    ): "the shell-block test runs the blocks the doc-command test's page list finds",
    (
        "tests/test_doc_shell.py",
        "tests.test_bench_smoke",
    ): "a bench block is listed by the smoke lane that runs it (one table)",
    (
        "tests/integration/test_doc_shell.py",
        "tests.test_doc_shell",
    ): "the broker lane of the same table of blocks",
    (
        "tests/test_prometheus_alerts.py",
        "tests.test_deploy",
    ): "the alert rules are checked against the deploy test's real exposition fixture",
    (
        "tests/integration/test_group_kafka.py",
        "tests.test_group_rollups",
    ): "the broker test replays the unit test's closed rollup windows",
}


def _imported_test_module(path: Path, node) -> str | None:
    """The test module (``tests.<...>.test_*``) ``node`` imports from, relative imports
    resolved against ``path`` (a file under tests/, relative to the repository), or None."""
    if not isinstance(node, ast.ImportFrom):
        return None
    if node.level:
        package = list(path.parent.parts)
        base = package[: len(package) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_"):
        return module
    return None


def test_the_import_check_sees_relative_imports_of_test_modules():
    """``from .test_group_kafka import Members`` in tests/integration is an import of another
    test module too (four files did it unseen until issue 52's last look)."""
    tree = ast.parse("from .test_group_kafka import Members\nfrom ..helpers import kafka\n")
    path = Path("tests/integration/test_group_views.py")
    got = [_imported_test_module(path, n) for n in tree.body]
    assert got == ["tests.integration.test_group_kafka", None]


def test_tests_share_helpers_through_tests_helpers_not_each_other():
    """A helper one test module takes from another ties the two (and made 40 such imports);
    shared helpers live in tests/helpers/, and the few pairs above say why they stay."""
    root = Path(__file__).parent.parent
    found = set()
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            module = _imported_test_module(path.relative_to(root), node)
            if module:
                found.add((path.relative_to(root).as_posix(), module))
    assert found - set(TEST_IMPORTS_KEPT) == set(), "import these from tests/helpers/ instead"
    assert set(TEST_IMPORTS_KEPT) <= found, "a kept pair is gone: drop it from the list"
