"""Every figure in README.md, benchmarks/README.md and docs/ names the command and the results file it came
from (issue 64): the results files the text names exist and parse, the benchmark scripts it names exist,
and every table of measured figures in benchmarks/README.md lies in a section that names an existing results
file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
BENCH_README = BENCHMARKS / "README.md"
DOCS = [REPO / "README.md", BENCH_README, *sorted((REPO / "docs").rglob("*.md"))]

# A results file as the text names it: `results_x.json`, `benchmarks/results_x.jsonl`,
# `results_vlm_{full,lora}.json`.
RESULTS = re.compile(r"(?<![\w.-])(?:benchmarks/)?(results_[\w{},.-]*?\.jsonl?)(?![\w.])")
# A benchmark script: `benchmarks/x.py`, `python benchmarks/x.py`, `bash benchmarks/x.sh`.
SCRIPT = re.compile(r"(?<![\w.-])benchmarks/([\w-]+\.(?:py|sh))\b")
# benchmarks/README.md's sections are headed by the script they describe: `## single_process.py`, ...
HEADED_SCRIPT = re.compile(r"^#{2,3} (?:[\w ]*: )?`?([\w-]+\.(?:py|sh))\b")
HEADING = re.compile(r"^#{2,3} ")

# A measured figure in a table cell: a number with a unit of time, rate, memory, compute or a ratio / share, a
# decimal (170.9, 0.33: a measurement, not a count or a setting), or, past the first column (which labels the
# row), a cell of bare numbers under a header that holds the unit: `2652`, `636 / 26`, `1549 (noisy)`.
UNITS = r"(?:tok/s|tokens/s|images/s|pairs/s|req/s|[GT]FLOP/s|GFLOP|TFLOP|ms|us|µs|s|MiB|GiB|MB|GB|B/token)"
WITH_UNIT = re.compile(rf"\d(?:\.\d+)?(?:\s?{UNITS}(?![\w/])|x(?!\w)|%)")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")
NUMBER = r"\**~?\d[\d,]*(?:\.\d+)?\**"
BARE_NUMBERS = re.compile(rf"{NUMBER}(?:\s*/\s*{NUMBER})*(?:\s*\(.*\))?")


def _expand(name: str) -> list[str]:
    """`results_vlm_{full,lora}.json` -> both names (shell brace expansion, one level)."""
    match = re.search(r"\{([^{}]*)\}", name)
    if not match:
        return [name]
    return [name[: match.start()] + part + name[match.end() :] for part in match.group(1).split(",")]


def _results_named(text: str) -> set[str]:
    return {name for raw in RESULTS.findall(text) for name in _expand(raw)}


def _tables(lines: list[str]) -> list[tuple[int, list[list[str]]]]:
    """(index of the first line, rows of cells) of each markdown table, indented ones included."""
    tables, start, rows = [], None, []
    for i, line in enumerate([*lines, ""]):
        stripped = line.strip()
        if stripped.startswith("|") and stripped.endswith("|"):
            start = i if start is None else start
            rows.append([cell.strip() for cell in stripped[1:-1].split("|")])
        elif start is not None:
            tables.append((start, rows))
            start, rows = None, []
    return tables


def _is_measured(rows: list[list[str]]) -> bool:
    body = [row for row in rows[2:] if not all(set(cell) <= set("-: ") for cell in row)]
    if any(WITH_UNIT.search(cell) or DECIMAL.search(cell) for row in body for cell in row):
        return True
    return any(BARE_NUMBERS.fullmatch(cell) for row in body for cell in row[1:])


def _section(lines: list[str], index: int) -> str:
    """The text of the section around line `index`: from the nearest heading (`## ` or `### `) above it to
    the next heading below it."""
    top = next((i for i in range(index, -1, -1) if HEADING.match(lines[i])), 0)
    bottom = next((i for i in range(index, len(lines)) if HEADING.match(lines[i])), len(lines))
    return "\n".join(lines[top:bottom])


def _unbacked_tables(text: str) -> list[str]:
    lines = text.splitlines()
    unbacked = []
    for start, rows in _tables(lines):
        if len(rows) < 3 or not _is_measured(rows):
            continue
        named = _results_named(_section(lines, start))
        if not any((BENCHMARKS / name).is_file() for name in named):
            unbacked.append(f"line {start + 1}: {lines[start].strip()[:80]}")
    return unbacked


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_results_file_named_exists_and_parses(doc):
    for name in sorted(_results_named(doc.read_text())):
        path = BENCHMARKS / name
        assert path.is_file(), f"{doc.relative_to(REPO)} names benchmarks/{name}, which does not exist"
        text = path.read_text()
        if name.endswith(".jsonl"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            assert rows, f"{name} holds no rows"
        else:
            json.loads(text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_benchmark_script_named_exists(doc):
    text = doc.read_text()
    names = set(SCRIPT.findall(text))
    if doc == BENCH_README:
        names |= {m.group(1) for line in text.splitlines() if (m := HEADED_SCRIPT.match(line))}
    missing = sorted(name for name in names if not (BENCHMARKS / name).is_file())
    assert not missing, f"{doc.relative_to(REPO)} names scripts that benchmarks/ does not hold: {missing}"


def test_every_table_of_measured_figures_names_its_results_file():
    unbacked = _unbacked_tables(BENCH_README.read_text())
    assert not unbacked, (
        "benchmarks/README.md: tables of measured figures in a section that names no existing results file "
        f"(benchmarks/results_*.json, written by the section's command): {unbacked}"
    )


def test_the_table_check_tells_measured_from_unmeasured_tables():
    """The check itself: a table of figures without a results file fails, the same table beside an existing
    results file passes, and a table of settings or words is not a table of figures."""
    existing = sorted(BENCHMARKS.glob("results_*.json"))[0].name
    figures = "| variant | tokens/s |\n|---|---|\n| engine | 2652 |\n| plain | 2309 |\n"
    with_unit = "| case | first batch |\n|---|---|\n| warm | 0.28 s |\n"
    kernels = "| shape | fp32 | int8 fp32 / bf16 |\n|---|---|---|\n| q/k/v | 40 | 636 / 26 |\n"
    kernels += "| head | 1549 (noisy) | 2 |\n"
    settings = (
        "| part | on cpu |\n|---|---|\n| training | `tiny-llama`, rows of 64, 8 steps |\n| 1 | layouts |\n"
    )
    assert _unbacked_tables(f"## x.py\n\nrun it\n\n{figures}")
    assert _unbacked_tables(f"## x.py\n\n{with_unit}\n## y.py\n\nsee {existing}\n")
    assert _unbacked_tables(f"## x.py\n\n{kernels}")
    assert _unbacked_tables(f"## x.py\n\nsee {existing}\n\n### the kernels\n\n{kernels}")
    assert not _unbacked_tables(f"## x.py\n\nraw JSON: `{existing}`\n\n{figures}\n{with_unit}")
    assert not _unbacked_tables(f"## x.py\n\n{settings}")
    assert _unbacked_tables(f"## x.py\n\nraw JSON: `results_no_such_file.json`\n\n{figures}")
