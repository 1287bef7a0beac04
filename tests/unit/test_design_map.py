"""docs/DESIGN.md is the map a newcomer uses: it names every package of the tree, every file path it
mentions exists, and every `shardforge COMMAND` it mentions is a command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()


def _package_map() -> str:
    start = DESIGN.index("## Package map")
    return DESIGN[start : DESIGN.index("\n## ", start + 1)]


def test_every_package_is_on_the_map():
    mapped = set(re.findall(r"^\s*((?:[a-z0-9_]+/)+)\s", _package_map(), flags=re.MULTILINE))
    packages = {
        str(folder.relative_to(ROOT)) + "/"
        for folder in (ROOT / "shardforge").rglob("*")
        if folder.is_dir() and any(folder.glob("*.py"))
    }
    named = {p if p.startswith("shardforge/") else "shardforge/" + p for p in mapped}
    assert packages - named == set(), "packages DESIGN.md's map does not name"


def test_every_path_it_mentions_exists():
    paths = set(re.findall(r"(?<![\w./-])((?:[a-z_]+/)+[a-z_0-9]+\.(?:py|md|yaml|toml|json))", DESIGN))
    missing = {p for p in paths if not (ROOT / "shardforge" / p).exists() and not (ROOT / p).exists()}
    assert missing == set()


def test_every_command_it_mentions_exists():
    from shardforge.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)
    mentioned = set(re.findall(r"`shardforge ([a-z][a-z-]*)", DESIGN))
    assert mentioned - commands == set()


def test_the_map_check_reads_nested_packages():
    text = "  config/   schema.py\n  models/qwen2_vl/   x\n"
    mapped = set(re.findall(r"^\s*((?:[a-z0-9_]+/)+)\s", text, re.M))
    assert mapped == {"config/", "models/qwen2_vl/"}


def _named_per_package() -> dict[str, set[str]]:
    """Each package line of the map (and its continuation lines) -> the file names it gives."""
    named: dict[str, set[str]] = {}
    current = None
    for line in _package_map().splitlines():
        head = re.match(r"^(\s*)((?:[a-z0-9_]+/)+)\s", line)
        if head:
            path = head.group(2)
            current = path if path.startswith("shardforge/") or not head.group(1) else "shardforge/" + path
            named.setdefault(current, set())
        if current is not None:
            named[current] |= set(re.findall(r"\b([a-z0-9_]+\.(?:py|cpp|h))\b", line))
    return named


def test_every_file_is_on_the_map():
    """File by file, not only folder by folder: each module of the library is named on its package's line."""
    named = _named_per_package()
    missing = {}
    for folder in (ROOT / "shardforge").rglob("*"):
        if not folder.is_dir() or not any(folder.glob("*.py")):
            continue
        package = str(folder.relative_to(ROOT)) + "/"
        files = {f.name for f in folder.iterdir() if f.suffix in (".py", ".cpp", ".h")} - {"__init__.py"}
        if left := files - named.get(package, set()):
            missing[package] = sorted(left)
    assert not missing, f"files DESIGN.md's package map does not name: {missing}"
