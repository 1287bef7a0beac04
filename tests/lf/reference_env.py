"""LLaMA-Factory 0.9.5 as the reference, in an environment of its own (its pins conflict with ours): a venv
under .lf-reference/ with tests/lf/requirements.txt and `llamafactory==0.9.5` (no deps), and its source
distribution unpacked beside it (its examples/ and data/: the YAMLs and demo data the tests run through
both). Made on first use (about two minutes) and reused; where it cannot be installed (no package
registry), the tests that need it are skipped, saying why (in CI, which must be able to make it: they
fail)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import unavailable

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / ".lf-reference"
VERSION = "0.9.5"
SCRIPT = Path(__file__).with_name("lf_reference.py")
REQUIREMENTS = Path(__file__).with_name("requirements.txt")


@dataclass(frozen=True)
class Reference:
    python: Path
    src: Path  # the unpacked sdist: examples/, data/

    @property
    def package(self) -> Path:
        """LF's own source (the sdist's src/llamafactory, the code its venv installed): what a test reads."""
        return self.src / "src" / "llamafactory"

    def _ask(
        self, command: str, request: object, extra: list[str], work: Path, cwd: Path, timeout: int
    ) -> Any:
        """tests/lf/lf_reference.py `command` on `request` (written as JSON in `work`), run by LF's Python
        in `cwd`; its JSON answer."""
        asked, answer = work / f"lf_{command}.json", work / f"lf_{command}_answer.json"
        asked.write_text(json.dumps(request))
        proc = subprocess.run(
            [str(self.python), str(SCRIPT), command, str(asked), *extra, str(answer)],
            capture_output=True, text=True, timeout=timeout, cwd=cwd,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(answer.read_text())

    def resolve(self, cases: dict[str, dict], keys: list[str], steps: int, work: Path) -> dict[str, dict]:
        """Each case's mapping through LF's own parser (tests/lf/lf_reference.py)."""
        return self._ask("parse", {"keys": keys, "steps": steps, "cases": cases}, [], work, work, 600)

    def preprocess(self, args: dict, tokenizer: Path, work: Path) -> dict:
        """LF's own encoding of the data set its arguments name (tests/lf/lf_reference.py preprocess)."""
        request = {"template": "chatml", **args}
        return self._ask("preprocess", request, [str(tokenizer)], work, self.src, 900)

    def lora_targets(self, cases: dict[str, dict], work: Path) -> dict[str, list[str]]:
        """The modules LF's LoRA adapts in vision-language models, per case ({"model": folder, "args":
        LF's arguments}; tests/lf/lf_reference.py lora_targets)."""
        return self._ask("lora_targets", cases, [], work, work, 600)


def _run(args: list[str], what: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        unavailable(f"LLaMA-Factory's reference environment could not be made ({what}): {proc.stderr[-500:]}")


def reference() -> Reference:
    """Made once under a file lock: the suite's worker processes (pytest-xdist) may all ask at once, and one
    that read LF's files while another was still writing them would see half an environment."""
    venv, src = ROOT / "venv", ROOT / f"llamafactory-{VERSION}"
    python, done = venv / "bin" / "python", ROOT / "ready"
    # the version and the pins it was made with: an environment made before a pin changed is brought up to it
    stamp = f"{VERSION} {hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]}"
    ROOT.mkdir(exist_ok=True)
    with (ROOT / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file() or done.read_text() != stamp:
            _make(venv, python, src)
            done.write_text(stamp)
    return Reference(python, src)


def _make(venv: Path, python: Path, src: Path) -> None:
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(venv)], "venv")
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run([*pip, "-r", str(REQUIREMENTS)], "its pinned dependencies")
    _run([*pip, "--no-deps", f"llamafactory=={VERSION}"], "llamafactory")
    if not src.is_dir():
        sdist = ROOT / "sdist"
        _run(
            [str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
             str(sdist), f"llamafactory=={VERSION}"],
            "its source distribution (examples and demo data)",
        )  # fmt: skip
        with tarfile.open(next(sdist.glob("llamafactory-*.tar.gz"))) as tar:
            tar.extractall(ROOT, filter="data")
