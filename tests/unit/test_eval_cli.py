"""`shardforge eval` as a user runs it: prediction with generation on a data set (LLaMA-Factory's files and
metrics), the bundled lm-eval task (the accuracy lm-eval's own `hf` model gets on the same folder), and bad
input answered with a message that names it, exit code 2 and no traceback. Offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jieba  # noqa: F401  (pinned in the dev extra)
import pytest

from shardforge.cli import main
from tests.conftest import REPO, tiny_chat_model, write_jsonl

DEMO_EVAL = REPO / "examples" / "data" / "demo_eval.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("cli") / "tiny-chat", 256)


def _cli(home, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        "OMP_NUM_THREADS": "1",
        # the venv's ninja first, as in this process: a system ninja of another version would rebuild the CPU
        # inference kernels (30 s) in each process that alternates with the other
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HF_HOME": str(home / "hf"),  # any cache lm-eval or datasets write stays in the test's folder
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "shardforge", "eval", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


@pytest.mark.slow
def test_predict_writes_llamafactorys_files_with_transformers_greedy_answers(model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardforge.eval.similarity import similarity

    out = tmp_path / "predict"
    proc = _cli(tmp_path, str(model_dir), "--data", str(DEMO_EVAL), "--max-samples", "3",
                "--max-new-tokens", "8", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "predict_bleu-4" in proc.stdout and f"wrote {out / 'generated_predictions.jsonl'}" in proc.stdout
    lines = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in DEMO_EVAL.read_text().splitlines()[:3]]
    assert [set(line) for line in lines] == [{"prompt", "predict", "label"}] * 3
    # LF's label: the reply as the (chatml) template writes it, decoded without special tokens
    assert [line["label"] for line in lines] == [r["output"] + "\n" for r in records]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for line in lines:
        ids = tokenizer(line["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            made = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
        assert line["predict"] == tokenizer.decode(made, skip_special_tokens=True)
    metrics = json.loads((out / "predict_results.json").read_text())
    expected = similarity([line["predict"] for line in lines], [line["label"] for line in lines])
    assert {k: metrics[k] for k in expected} == expected


@pytest.mark.slow
def test_predict_tensor_parallel_writes_the_same_answers(model_dir, tmp_path):
    """--tp 2: two ranks of the command (gloo on CPU), rank 0 writes what one process writes."""
    for tp in ("1", "2"):
        proc = _cli(tmp_path, str(model_dir), "--data", str(DEMO_EVAL), "--max-samples", "3",
                    "--max-new-tokens", "8", "--out", str(tmp_path / tp), "--tp", tp)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    one, two = ((tmp_path / tp / "generated_predictions.jsonl").read_text() for tp in ("1", "2"))
    assert one == two and len(one.splitlines()) == 3


@pytest.mark.slow
def test_bundled_task_accuracy_is_lm_evals_hf_models(model_dir, tmp_path):
    from lm_eval.models.huggingface import HFLM

    from shardforge.eval.harness import run_tasks, summary

    out = tmp_path / "lm-eval"
    proc = _cli(tmp_path, str(model_dir), "--tasks", "shardforge_tiny_mc", "--limit", "12", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "shardforge_tiny_mc: acc " in proc.stdout
    saved = json.loads((out / "lm_eval_results.json").read_text())["results"]["shardforge_tiny_mc"]
    assert len((out / "samples_shardforge_tiny_mc.jsonl").read_text().splitlines()) == 12
    reference = HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=8)
    want = summary(run_tasks(reference, ["shardforge_tiny_mc"], limit=12))["shardforge_tiny_mc"]
    assert (saved["acc,none"], saved["acc_norm,none"]) == (want["acc,none"], want["acc_norm,none"])


@pytest.mark.slow
def test_bad_input_is_named_with_exit_2_and_no_traceback(model_dir, tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", [{"instruction": "Say hi", "input": "", "output": "hi"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps({"qa": {"file_name": "qa.jsonl"}}))
    cases = [
        (["/no/such/model", "--data", str(DEMO_EVAL)], "/no/such/model: no such model folder"),
        ([str(model_dir), "--tasks", "shardforge_tiny_mcq"], "unknown lm-eval task 'shardforge_tiny_mcq'"),
        ([str(model_dir), "--data", "qaa", "--dataset-info", str(tmp_path)], 'no dataset named "qaa"'),
        ([str(model_dir), "--data", "missing.jsonl"], "'missing.jsonl': no such file or folder"),
        ([str(model_dir), "--data", str(DEMO_EVAL), "--tasks", "x"], "not allowed with argument"),
        ([str(model_dir), "--tasks", "shardforge_tiny_mc", "--tp", "2"], "--tasks runs on one process"),
    ]
    for args, message in cases:
        proc = _cli(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in " ".join(proc.stderr.split()), (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_errors_in_process_name_what_is_wrong(model_dir, tmp_path, capsys):
    """The quick tier's check of the command's error paths (no subprocess)."""
    assert main(["eval", str(tmp_path / "absent"), "--data", str(DEMO_EVAL)]) == 2
    assert "absent: no such model folder" in " ".join(capsys.readouterr().err.split())
    assert main(["eval", str(model_dir), "--data", "qa", "--dataset-info", str(tmp_path)]) == 2
    assert "dataset_info file not found" in " ".join(capsys.readouterr().err.split())
    assert main(["eval", str(model_dir), "--data", str(DEMO_EVAL), "--temperature", "-1"]) == 2
    assert "temperature=-1.0 is invalid" in " ".join(capsys.readouterr().err.split())
    assert main(["eval", str(model_dir), "--tasks", "shardforge_tiny_mc", "--include-path", "/no/dir"]) == 2
    assert "--include-path /no/dir: no such folder" in " ".join(capsys.readouterr().err.split())
    assert os.environ.get("RANK", "0") == "0"
