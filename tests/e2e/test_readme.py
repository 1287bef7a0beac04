"""The README is a test: every command in README.md and in the header of each examples/*.yaml is run here
as written, from a fresh working folder (examples/ linked in, its own runs/ and caches), with the bundled
demo model and data standing in for the user's paths (STAND_INS) and every training job shortened by
overrides appended after the command's own arguments (SHORT: two steps, no evaluation), and what the README
says it produces is checked. The commands are read from the files themselves, so an edited command is the
command that runs, and a command added without a run here fails `test_every_documented_command_is_run`.

What cannot run here is checked as far as it can be: the install step and the whole suite are what CI runs
(`.ci/run` holds them verbatim), the quick tier is collected, Docker (not on this machine) is checked against
docker/Dockerfile, and the CLI table's synopses (CONFIG, [--flag ...]) against each command's --help."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "examples").glob("*.yaml"))]
PROGRAMS = (
    "shardforge",
    "python3 ",
    "python ",
    ".venv/",
    "pip ",
    "docker ",
    "apt-get ",
    "curl ",
    "torchrun ",
)
SHORT = ["train.steps=2", "train.eval_every=null"]

# How each documented command is run (the kind names a runner below); the keys are the commands as written.
HOW = {
    "python3 -m venv .venv && .venv/bin/pip install -q --no-compile -c constraints.txt -e . && .venv/bin/shardforge train examples/demo.yaml": "demo",  # noqa: E501
    'python3 -m venv --clear .venv && .venv/bin/pip install -q -c constraints.txt -e ".[dev]" && .venv/bin/python -m pytest -q': "suite",  # noqa: E501
    '.venv/bin/python -m pytest -q -m "not slow"': "quick",
    "shardforge train examples/demo.yaml": "demo",
    "shardforge train my_sft.yaml": "sft",
    "shardforge train my_sft.yaml train.lr=2e-5 data.max_length=1024": "sft",
    "shardforge export runs/my-sft --to merged/ --merge": "lora-export",
    "shardforge chat runs/my-sft": "chat",
    "shardforge generate runs/my-sft --prompts prompts.jsonl --out results.jsonl --temperature 0": "generate",
    "shardforge serve runs/my-sft --port 8000": "serve",
    "shardforge serve /models/base --adapter runs/my-lora/final --tp 2 --api-key KEY --host 0.0.0.0": "serve",
    "shardforge train examples/moe_qwen3.yaml": "example",
    "shardforge train examples/moe_qwen3.yaml --nproc 4 parallel.ep=2 parallel.tp=2": "example",
    "shardforge train examples/long_context_cp.yaml --nproc 2": "example",
    "shardforge train examples/demo_lora.yaml": "example",
    "shardforge train examples/demo_qlora.yaml": "example",
    "shardforge train examples/dpo_lora.yaml": "example",
    "shardforge train examples/kto.yaml": "example",
    "shardforge train examples/rm.yaml": "example",
    "shardforge train examples/ppo.yaml": "example",
    "shardforge train examples/grpo_math.yaml": "example",
    "shardforge train examples/vlm_sft.yaml": "example",
    "shardforge export runs/demo_lora --to runs/demo_lora_merged --merge": "example-export",
    "shardforge eval runs/my-sft --data data/my_eval.jsonl --max-new-tokens 32 --out runs/my-sft/predict": "eval",  # noqa: E501
    "shardforge eval runs/my-sft --tasks shardforge_tiny_mc --out runs/my-sft/lm-eval": "eval",
    "shardforge eval MODEL --data NAME[,NAME] [--dataset-info FILE] [--adapter DIR] [--max-new-tokens N] [--out DIR]": "synopsis",  # noqa: E501
    "shardforge expand MODEL --blocks N --to DIR": "synopsis",
    "shardforge expand": "synopsis",
    "shardforge loftq": "synopsis",
    "shardforge loftq MODEL --to DIR [--rank 16] [--alpha A] [--targets q_proj,v_proj] [--iter 4]": "synopsis",  # noqa: E501
    "shardforge convert": "synopsis",
    'pip install -c constraints.txt -e ".[eval]"': "extra",
    "shardforge plan CONFIG": "synopsis",
    "shardforge train CONFIG [key=value ...]": "synopsis",
    "shardforge train CONFIG --nproc N [key=value ...]": "synopsis",
    "shardforge train CONFIG --nproc N --max-restarts R": "synopsis",
    "shardforge launch CONFIG [key=value ...] --slurm [--submit]": "synopsis",
    "shardforge train --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID": "synopsis",
    "shardforge export RUN_OR_CHECKPOINT --to DIR [--merge] [--base DIR]": "synopsis",
    "shardforge data prepare CONFIG [key=value ...]": "synopsis",
    "shardforge plan CONFIG [key=value ...] [--hardware P --nodes N --devices-per-node D] [--json]": "synopsis",  # noqa: E501
    "shardforge convert lf.yaml [--to ours.yaml] [--allow-unsupported]": "synopsis",
    "shardforge webui [--port 7860] [--root DIR] [--host H --auth USER:PASSWORD]": "synopsis",
    "shardforge train": "synopsis",
    "shardforge": "synopsis",
    "shardforge --debug ...": "synopsis",
    "shardforge env": "env",
    'pip install -c constraints.txt -e ".[webui]"': "extra",
    'pip install -c constraints.txt -e ".[serve]"': "extra",
    'pip install -c constraints.txt -e ".[track]"': "extra",
    "apt-get install -y chromium": "ci",
    "docker build -f docker/Dockerfile -t shardforge .": "docker",
    "bash scripts/wheelhouse.sh wheelhouse/ --python-version 3.12 --extras gpucheck --exclude numpy,pyarrow": "offline",  # noqa: E501
    'python -m pip install --no-index --find-links wheelhouse/ -c wheelhouse/constraints.txt "shardforge[gpucheck]"': "offline",  # noqa: E501
    "docker run --rm -v $PWD/runs:/opt/shardforge/runs shardforge train examples/demo.yaml": "docker",
}  # fmt: skip

# The README's paths a user would have, and what stands in for them here
STAND_INS = {
    "/models/Qwen2.5-0.5B-Instruct": "runs/demo/final",
    "data/my_instructions.jsonl": "examples/data/demo_alpaca.jsonl",
    "data/my_eval.jsonl": "examples/data/demo_eval.jsonl",
    "/models/base": "runs/demo/final",
}


def _spans(text: str) -> list[tuple[int, str]]:
    """Inline code spans outside fenced blocks that start with a program, whitespace joined."""
    fenced, kept = False, []
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        kept.append("" if fenced or line.startswith("```") else line)
    body = "\n".join(kept)
    found = []
    for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", body):
        command = " ".join(m.group(1).split())
        if command.startswith(PROGRAMS):
            found.append((body[: m.start()].count("\n") + 1, command))
    return found


def documented() -> dict[str, str]:
    """Every command the README and the examples' headers give, with where it first appears: the README's
    shell blocks line by line (comments cut), inline spans that start with a program, header lines that
    start with `shardforge`, and each example itself (`shardforge train examples/X.yaml`) where its header
    gives no command for it."""
    found: dict[str, str] = {}
    readme = (REPO / "README.md").read_text()
    fenced = None
    for number, line in enumerate(readme.split("\n"), 1):
        if line.startswith("```"):
            fenced = line[3:].strip() if fenced is None else None
            continue
        if fenced in ("bash", "sh", "shell") and line.strip():
            command = re.sub(r"\s+#.*$", "", line).strip()
            found.setdefault(command, f"README.md:{number}")
    for number, command in _spans(readme):
        found.setdefault(command, f"README.md:{number}")
    for example in DOCS[1:]:
        header = "\n".join(line[1:] for line in example.read_text().split("\n") if line.startswith("#"))
        for number, command in _spans(header):
            found.setdefault(command, f"{example.name}:{number}")
        for number, line in enumerate(header.split("\n"), 1):
            if line.strip().startswith("shardforge "):
                found.setdefault(line.strip(), f"{example.name}:{number}")
        itself = f"shardforge train examples/{example.name}"
        if not any(c.startswith(itself) for c in found):  # its header says what to run first, "then this"
            found[itself] = f"{example.name} (the example itself)"
    return found


def commands(kind: str) -> list[str]:
    return [c for c, k in HOW.items() if k == kind]


def test_every_documented_command_is_run():
    """A command added to the README (or an example's header) needs its run here; one removed, its entry."""
    docs = documented()
    untested = {c: where for c, where in docs.items() if c not in HOW}
    stale = [c for c in HOW if c not in docs]
    assert not untested, f"documented commands with no run in tests/e2e/test_readme.py HOW: {untested}"
    assert not stale, f"HOW lists commands no document gives any more: {stale}"


# ---- running a command as written --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A fresh working folder: examples/ linked in; runs/, caches and the user's files its own."""
    root = tmp_path_factory.mktemp("readme")
    (root / "examples").symlink_to(REPO / "examples")
    (root / "docker").symlink_to(REPO / "docker")
    return root


def _argv(command: str, ws: Path) -> list[str]:
    for path, stand_in in STAND_INS.items():
        command = command.replace(path, stand_in)
    argv = shlex.split(command)
    program = {"shardforge": ["-m", "shardforge"], ".venv/bin/shardforge": ["-m", "shardforge"],
               ".venv/bin/python": []}[argv[0]]  # fmt: skip
    argv = [sys.executable, *program, *argv[1:]]
    if argv[3:4] == ["train"]:  # shortened: after the command's own arguments
        argv += SHORT
    return argv


def _env(ws: Path) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "XDG_CACHE_HOME": str(ws / ".cache"), "HOME": str(ws)}  # fmt: skip


def run(command: str, ws: Path, stdin: str | None = None, timeout: int = 400) -> subprocess.CompletedProcess:
    """The last part of a `&&` chain (the install parts are CI's own: test_the_install_is_ci_s)."""
    part = command.split("&&")[-1].strip()
    proc = subprocess.run(_argv(part, ws), input=stdin, capture_output=True, text=True, timeout=timeout,
                          cwd=ws, env=_env(ws))  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _generates(folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


# ---- the runs, in the README's order -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(ws) -> Path:
    """README: the demo's run folder holds config.yaml, metrics.jsonl, tensorboard/, loss.png and final/, an
    HF folder (model + tokenizer) that transformers loads and generates from."""
    for command in commands("demo"):
        run(command, ws)
    out = ws / "runs" / "demo"
    for name in ("config.yaml", "metrics.jsonl", "tensorboard", "loss.png", "final/tokenizer.json"):
        assert (out / name).exists(), name
    _generates(out / "final")
    return out


def test_the_demo(demo):
    assert yaml.safe_load((demo / "config.yaml").read_text())["model"]["preset"] == "demo"


def test_the_install_is_ci_s():
    """The install chain and the whole suite: .ci/run runs them verbatim (on a clean clone)."""
    ci = (REPO / ".ci" / "run").read_text()
    for command in commands("suite"):
        assert command in ci
    for command in commands("demo"):
        assert command.rpartition("&&")[0].strip() in ci
    for command in commands("ci"):  # its flags may sit among others on a line
        assert any(set(command.split()) <= set(re.findall(r"[^\s()]+", line)) for line in ci.splitlines())


def test_the_quick_tier_collects_the_unit_tests_only(ws):
    (command,) = commands("quick")
    argv = [*_argv(command, ws), "--collect-only", "-p", "no:cacheprovider"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300, env=_env(ws))
    assert proc.returncode == 0, proc.stdout[-2000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    # tests/cuda: the CUDA tier, skipped where there is no GPU (README: Supported versions)
    assert collected and all(line.startswith(("tests/unit/", "tests/cuda/")) for line in collected)
    assert any(line.startswith("tests/unit/") for line in collected)


@pytest.fixture(scope="module")
def my_sft(ws, demo) -> Path:
    """README's quickstart YAML as my_sft.yaml (the demo's model and data standing in), then both commands."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```yaml\n(# my_sft.yaml\n.*?)```", readme, re.S).group(1)
    for path, stand_in in STAND_INS.items():
        block = block.replace(path, stand_in)
    first, second = commands("sft")
    (ws / "my_sft.yaml").write_text(block.replace("grad_accum: 8", "grad_accum: 1"))  # shortened, as SHORT
    run(first, ws)
    out = ws / "runs" / "my-sft"
    _generates(out / "final")  # "loads with AutoModelForCausalLM.from_pretrained"
    run(second, ws)
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["train"]["lr"] == 2e-5 and config["data"]["max_length"] == 1024
    return out


@pytest.fixture(scope="module")
def my_lora(ws, my_sft) -> Path:
    """`method.finetuning: lora` in the quickstart's config (run into runs/my-lora, the README's adapter
    path): final/ is a PEFT adapter folder."""
    cfg = yaml.safe_load((ws / "my_sft.yaml").read_text())
    cfg["method"]["finetuning"], cfg["output_dir"] = "lora", "runs/my-lora"
    (ws / "my_lora.yaml").write_text(yaml.safe_dump(cfg))
    run("shardforge train my_lora.yaml", ws)
    out = ws / "runs" / "my-lora"
    assert json.loads((out / "final" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    return out


def test_the_quickstart_and_its_lora_export(ws, my_lora):
    """`export RUN --to merged/ --merge` writes a plain HF folder from the LoRA run (read in runs/my-lora)."""
    (command,) = commands("lora-export")
    run(command.replace("runs/my-sft", "runs/my-lora"), ws)
    _generates(ws / "merged")


def test_chat_and_generate(ws, my_sft):
    (chat,) = commands("chat")
    proc = run(chat, ws, stdin="What is 2 + 3?\n/reset\n/system Be brief.\nAnd 4 + 4?\n")
    assert proc.stdout.count("(conversation reset)") == 2
    (ws / "prompts.jsonl").write_text(
        json.dumps({"prompt": "2 + 3 =", "max_tokens": 4}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) + "\n"
    )  # fmt: skip
    (generate,) = commands("generate")
    run(generate, ws)
    results = [json.loads(line) for line in (ws / "results.jsonl").read_text().splitlines()]
    assert len(results) == 2


def test_eval_after_training(ws, my_sft):
    """Predictions with LF's metrics files, and an lm-eval task, on the quickstart's run."""
    predict, tasks = commands("eval")
    run(predict, ws)
    out = ws / "runs" / "my-sft" / "predict"
    rows = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert rows and set(rows[0]) >= {"prompt", "predict", "label"}
    assert "predict_bleu-4" in json.loads((out / "predict_results.json").read_text())
    run(tasks, ws)
    results = json.loads((ws / "runs" / "my-sft" / "lm-eval" / "lm_eval_results.json").read_text())
    assert "shardforge_tiny_mc" in json.dumps(results)


def _serve(command: str, ws: Path, key: str | None) -> None:
    """Start the server as written, wait for /health, complete one request (with the key when it takes
    one; without it a 401), then SIGTERM: it exits 0."""
    proc = subprocess.Popen(_argv(command, ws), cwd=ws, env=_env(ws), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        models = urllib.request.Request("http://127.0.0.1:8000/v1/models", headers=headers)
        with urllib.request.urlopen(models, timeout=30) as r:
            name = json.loads(r.read())["data"][0]["id"]
        headers.pop("Authorization", None)
        body = json.dumps({"model": name, "prompt": "2 + 3 =", "max_tokens": 3}).encode()
        if key is not None:
            request = urllib.request.Request("http://127.0.0.1:8000/v1/completions", body, headers)
            with pytest.raises(urllib.error.HTTPError, match="401"):
                urllib.request.urlopen(request, timeout=60)
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request("http://127.0.0.1:8000/v1/completions", body, headers)
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["text"] is not None
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve(ws, my_sft, my_lora):
    """The plain server, then the adapter over the base on 2 tensor-parallel ranks with an API key."""
    plain, adapter = commands("serve")
    _serve(plain, ws, None)
    _serve(adapter, ws, "KEY")


def test_the_examples(ws, demo):
    """Each example as its header says to run it, over the demo's final model; final/ is what it says."""
    from peft import PeftModel

    finals = {}
    for command in commands("example"):
        name = Path(command.split()[2]).stem
        out = ws / yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())["output_dir"]
        shutil.rmtree(out, ignore_errors=True)  # a fresh run folder
        run(command, ws, timeout=600)
        finals[name] = out / "final"
    for name in ("demo_lora", "demo_qlora", "dpo_lora", "kto"):
        assert json.loads((finals[name] / "adapter_config.json").read_text())["peft_type"] == "LORA"
    for name in ("grpo_math", "ppo", "moe_qwen3", "long_context_cp", "vlm_sft"):
        assert (finals[name] / "config.json").is_file(), name
    assert (finals["vlm_sft"] / "preprocessor_config.json").is_file()  # the VLM's image processor travels
    runs = ws / "runs"
    rm = json.loads((finals["rm"] / "config.json").read_text())
    assert rm["architectures"][0].endswith("ForSequenceClassification") and len(rm["id2label"]) == 1
    # demo_lora's header: peft loads its final/ over the demo's, and its export command merges it
    base = AutoModelForCausalLM.from_pretrained(runs / "demo" / "final")
    PeftModel.from_pretrained(base, runs / "demo_lora" / "final")
    (export,) = commands("example-export")
    run(export, ws)
    _generates(runs / "demo_lora_merged")


def test_env_and_the_cli_table(ws):
    """`shardforge env` runs; each synopsis's command exists and takes every flag it shows."""
    (env,) = commands("env")
    assert "torch" in run(env, ws).stdout
    for synopsis in commands("synopsis"):
        words = synopsis.split()
        sub = [w for w in words[1:3] if re.fullmatch(r"[a-z]+", w)]
        if sub[:1] == ["data"]:
            sub = ["data", "prepare"]
        argv = [sys.executable, "-m", "shardforge", *sub[:2], "--help"]
        helped = subprocess.run(argv, capture_output=True, text=True, cwd=ws, env=_env(ws), timeout=120)
        assert helped.returncode == 0, (synopsis, helped.stderr)
        for flag in re.findall(r"--[a-z][a-z-]*", synopsis):
            assert flag in helped.stdout, (synopsis, flag)


def test_the_extras_and_the_image():
    """pip's extras exist in pyproject.toml; Docker is not on this machine, so the image's commands are
    checked against docker/Dockerfile (its path, the entry point `shardforge`, the folder runs/ is in)."""
    pyproject = (REPO / "pyproject.toml").read_text()
    for command in commands("extra"):
        extra = re.search(r"\[(\w+)\]", command).group(1)
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    build, run_ = commands("docker")
    assert "-f docker/Dockerfile" in build and (REPO / "docker" / "Dockerfile").is_file()
    assert re.search(r'ENTRYPOINT \["shardforge"\]', dockerfile)
    mount = re.search(r":(/\S+)/runs", run_).group(1)
    assert f"WORKDIR {mount}" in dockerfile


def test_the_offline_install():
    """The wheelhouse's build for another Python is not run here (its wheels would not install on this one):
    its options parse as written, and tests/e2e/test_wheelhouse.py builds one for this Python and installs
    it with the same flags, no index, beside an existing torch, then runs the demo."""
    build, install = commands("offline")
    argv = shlex.split(build)
    assert argv[:2] == ["bash", "scripts/wheelhouse.sh"]
    spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    args = wheelhouse.parse_args(argv[2:])
    assert args.python_version == "3.12" and args.extras == "gpucheck"
    assert re.search(r"^gpucheck = \[", (REPO / "pyproject.toml").read_text(), re.M)
    used = (REPO / "tests" / "e2e" / "test_wheelhouse.py").read_text()
    for flag in ("--no-index", "--find-links", "-c", "constraints.txt"):
        assert flag in install and f'"{flag}"' in used, flag
