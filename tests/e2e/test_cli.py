"""The `shardforge` command end to end, as a user runs it (subprocesses, real files)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, alpaca_records, lf_messages_entry, tiny_config, write_jsonl


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardforge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


def _config(tmp_path, cfg: dict):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_alpaca_writes_a_loadable_hf_model(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(24))
    cfg = _config(tmp_path, tiny_config(tmp_path, data))
    proc = _cli("train", str(cfg), "train.steps=3", "log.tensorboard=true", "log.plot=true")
    assert proc.returncode == 0, proc.stderr
    assert "done: 3 steps" in proc.stdout
    run = tmp_path / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert (run / "loss.png").is_file() and (run / "config.yaml").is_file()
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Add 1 + 2"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_train_sharegpt(tmp_path):
    records = [
        {
            "conversations": [
                {"from": "system", "value": "Be kind."},
                {"from": "human", "value": f"hi {i}"},
                {"from": "gpt", "value": f"hello {i}"},
                {"from": "human", "value": "again"},
                {"from": "gpt", "value": "hello " * (i % 4 + 1)},
            ]
        }
        for i in range(16)
    ]
    data = write_jsonl(tmp_path / "s.jsonl", records)
    proc = _cli("train", str(_config(tmp_path, tiny_config(tmp_path, data, fmt="sharegpt"))))
    assert proc.returncode == 0, proc.stderr
    assert "train data: 16 records; 16 examples" in proc.stdout
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # A fresh model predicts uniformly: its mean loss per target token starts at ln(vocabulary size).
    assert records[0]["loss"] == pytest.approx(math.log(1024), abs=0.1)
    assert records[-1]["loss"] < records[0]["loss"] - 0.05  # 4 steps at lr 1e-3 move it visibly
    assert {"peak_flops", "peak_source", "param_bytes"} <= set(records[0]) and "peak_flops" not in records[1]


def test_llama_factory_dataset_info(tmp_path):
    write_jsonl(
        tmp_path / "lf.jsonl",
        [
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(8)
        ],
    )
    info = {"my_data": lf_messages_entry("lf.jsonl")}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    cfg = tiny_config(tmp_path, tmp_path / "unused.jsonl")
    cfg["data"]["train"] = [{"name": "my_data", "dataset_info": str(tmp_path / "dataset_info.json")}]
    proc = _cli("train", str(_config(tmp_path, cfg)), "train.steps=2")
    assert proc.returncode == 0, proc.stderr
    # Targets are the assistant turns with their end marker and newline (LLaMA-Factory's chatml form),
    # counted here with the tokenizer alone.
    tok = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    targets = sum(len(tok(f"a{i}<|im_end|>\n", add_special_tokens=False).input_ids) for i in range(8))
    assert "train data: 8 records; 8 examples" in proc.stdout and f"{targets} targets" in proc.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_malformed_line_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in alpaca_records(2)] + ['{"instruction": "x", "input": "y"}']
    bad.write_text("\n".join(lines) + "\n")
    cfg = _config(tmp_path, tiny_config(tmp_path, bad))
    proc = _cli("train", str(cfg))
    assert proc.returncode == 2
    assert f"{bad}:3:" in proc.stderr and "output" in proc.stderr
    assert "Traceback" not in proc.stderr
    debug = _cli("--debug", "train", str(cfg))
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_bad_config_value_is_one_clear_error(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(4))
    proc = _cli("train", str(_config(tmp_path, tiny_config(tmp_path, data))), "train.precision=fp8")
    assert proc.returncode == 2 and "train.precision = 'fp8'" in proc.stderr and "'bf16'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_env_reports_versions_and_peak():
    proc = _cli("env")
    assert proc.returncode == 0, proc.stderr
    assert torch.__version__ in proc.stdout  # the torch this environment runs, not a pinned string
    assert "peak fp32 (cpu)" in proc.stdout and "GFLOP/s (measured: best of" in proc.stdout
    assert "native: llama" in proc.stdout and "generic backend (model.backend: auto | hf)" in proc.stdout


def test_bad_model_and_output_paths_are_clear_errors(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(4))
    cfg = _config(tmp_path, tiny_config(tmp_path, data))
    (tmp_path / "empty").mkdir()
    cases = [
        (["model.preset=null", "model.tokenizer=null", f"model.path={tmp_path / 'nope'}"], "is not a folder"),
        (
            ["model.preset=null", "model.tokenizer=null", f"model.path={tmp_path / 'empty'}"],
            "config.json is missing",
        ),
        (["model.preset=tiny-lama"], "did you mean 'tiny-llama'"),
        (["output_dir=/proc/no/such"], "cannot be created"),
    ]
    for overrides, message in cases:
        proc = _cli("train", str(cfg), *overrides)
        assert proc.returncode == 2 and message in proc.stderr, (overrides, proc.stderr)
        assert "Traceback" not in proc.stderr


def _artifacts(run) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and "tensorboard" not in p.parts}


def test_two_rank_zero3_demo_writes_what_one_process_writes(tmp_path):
    common = ["train.steps=2", "train.eval_every=null", "train.log_every=1", "data.train.0.max_samples=400"]
    single = _cli("train", "examples/demo.yaml", *common, f"output_dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr
    proc = _cli(
        "train",
        "examples/demo.yaml",
        "--nproc",
        "2",
        "parallel.zero_stage=3",
        *common,
        f"output_dir={tmp_path / 'two'}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "FSDP2 ZeRO-3" in proc.stdout and proc.stdout.count("done:") == 1
    assert _artifacts(tmp_path / "two") == _artifacts(tmp_path / "one")
    assert any((tmp_path / "two" / "tensorboard").iterdir())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final")
    assert model.config.vocab_size == 1024


def test_four_rank_fsdp_x_tp_demo_runs_and_exports(tmp_path):
    """The issue's acceptance command (shortened): 2 data-parallel shards x 2 tensor-parallel ranks."""
    common = ["train.steps=2", "train.eval_every=null", "train.log_every=1", "data.train.0.max_samples=200"]
    proc = _cli(
        "train",
        "examples/demo.yaml",
        "--nproc",
        "4",
        "parallel.tp=2",
        "parallel.zero_stage=3",
        *common,
        f"output_dir={tmp_path / 'tp'}",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "dp_shard=2 x tp=2 on 4 rank(s), FSDP2 ZeRO-3" in proc.stdout and proc.stdout.count("done:") == 1
    # The same global batch (8 rows) in one process: the same losses, and the exported models agree.
    single = _cli(
        "train", "examples/demo.yaml", "train.grad_accum=2", *common, f"output_dir={tmp_path / 'one'}"
    )
    assert single.returncode == 0, single.stderr
    metrics, ref = ([json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                    for run in ("tp", "one"))  # fmt: skip
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in ref], rel=1e-4)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "final")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final")
    assert model.config.vocab_size == 1024
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_four_rank_pp_x_tp_demo_runs_logs_the_bubble_and_exports(tmp_path):
    """The pipeline issue's acceptance command (shortened): 2 pipeline stages x 2 tensor-parallel ranks, with
    the evaluation at the last step run through the stages."""
    common = ["train.steps=2", "train.log_every=1", "data.train.0.max_samples=200"]
    proc = _cli(
        "train",
        "examples/demo.yaml",
        "--nproc",
        "4",
        "parallel.pp=2",
        "parallel.tp=2",
        *common,
        f"output_dir={tmp_path / 'pp'}",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pp=2 x tp=2 on 4 rank(s)" in proc.stdout and proc.stdout.count("done:") == 1
    assert "pipeline 1f1b, 2 ranks x 1 stage(s), 2 micro-batches per micro-step" in proc.stdout
    # One process on the same global batch (4 rows): the same losses, eval loss and exported model.
    single = _cli("train", "examples/demo.yaml", *common, f"output_dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr
    metrics, ref = ([json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                    for run in ("pp", "one"))  # fmt: skip
    assert [m["step"] for m in metrics] == [1, 2] and all(m["step_time_s"] > 0 for m in metrics)
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in ref], rel=1e-4)
    assert metrics[-1]["eval_loss"] == pytest.approx(ref[-1]["eval_loss"], rel=1e-4)
    assert metrics[-1]["pp_bubble"] == 0.5 and "pp_bubble" not in ref[-1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "final")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final")
    assert model.config.vocab_size == 1024 and model.config.tie_word_embeddings
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_bad_pipeline_settings_fail_before_launch(tmp_path):
    proc = _cli("train", "examples/demo.yaml", "--nproc", "2", "parallel.pp=2", "parallel.pp_schedule=zbv")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parallel.pp_virtual=2" in proc.stderr
    proc = _cli("train", "examples/demo.yaml", "--nproc", "2", "parallel.pp=2", "parallel.pp_microbatches=3")
    assert (
        proc.returncode == 2 and "parallel.pp_microbatches=3 must divide train.micro_batch=4" in proc.stderr
    )


def test_export_command_writes_an_hf_folder_from_a_run(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(24))
    cfg = _config(tmp_path, tiny_config(tmp_path, data, checkpoint={"every": 2, "save_final": False}))
    assert _cli("train", str(cfg), "train.steps=2").returncode == 0
    proc = _cli("export", str(tmp_path / "run"), "--to", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    assert "step-00000002" in proc.stdout and (tmp_path / "hf" / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == 1024
    AutoTokenizer.from_pretrained(tmp_path / "hf")
    bad = _cli("export", str(tmp_path / "nothing"), "--to", str(tmp_path / "hf2"))
    assert bad.returncode == 2 and "is not a usable checkpoint: not a folder" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_data_prepare_builds_the_cache_once_and_reports_it(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(30))
    cfg = _config(tmp_path, tiny_config(tmp_path, data, data={"eval_fraction": 0.2}))
    first = _cli("data", "prepare", str(cfg))
    assert first.returncode == 0, first.stderr
    assert "tokenizing into the dataset cache" in first.stdout
    assert "train: records=24, sequences=24" in first.stdout and "eval: records=6" in first.stdout
    assert "sequence lengths (tokens: count): " in first.stdout
    again = _cli("data", "prepare", str(cfg))
    assert again.returncode == 0 and "tokenizing" not in again.stdout  # the cache is there
    train = _cli("train", str(cfg), "train.steps=1")
    assert train.returncode == 0 and "tokenizing" not in train.stdout, train.stderr  # and a run maps it
    off = _cli("data", "prepare", str(cfg), "data.cache=false")
    assert off.returncode == 2 and "data.cache=false" in off.stderr
