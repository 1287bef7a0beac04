"""Adversarial tests of `shardforge eval` (predictions + BLEU/ROUGE as LLaMA-Factory 0.9.5 writes them, and
lm-evaluation-harness tasks); the optimizer menu's are in test_optim_adversarial.py.

Tests that document a defect fail now with a message saying what is wrong and what the reference does; the
others pin behaviour that held up under attack. Offline, tiny models, OMP_NUM_THREADS=1 friendly."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import jieba  # noqa: F401  (pinned in the dev extra)
import numpy as np
import pytest
import torch

from shardforge.cli import main
from shardforge.config import load_config
from tests.conftest import REPO, TOKENIZER, alpaca_records, tiny_chat_model, tiny_config, write_jsonl
from tests.lf.reference_env import reference

# ---- helpers -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("adv-eval") / "tiny-chat", 256)


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """`shardforge ...` in this process: (exit code, stdout + stderr). An exception escaping main (a
    traceback for the user) fails the test with its type and message."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    except BaseException as exc:
        pytest.fail(
            f"`shardforge {' '.join(argv[:3])} ...` raised {type(exc).__name__}: {exc!s:.300} "
            "(a traceback instead of `error: ...` and exit 2)"
        )
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _lf_compute_similarity():
    """LF 0.9.5's own `ComputeSimilarity` (train/sft/metric.py, its source executed as it is) with its
    package-relative imports replaced by their values: IGNORE_INDEX -100, numpify = np.asarray."""
    metric = reference().package / "train" / "sft" / "metric.py"  # made on first use
    source = metric.read_text()
    source = source.replace("from ...extras.constants import IGNORE_INDEX", "IGNORE_INDEX = -100")
    source = source.replace("from ...extras.misc import numpify", "numpify = __import__('numpy').asarray")
    source = source.replace(
        "from ...extras.packages import is_jieba_available, is_rouge_available",
        "is_jieba_available = is_rouge_available = lambda: True",
    )
    module = types.ModuleType("lf_metric")
    exec(compile(source, str(metric), "exec"), module.__dict__)
    return module.ComputeSimilarity


class _RowTokenizer:
    """A tokenizer whose row i decodes to texts[i] (so LF's metric scores exactly these strings)."""

    pad_token_id = 0

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.texts[int(row[0]) - 1] for row in rows]


def _lf_similarity(preds: list[str], labels: list[str]) -> dict[str, float]:
    compute = _lf_compute_similarity()
    texts = preds + labels
    tokenizer = _RowTokenizer(texts)
    p = np.arange(1, len(preds) + 1)[:, None]
    lab = np.arange(len(preds) + 1, len(texts) + 1)[:, None]
    result = compute(tokenizer)(types.SimpleNamespace(predictions=p, label_ids=lab))
    return {f"predict_{k}": v for k, v in result.items()}


# ---- eval: the metric against LF's own code ----------------------------------------------------------------

PAIRS = [
    ("答案是四十二。", "答案是四十二。"),
    ("今天天气很好，我们去公园散步吧", "今天天气不错，我们去公园走走"),
    ("The sum is 42.", "The sum is 42. ok ok"),
    ("", "nothing predicted"),
    ("an answer for an empty label", ""),
    ("   \n\t ", "whitespace only prediction"),
    ("emoji 🚀🚀 and ünïcödé", "emoji 🚀 and unicode"),
    ("a", "a"),
    ("混合 mixed 文本 text 123", "混合文本 text 1234"),
    ("\ufffd", "\ufffd"),  # a byte cut by --cutoff-len decodes to the replacement character
]


def test_similarity_equals_llamafactorys_compute_similarity_on_the_same_strings():
    from shardforge.eval.similarity import similarity

    preds, labels = [p for p, _ in PAIRS], [t for _, t in PAIRS]
    ours = similarity(preds, labels)
    lf = _lf_similarity(preds, labels)
    assert set(ours) == set(lf)
    for key in lf:
        assert ours[key] == pytest.approx(lf[key], abs=1e-9), (key, ours[key], lf[key])
    for pred, label in PAIRS:  # item by item too (the mean could hide compensating errors)
        assert similarity([pred], [label]) == pytest.approx(_lf_similarity([pred], [label]), abs=1e-9), pred


def test_similarity_property_against_llamafactory():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shardforge.eval.similarity import similarity

    text = st.text(alphabet=st.sampled_from(list("ab cd,。中文字x\n🚀é1")), max_size=12)

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(text, text), min_size=1, max_size=3))
    def check(pairs):
        preds, labels = [p for p, _ in pairs], [t for _, t in pairs]
        lf = _lf_similarity(preds, labels)
        ours = similarity(preds, labels)
        assert ours == pytest.approx(lf, abs=1e-9), (pairs, ours, lf)

    check()


# ---- eval: the label, as LF writes it ----------------------------------------------------------------------


def _lf_label(tokenizer, template, messages) -> str:
    """LF's label: the reply's tokens as the template encodes the assistant turn (`format_assistant`, for
    chatml/qwen `{{content}}<|im_end|>\\n`; processor/unsupervised.py), decoded with skip_special_tokens
    (trainer.py save_predictions): the text the template puts after the generation prompt, specials
    dropped."""
    from shardforge.data.templates import render

    full = render(tokenizer, template, messages)
    prompt = render(tokenizer, template, messages[:-1], generation_prompt=True)
    assert full.startswith(prompt)
    ids = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_predicted_labels_are_llamafactorys_decoded_reply(tmp_path, tokenizer):
    """Fixed: LF's label is the decoded reply *as the template encodes it* — for the chatml/qwen templates
    `content<|im_end|>\\n`, so `content\\n` after the special token is skipped — and BLEU-4 (over characters)
    is computed against that. Ours is the raw `content`, so the `label` column and every BLEU-4 differ."""
    from shardforge.data.templates import resolve_template
    from shardforge.eval.predict import dataset_specs, prompt_items, read_records

    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "input": "", "output": "答案是四十二。"}])
    records = read_records(dataset_specs([str(data)]))
    template = resolve_template(tokenizer, "auto")
    (item,) = prompt_items(records, tokenizer, template)
    expected = _lf_label(tokenizer, template, list(records[0].messages))
    assert item.label == expected, (
        f"label {item.label!r}; LLaMA-Factory writes (and scores BLEU against) {expected!r}: "
        "shardforge/eval/predict.py prompt_items takes the reply's raw content"
    )


def test_cutoff_len_cuts_the_label_as_llamafactory_counts_it(tmp_path, tokenizer):
    """LF counts the label's tokens with the template's assistant suffix (`<|im_end|>\\n`) when infer_seqlen
    splits cutoff_len: the prompt it keeps follows from that count."""
    from shardforge.data.templates import resolve_template
    from shardforge.data.truncate import infer_seqlen
    from shardforge.eval.predict import dataset_specs, prompt_items, read_records

    output = "word " * 40
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "tell " * 40, "input": "", "output": output}])
    records = read_records(dataset_specs([str(data)]))
    template = resolve_template(tokenizer, "auto")
    (item,) = prompt_items(records, tokenizer, template, cutoff_len=40)
    from shardforge.data.templates import render

    messages = list(records[0].messages)
    prompt = render(tokenizer, template, messages[:-1], generation_prompt=True)
    full = render(tokenizer, template, messages)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    label_ids = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)  # LF's labels
    kept_prompt, _ = infer_seqlen(len(prompt_ids), len(label_ids), 40)
    assert len(item.prompt_ids) == kept_prompt, (
        f"prompt cut to {len(item.prompt_ids)} tokens; LF's infer_seqlen (labels with the template's "
        f"assistant suffix) keeps {kept_prompt}"
    )


# ---- eval: the files --------------------------------------------------------------------------------------


def test_predictions_file_keys_order_and_unicode(tmp_path):
    from shardforge.eval.predict import Prediction, write_predictions

    preds = [Prediction("<|im_start|>user\n你好<|im_end|>\n", "答案🚀", "答案", [1, 2])]
    write_predictions(preds, tmp_path, 0.5)
    line = (tmp_path / "generated_predictions.jsonl").read_text(encoding="utf-8")
    # LF: json.dumps({"prompt", "predict", "label"}, ensure_ascii=False) + "\n"
    assert (
        line
        == json.dumps({"prompt": preds[0].prompt, "predict": "答案🚀", "label": "答案"}, ensure_ascii=False)
        + "\n"
    )
    assert not (tmp_path / "generated_predictions.jsonl.partial").exists()


def test_metrics_file_is_written_as_transformers_save_metrics_writes_it(tmp_path):
    """Fixed (format): LF's predict_results.json comes from transformers' `Trainer.save_metrics`:
    `json.dump(metrics, f, indent=4, sort_keys=True)`. Ours is indent 2 in insertion order."""
    from shardforge.eval.predict import Prediction, write_predictions

    write_predictions([Prediction("p", "a b", "a b", [1])], tmp_path, 0.25)
    text = (tmp_path / "predict_results.json").read_text()
    metrics = json.loads(text)
    assert all(metrics[f"predict_{k}"] == 100.0 for k in ("rouge-1", "rouge-2", "rouge-l")), metrics
    assert text.rstrip("\n") == json.dumps(metrics, indent=4, sort_keys=True), (
        "predict_results.json is not written as transformers' save_metrics writes it (indent=4, sorted "
        "keys): shardforge/eval/predict.py write_predictions uses json.dumps(metrics, indent=2)"
    )


# ---- eval: bad input, before the model loads ---------------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "has no records"),
        (b'{"instruction": "\xff\xfe", "output": "x"}\n', "not UTF-8"),
        (b'{"instruction": "hi", "output": "x"}\n{"instruction": "h', "invalid JSON"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode() + b"\n", "assistant turn"),
    ],
    ids=["empty", "not-utf8", "truncated", "no-reply"],
)
def test_bad_data_is_exit_2_with_a_message(tmp_path, capsys, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    code, text = _run(
        ["eval", "/nonexistent-model", "--data", str(path), "--out", str(tmp_path / "o")], capsys
    )
    assert code == 2 and message in text and "Traceback" not in text, text
    assert "loading" not in text  # refused before any model loads


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--limit", "0"], "--limit"),
        (["--cutoff-len", "1"], "--cutoff-len"),
        (["--max-samples", "0"], "--max-samples"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--template", "llama3"], "--template"),
    ],
)
def test_bad_flags_are_exit_2_naming_the_flag(tmp_path, capsys, flags, named):
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(2))
    code, text = _run(
        ["eval", "/nonexistent", "--data", str(data), "--out", str(tmp_path / "o"), *flags], capsys
    )
    assert code == 2 and named in text and "Traceback" not in text, text


def test_unknown_dataset_name_without_dataset_info(tmp_path, capsys):
    code, text = _run(["eval", "/nonexistent", "--data", "no_such_set", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--dataset-info" in text, text


# ---- eval: runs on a tiny model ----------------------------------------------------------------------------


def test_predict_cjk_and_empty_reply_and_cut_prompts(chat_model, tmp_path, capsys):
    recs = [
        {"instruction": "你好，世界 ünïcödé", "input": "", "output": "答案是四十二。"},
        {"instruction": "hi", "input": "", "output": ""},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", recs)
    out = tmp_path / "o"
    code, text = _run(
        [
            "eval",
            str(chat_model),
            "--data",
            str(data),
            "--out",
            str(out),
            "--max-new-tokens",
            "4",
            "--cutoff-len",
            "3",
        ],
        capsys,
    )
    assert code == 0, text
    lines = [json.loads(x) for x in (out / "generated_predictions.jsonl").read_text("utf-8").splitlines()]
    assert len(lines) == 2 and lines[1]["label"] == ""
    metrics = json.loads((out / "predict_results.json").read_text())
    assert all(math.isfinite(metrics[f"predict_{k}"]) for k in ("bleu-4", "rouge-1", "rouge-2", "rouge-l"))


def test_a_prompt_longer_than_the_context_names_cutoff_len(chat_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "word " * 400, "input": "", "output": "x"}])
    code, text = _run(["eval", str(chat_model), "--data", str(data), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--cutoff-len" in text and "Traceback" not in text, text


def test_eval_with_an_adapter_equals_the_merged_model(chat_model, tmp_path, capsys):
    """--adapter DIR (a PEFT LoRA) predicts what the merged model predicts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    AutoTokenizer.from_pretrained(chat_model).save_pretrained(tmp_path / "merged")
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(3))
    answers = []
    for args in ([str(chat_model), "--adapter", str(tmp_path / "adapter")], [str(tmp_path / "merged")]):
        out = tmp_path / f"o{len(answers)}"
        code, text = _run(
            ["eval", *args, "--data", str(data), "--out", str(out), "--max-new-tokens", "6"], capsys
        )
        assert code == 0, text
        answers.append(
            [json.loads(x)["predict"] for x in (out / "generated_predictions.jsonl").read_text().splitlines()]
        )
    assert answers[0] == answers[1]


def _neox_folder(folder: Path) -> Path:
    """A tiny gpt_neox (a family without a native implementation here: the generic backend), saved with
    save_pretrained beside the bundled tokenizer."""
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = GPTNeoXConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return _neox_folder(tmp_path_factory.mktemp("adv-neox") / "neox")


def test_eval_on_a_generic_backend_family_matches_transformers_greedy(neox, tmp_path, capsys):
    """A gpt_neox model (not native: the generic backend) predicts transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(neox)
    hf = AutoModelForCausalLM.from_pretrained(neox, dtype=torch.float32).eval()
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(2))
    out = tmp_path / "o"
    code, text = _run(
        ["eval", str(neox), "--data", str(data), "--out", str(out), "--max-new-tokens", "6"], capsys
    )
    assert code == 0, text
    for line in (out / "generated_predictions.jsonl").read_text().splitlines():
        row = json.loads(line)
        ids = tok(row["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            made = hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
        assert row["predict"] == tok.decode(made, skip_special_tokens=True)


def test_harness_on_a_generic_backend_family_equals_hflm(neox):
    """ShardforgeLM on the gpt_neox folder: log-likelihoods, rolling windows and generations as lm-eval's
    `hf` model gives them on the same folder."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from shardforge.eval.harness import ShardforgeLM

    ours = ShardforgeLM(pretrained=str(neox), batch_size=2)
    theirs = HFLM(pretrained=str(neox), device="cpu", dtype="float32", batch_size=4)

    def reqs(kind, args):
        return [Instance(kind, {}, a, i) for i, a in enumerate(args)]

    pairs = [("Question: 2 + 3?\nAnswer:", " 5"), ("", "empty context"), ("x " * 300, " cut from the left")]
    got = ours.loglikelihood(reqs("loglikelihood", pairs), disable_tqdm=True)
    want = theirs.loglikelihood(reqs("loglikelihood", pairs), disable_tqdm=True)
    for (lp, g), (ref_lp, ref_g) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-3) and g == ref_g
    texts = [("A short document.",), ("word " * 400,)]
    got_r = ours.loglikelihood_rolling(reqs("loglikelihood_rolling", texts), disable_tqdm=True)
    want_r = theirs.loglikelihood_rolling(reqs("loglikelihood_rolling", texts), disable_tqdm=True)
    assert got_r == pytest.approx(want_r, abs=1e-2)
    gens = [("Count: 1 2 3", {"max_gen_toks": 7}), ("Say:", {"until": ["e"], "max_gen_toks": 12})]
    assert ours.generate_until(reqs("generate_until", gens), disable_tqdm=True) == theirs.generate_until(
        reqs("generate_until", gens), disable_tqdm=True
    )


def test_eval_on_a_vision_language_model_uses_the_images(tmp_path, capsys):
    """Fixed: `shardforge eval VLM --data` with LF's multimodal records (an `images` column, `<image>` marks)
    exits 0 with the images silently dropped: the prompt keeps the literal text `<image>` (no vision tokens,
    no pixels), so every answer is generated text-only. LF expands each `<image>` into the family's vision
    tokens and feeds the pixels. It should use the images, or refuse them (exit 2 naming the images)."""
    from tests.vision import lf_image_dataset, tiny_qwen2_vl

    model = tiny_qwen2_vl(tmp_path / "vl")
    info = lf_image_dataset(tmp_path / "data", count=2)
    out = tmp_path / "o"
    code, text = _run(
        [
            "eval",
            str(model),
            "--data",
            "mllm_demo",
            "--dataset-info",
            str(info),
            "--out",
            str(out),
            "--max-new-tokens",
            "3",
        ],
        capsys,
    )
    if code == 2:
        assert "image" in text and "Traceback" not in text, text
        return
    assert code == 0, text
    prompts = [
        json.loads(x)["prompt"] for x in (out / "generated_predictions.jsonl").read_text().splitlines()
    ]
    assert all("<|image_pad|>" in p and "<image>" not in p for p in prompts), (
        f"the images were dropped: prompt {prompts[0]!r} (shardforge/eval/predict.py prompt_items "
        "renders the text only, and predict() passes token ids without pixels)"
    )


def test_eval_on_a_run_folder_and_its_checkpoint(tmp_path, capsys):
    """A run folder (its final model) and a checkpoint folder are models `eval` takes; the run folder predicts
    what its final/ folder predicts."""
    from shardforge.train.trainer import train

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(8))
    train(load_config(None, base=tiny_config(tmp_path, data, train={"steps": 2}, checkpoint={"every": 2})))
    run = tmp_path / "run"
    answers = []
    for model in (run, run / "final", next((run / "checkpoints").glob("step-*"))):
        out = tmp_path / f"o{len(answers)}"
        code, text = _run(
            [
                "eval",
                str(model),
                "--data",
                str(data),
                "--max-samples",
                "2",
                "--max-new-tokens",
                "3",
                "--out",
                str(out),
            ],
            capsys,
        )
        assert code == 0, (model, text)
        answers.append(
            [json.loads(x)["predict"] for x in (out / "generated_predictions.jsonl").read_text().splitlines()]
        )
    assert answers[0] == answers[1] == answers[2]


@pytest.mark.parametrize("mode", ["--data", "--tasks"])
def test_out_that_is_a_file_is_exit_2_before_the_work(chat_model, tmp_path, capsys, mode):
    """Fixed: --out naming an existing file dies with FileExistsError (a traceback) in write_predictions /
    write_results, after the model loaded and every answer was generated; it should be refused up front."""
    target = tmp_path / "a-file"
    target.write_text("keep me")
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(2))
    what = [mode, str(data)] if mode == "--data" else [mode, "shardforge_tiny_mc", "--limit", "2"]
    code, text = _run(["eval", str(chat_model), *what, "--out", str(target), "--max-new-tokens", "2"], capsys)
    assert code == 2 and "--out" in text, text
    assert target.read_text() == "keep me"


def test_sampled_predictions_are_reproducible_and_per_record(chat_model, tmp_path, capsys):
    """--temperature > 0 with --seed: the same answers run after run, and a record's answer does not depend on
    which other records are predicted beside it (--max-samples)."""
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(4))
    runs = []
    for extra in ([], [], ["--max-samples", "2"]):
        out = tmp_path / f"o{len(runs)}"
        code, text = _run(
            [
                "eval",
                str(chat_model),
                "--data",
                str(data),
                "--out",
                str(out),
                "--max-new-tokens",
                "8",
                "--temperature",
                "0.9",
                "--seed",
                "7",
                *extra,
            ],
            capsys,
        )
        assert code == 0, text
        runs.append(
            [json.loads(x)["predict"] for x in (out / "generated_predictions.jsonl").read_text().splitlines()]
        )
    assert runs[0] == runs[1] and runs[2] == runs[0][:2]


# ---- eval --tasks: task YAMLs with errors ------------------------------------------------------------------


def test_a_task_yaml_that_does_not_parse_is_named(tmp_path, capsys):
    """Fixed: a YAML syntax error in --include-path is reported as `unknown lm-eval task` (lm-eval skips
    the file silently), with lm-eval's unrelated tasks as 'near it'; the message should name the file."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "broken.yaml").write_text("task: broken_task\ndataset_path: json\n  bad: [indent\n")
    code, text = _run(
        [
            "eval",
            "/nonexistent",
            "--tasks",
            "broken_task",
            "--include-path",
            str(folder),
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 2 and "Traceback" not in text, text
    assert "broken.yaml" in text, (
        f"the error does not name the YAML that failed to parse: {text.strip()[:300]} "
        "(shardforge/eval/harness.py task_manager)"
    )


def test_a_task_yaml_with_a_bad_field_is_exit_2_not_a_traceback(chat_model, tmp_path, capsys):
    """Fixed: a task whose YAML has a wrong value (here output_type) raises lm-eval's ValueError out of
    `shardforge eval` (a traceback, after the model has loaded) instead of `error: ...` and exit 2."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text(
        "task: adv_bad_type\ndataset_path: json\noutput_type: nonsense_type\ndataset_kwargs:\n"
        f"  data_files: {REPO / 'shardforge/eval/tasks/tiny_mc.jsonl'}\ntest_split: train\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: 0\n'
    )
    code, text = _run(
        [
            "eval",
            str(chat_model),
            "--tasks",
            "adv_bad_type",
            "--include-path",
            str(folder),
            "--out",
            str(tmp_path / "o"),
            "--limit",
            "2",
        ],
        capsys,
    )
    assert code == 2 and "output_type" in text, text


def test_num_fewshot_larger_than_the_pool_is_exit_2(chat_model, tmp_path, capsys):
    """Fixed: --num-fewshot 100 on a task with 20 documents raises lm-eval's `ValueError: Sample larger than
    population or is negative` out of `shardforge eval` (a traceback) instead of exit 2 naming
    --num-fewshot."""
    code, text = _run(
        [
            "eval",
            str(chat_model),
            "--tasks",
            "shardforge_tiny_mc",
            "--limit",
            "2",
            "--num-fewshot",
            "100",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 2 and "--num-fewshot" in text, text


def test_tasks_refuse_tp(tmp_path, capsys):
    code, text = _run(
        ["eval", "/nonexistent", "--tasks", "shardforge_tiny_mc", "--tp", "2", "--out", str(tmp_path)], capsys
    )
    assert code == 2 and "--tp" in text, text
