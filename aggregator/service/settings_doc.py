"""The reference tables of docs/configuration.md and deploy/panagg.example.toml, written from the
settings' one declaration (:mod:`aggregator.service.settings`).

    python -m aggregator.service.settings_doc --write    # after changing a setting
    python -m aggregator.service.settings_doc --check    # what the test does: exit 1 on drift

In docs/configuration.md only the text between the marker comments
``<!-- settings:NAME begin ... -->`` and ``<!-- settings:NAME end -->`` is generated (the prose
around them is written by hand); deploy/panagg.example.toml is generated whole.
tests/test_settings_doc.py fails when either differs from what this module writes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from .identity import IDENTITY_KEYS, IDENTITY_WHY
from .settings import SECTIONS, SETTINGS, Setting

__all__ = ["docs_tables", "example_toml", "render", "check", "main"]

ROOT = Path(__file__).resolve().parents[2]
DOCS = Path("docs/configuration.md")
EXAMPLE = Path("deploy/panagg.example.toml")
COMMAND = "python -m aggregator.service.settings_doc --write"
_MARKER = re.compile(r"(<!-- settings:(\w+) begin[^>]*-->\n)(.*?)(<!-- settings:\2 end -->)", re.S)

# -- docs/configuration.md -------------------------------------------------------------------


def _code(text: str) -> str:
    return f"`{text}`"


def shown_default(one: Setting) -> str:
    """The default as the reference shows it: ``empty`` for an empty string, a list as TOML."""
    if one.shown_default is not None:
        return one.shown_default
    value = one.default
    if isinstance(value, str):
        return _code(value) if value else "empty"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return _code(json.dumps(list(value)))
    return repr(value)


def allowed(one: Setting) -> str:
    """The values a setting takes, where it says (choices, bounds)."""
    if one.choices:
        return ", ".join(_code(c) for c in one.choices)
    return ", ".join(str(b) for b in one.bounds)


def _keys_table() -> list[str]:
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for one in SETTINGS.values():
        meaning = ("TEST ONLY: " if one.test_only else "") + one.doc
        rows.append(f"| {_code(one.name)} | {shown_default(one)} | {allowed(one)} | {meaning} |")
    rows.append(
        "| `aggregations.NAME.SECTION.KEY` | none | | one aggregation of the stream and "
        "its overrides of `[item]`, `[state]`, `[window]`, `[release]`, "
        '`ledger.budget_per_window` (section "Several aggregations of one stream") |'
    )
    return rows


def _identity_table() -> list[str]:
    rows = ["| setting | state directory | why |", "|---|---|---|"]
    for key, fed in IDENTITY_KEYS.items():
        names = ", ".join(_code(one.name) for one in fed)
        rows.append(f"| {names} | identity (`{key}`) | {IDENTITY_WHY[key]} |")
    for one in SETTINGS.values():
        if one.note:
            how, _, why = one.note.partition(": ")
            rows.append(f"| {_code(one.name)} | {how} | {why} |")
    rows.append(
        "| every other key | safe, logged | how records are fetched, how a release is "
        "computed and where else it goes, access and reporting (`shuffle.*`: the "
        "analyzer records its own identity) |"
    )
    return rows


def docs_tables() -> dict[str, list[str]]:
    """The generated tables of docs/configuration.md by marker name."""
    return {"identity": _identity_table(), "keys": _keys_table()}


def render_docs(text: str) -> str:
    """``text`` (docs/configuration.md) with every marked table written anew."""
    tables = docs_tables()
    missing = set(tables) - {m.group(2) for m in _MARKER.finditer(text)}
    if missing:
        raise ValueError(
            f"{DOCS} lacks the markers of {sorted(missing)}: put "
            f"<!-- settings:NAME begin --> / <!-- settings:NAME end --> around them"
        )

    def one(m: re.Match) -> str:
        return m.group(1) + "\n".join(tables[m.group(2)]) + "\n" + m.group(4)

    return _MARKER.sub(one, text)


# -- deploy/panagg.example.toml --------------------------------------------------------------


_HEADER = """\
# Example /etc/panagg/panagg.toml for deploy/systemd/panagg.service: every key of
# aggregator/service/settings.py, with its default or a production value. Reference:
# docs/configuration.md. Any key can also be set by PANAGG_<SECTION>_<KEY> (e.g. in
# /etc/panagg/env) or `--set`. Generated from settings.py (python -m
# aggregator.service.settings_doc --write); tests/test_deploy.py loads it with the real loader.
"""
_AGGREGATIONS = """\
# Several aggregations of one stream, one consumer (docs/configuration.md); each overrides
# [item], [state], [window], [release] and ledger.budget_per_window, e.g.:
# [aggregations.account]
# item.field = "user.id"
# [aggregations.ip]
# item.field = "ip"
# state.epsilon = 0.5
"""
_COMMENT_AT = 33  # the column the comments start at


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, tuple, list)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    return repr(value)


def _commented(code: str, comment: str) -> list[str]:
    """``code`` with ``comment`` beside it, wrapped at 100 columns under its first line."""
    if not comment:
        return [code]
    at = max(_COMMENT_AT, len(code) + 1)
    lines = textwrap.wrap(
        comment, width=100 - at - 2, break_long_words=False, break_on_hyphens=False
    ) or [""]
    return [code.ljust(at) + "# " + lines[0]] + [" " * at + "# " + ln for ln in lines[1:]]


def _section_brief(cls) -> str:
    doc = " ".join((cls.__doc__ or "").split())
    return doc.partition("]: ")[2] if "]: " in doc else ""


def example_toml() -> str:
    """deploy/panagg.example.toml: every setting but the test hooks, with its brief."""
    out = [_HEADER]
    for name, cls in SECTIONS.items():
        shown = [one for one in SETTINGS.values() if one.section == name and not one.test_only]
        if not shown:
            continue
        out.extend(_commented(f"[{name}]", _section_brief(cls)))
        for one in shown:
            out.extend(_commented(f"{one.key} = {_toml_value(one.example_value)}", one.brief))
        out.append("")
        if name == "ledger":
            out.append(_AGGREGATIONS)
    hooks = [one for one in SETTINGS.values() if one.test_only]
    if hooks:
        said = "; ".join(f"{one.name} {one.brief}" for one in hooks)
        out.extend(
            textwrap.wrap(
                f"The test hooks are deliberately absent: {said}, and each "
                "is refused outside tests.",
                width=98,
                initial_indent="# ",
                subsequent_indent="# ",
            )
        )
    return "\n".join(out).rstrip("\n") + "\n"


# -- both ------------------------------------------------------------------------------------


def render(root: Path = ROOT) -> dict[Path, str]:
    """Each generated file's path under ``root`` and the text it should have."""
    return {root / DOCS: render_docs((root / DOCS).read_text()), root / EXAMPLE: example_toml()}


def check(root: Path = ROOT) -> list[str]:
    """The generated files under ``root`` that differ from the declaration (empty: none)."""
    return [
        str(path.relative_to(root))
        for path, text in render(root).items()
        if path.read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aggregator.service.settings_doc", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--write", action="store_true", help="write the files (default: check)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository's root")
    args = parser.parse_args(argv)
    if args.write:
        for path, text in render(args.root).items():
            if path.read_text() != text:
                path.write_text(text)
                print(f"wrote {path.relative_to(args.root)}")
        return 0
    stale = check(args.root)
    for name in stale:
        print(f"{name} differs from aggregator/service/settings.py; run {COMMAND}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
