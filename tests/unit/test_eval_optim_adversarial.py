"""Adversarial tests of `shardforge eval` (predictions + BLEU/ROUGE as LLaMA-Factory 0.9.5 writes them, and
lm-evaluation-harness tasks) and of the optimizer menu (train.optimizer.name) with LoRA+.

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
from shardforge.errors import ConfigError, ShardforgeError
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
    metric = reference().src / "src" / "llamafactory" / "train" / "sft" / "metric.py"  # made on first use
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


# ---- optimizers --------------------------------------------------------------------------------------------


def _cfg(optimizer: dict | None = None, method: dict | None = None, **train):
    base = tiny_config(Path("/nonexistent"), Path("/nonexistent/train.jsonl"))
    base["train"].update({"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}, **train)
    if optimizer is not None:
        base["train"]["optimizer"] = optimizer
    if method is not None:
        base["method"] = method
    return load_config(None, base=base)


def _tiny(cfg):
    from shardforge.models.build import model_source
    from shardforge.models.spec import spec_for

    shape = model_source(cfg.model)[0]
    torch.manual_seed(0)
    model = spec_for(shape.family).build(shape)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.float(), shape


def _steps(model, optimizer, n: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, 1024, (2, 16), generator=g)
        logits = model(ids)
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_badam_with_freeze_finetuning_trains_only_the_unfrozen_layers():
    """Fixed: BAdam's BlockOptimizer (layer mode) is given every named parameter (block_prefix_list=None), so
    under method.finetuning=freeze it switches requires_grad onto layers.0 — a layer freeze keeps frozen — and
    trains it, while the layer freeze trains (layers.1) never moves. A silently different run."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": "badam"}, method={"finetuning": "freeze", "freeze": {"trainable_layers": 1}})
    model, shape = _tiny(cfg)
    apply_finetuning(model, cfg.method, 0, None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    except ConfigError:
        return  # a clear refusal is a fix too
    _steps(model, opt)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved <= trainable, (
        f"BAdam under freeze moved frozen parameters {sorted(moved - trainable)[:3]}... "
        f"(trainable were {sorted(trainable)[:2]}...): shardforge/train/optimizers/menu.py badam passes "
        "every parameter; pass the trainable blocks (block_prefix_list) or refuse badam with freeze"
    )


def test_badam_start_block_past_the_last_block_is_a_config_error():
    """Fixed: train.optimizer.badam.start_block beyond the model's blocks is an IndexError in the badam
    package, not a ConfigError naming the key."""
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": "badam", "badam": {"start_block": 99}})
    model, shape = _tiny(cfg)
    try:
        build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    except ConfigError as exc:
        assert "start_block" in str(exc)
    except Exception as exc:
        pytest.fail(
            f"start_block=99 on a 2-block model raised {type(exc).__name__}: {exc} (not a ConfigError)"
        )
    else:
        pytest.fail("start_block=99 on a 2-block model was accepted")


@pytest.mark.parametrize("betas", [[1.5, 0.9], [0.9, -0.1], [0.9, 1.0]])
def test_betas_outside_zero_one_are_a_config_error(betas):
    """Fixed: train.betas has no range: [1.5, 0.9] loads, then AdamW raises torch's ValueError at build
    (a traceback) and Muon's AdamW part accepts it silently (a diverging run)."""
    with pytest.raises(ConfigError, match=r"train\.betas"):
        _cfg(betas=betas)


def test_eps_must_be_finite():
    with pytest.raises(ConfigError, match=r"train\.eps"):
        _cfg(eps=float("inf"))


@pytest.mark.parametrize("finetuning", ["oft", "full", "freeze"])
def test_lora_plus_ratio_without_lora_is_refused_not_ignored(finetuning):
    """Fixed: method.lora.plus_lr_ratio with method.finetuning oft/full/freeze loads and is silently dropped
    (train/optim.py build_optimizer reads it only for lora); LF refuses loraplus_lr_ratio without LoRA (our
    own lf_convert does too)."""
    with pytest.raises(ConfigError, match="plus_lr_ratio"):
        _cfg(method={"finetuning": finetuning, "lora": {"plus_lr_ratio": 16.0}})


@pytest.mark.parametrize("variant", [{"dora": True}, {"init": "pissa", "pissa_iter": -1}, {"rslora": True}])
def test_lora_plus_groups_with_dora_and_pissa_follow_llamafactory(variant):
    """LF's `_create_loraplus_optimizer`: lora_B and every 1-D trained tensor (DoRA's magnitudes) at lr x
    ratio; decay by LF's rule; and the run steps with finite weights."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.train.optim import build_optimizer
    from shardforge.train.optimizers.groups import lf_decay_names

    lora = {"rank": 4, "targets": ["q_proj", "v_proj"], "plus_lr_ratio": 8.0} | variant
    cfg = _cfg(method={"finetuning": "lora", "lora": lora})
    model, shape = _tiny(cfg)
    apply_finetuning(model, cfg.method, 0, None)
    opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    decay = lf_decay_names(model)
    by_id = {id(p): g for g in opt.param_groups for p in g["params"]}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(id(p) in by_id for _, p in trained)
    if variant.get("dora"):
        assert any(p.ndim == 1 for _, p in trained), "DoRA's magnitudes are not trained"
    for name, p in trained:
        plus = "lora_B" in name or p.ndim == 1
        assert by_id[id(p)]["lr"] == pytest.approx(1e-3 * (8.0 if plus else 1.0)), name
        assert by_id[id(p)]["weight_decay"] == (0.1 if name in decay else 0.0), name
    _steps(model, opt)
    assert all(torch.isfinite(p).all() for _, p in trained)


def test_adam_mini_on_a_generic_backend_family_runs_or_is_refused(tmp_path):
    """Fixed (traceback): train.optimizer.name=adam_mini on a gpt_neox model (generic backend; fused
    query_key_value, biased MLP) builds, then its first step dies inside adam_mini with `IndexError: too many
    indices for tensor of dimension 1` (its name rules take a 1-D MLP bias for a neuron-wise matrix). LF
    builds
    it the same way, but a run should not die mid-step: refuse what adam_mini cannot partition at build time
    (a ConfigError naming train.optimizer.name), or group such tensors as adam_mini's plain ones."""
    from shardforge.train.trainer import train

    neox = _neox_folder(tmp_path / "neox")
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(8))
    cfg = tiny_config(
        tmp_path,
        data,
        train={"steps": 2, "optimizer": {"name": "adam_mini"}},
        checkpoint={"save_final": False},
    )
    cfg["model"] = {"path": str(neox)}
    try:
        train(load_config(None, base=cfg))
    except ConfigError as exc:
        assert "adam_mini" in str(exc)
    except Exception as exc:
        pytest.fail(f"adam_mini on gpt_neox: {type(exc).__name__}: {exc} (mid-run, not a ConfigError)")


@pytest.mark.parametrize("name", ["muon", "galore", "apollo", "adam_mini", "badam", "adamw_8bit"])
def test_menu_steps_a_bf16_model(name):
    """Pure bf16 parameters (model dtype bf16): every choice builds and steps to finite weights."""
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": name})
    model, shape = _tiny(cfg)
    model = model.to(torch.bfloat16)
    opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    _steps(model, opt)
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["muon", "galore", "apollo", "adam_mini", "adamw_8bit"])
def test_menu_with_freeze_moves_only_trainable_parameters(name):
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": name}, method={"finetuning": "freeze", "freeze": {"trainable_layers": 1}})
    model, shape = _tiny(cfg)
    apply_finetuning(model, cfg.method, 0, None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _steps(model, build_optimizer(model, cfg.train, method=cfg.method, model_config=shape))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= trainable, sorted(moved - trainable)


@pytest.mark.parametrize("key", ["galore", "apollo"])
def test_empty_projection_targets_are_a_config_error_naming_the_key(key):
    from shardforge.train.optim import build_optimizer

    try:
        cfg = _cfg({"name": key, key: {"targets": []}})
    except ConfigError as exc:
        assert f"train.optimizer.{key}.targets" in str(exc)
        return
    model, shape = _tiny(cfg)
    with pytest.raises(ConfigError, match=f"train.optimizer.{key}.targets"):
        build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)


def test_fuzzed_optimizer_keys_are_config_errors_or_runs():
    """Random values of the menu's keys: each either loads and steps a tiny model to finite weights, or is a
    ConfigError naming the key; never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shardforge.train.optim import build_optimizer

    num = st.one_of(
        st.integers(-3, 300),
        st.floats(allow_nan=True, allow_infinity=True),
        st.just("x"),
        st.none(),
        st.booleans(),
    )
    sections = {
        "galore": ["rank", "update_interval", "scale", "proj_type", "layerwise", "targets"],
        "apollo": ["rank", "update_interval", "scale", "proj", "proj_type", "scale_type", "scale_front"],
        "badam": ["mode", "start_block", "switch_mode", "switch_interval", "update_ratio", "mask_mode"],
        "muon": ["momentum", "nesterov", "ns_steps"],
    }
    failures: list[str] = []

    def attempt(name, option):
        try:
            cfg = _cfg(option, clip=None)
        except ConfigError as exc:
            if f"train.optimizer.{name}" not in str(exc):
                failures.append(f"{option}: ConfigError without the key: {exc}")
            return
        model, shape = _tiny(cfg)
        try:
            opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
            _steps(model, opt, 2)
        except ConfigError:
            return
        except Exception as exc:
            failures.append(f"{option}: {type(exc).__name__}: {str(exc)[:120]}")
            return
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            failures.append(f"{option}: non-finite weights after 2 steps")

    # edge values first (a tiny model: 2 blocks, hidden 64), then hypothesis' draws
    for name, key, value in [
        ("badam", "start_block", 2),
        ("badam", "start_block", 99),
        ("badam", "switch_interval", 1),
        ("badam", "switch_interval", -1),
        ("badam", "update_ratio", 1.0),
        ("galore", "rank", 1000),
        ("galore", "update_interval", 1),
        ("galore", "proj_type", "full"),
        ("apollo", "rank", 1000),
        ("apollo", "proj", "svd"),
        ("apollo", "scale_type", "tensor"),
        ("muon", "ns_steps", 99),
        ("muon", "momentum", 0.0),
        ("galore", "targets", ["lm_head"]),
        ("apollo", "targets", ["embed_tokens"]),
    ]:
        attempt(name, {"name": name, name: {key: value}})

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(sections)), st.data())
    def check(name, data):
        key = data.draw(st.sampled_from(sections[name]))
        value = data.draw(st.one_of(num, st.sampled_from(["std", "random", "layer", "ratio", "all", []])))
        attempt(name, {"name": name, name: {key: value}})

    check()
    assert not failures, "values that escape as tracebacks:\n" + "\n".join(sorted(set(failures))[:10])


def test_planner_auto_names_badam_not_memory_when_only_badam_refuses(monkeypatch):
    """Fixed: `parallel: auto` on 2 processes with train.optimizer.name=badam (one process only) says 'no
    layout ... runs this job ... use more devices, a shorter data.max_length or method.finetuning=lora' —
    the demo fits in memory easily, and lora is refused with badam. The search never asks layout_refusal."""
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    cfg = load_config(
        REPO / "examples" / "demo.yaml",
        ["parallel.auto=true", "train.optimizer.name=badam", "checkpoint.every=null"],
    )
    shape = model_source(cfg.model)[0]
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 2, shape)
    message = str(info.value)
    assert "badam" in message and "finetuning=lora" not in message, (
        f"the refusal does not say badam needs one process: {message}"
    )


def test_planner_auto_finds_the_grad_accum_1_layout_layerwise_galore_needs(monkeypatch):
    """Fixed: one process, galore.layerwise with train.clip null: the explicit layout (micro_batch 4 x
    grad_accum 1) runs, but `parallel: auto` says 'no layout ... runs this job' — the search tries each
    group's
    least-memory layout first (micro_batch 1 x grad_accum 4), which layerwise refuses, and skips the whole
    group as if it did not fit in memory (shardforge/planner/search.py Planner.search: `if not
    self._consider(least, plan): continue` does not tell a broken rule from memory)."""
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    overrides = ["train.optimizer.name=galore", "train.optimizer.galore.layerwise=true", "train.clip=null"]
    explicit = load_config(REPO / "examples" / "demo.yaml", overrides)
    shape = model_source(explicit.model)[0]
    preflight(explicit, 1, shape)  # runs as written
    auto = load_config(REPO / "examples" / "demo.yaml", [*overrides, "parallel.auto=true"])
    try:
        _, _, grad_accum, _, _ = preflight(auto, 1, shape)
    except ConfigError as exc:
        pytest.fail(f"parallel.auto refused a job whose explicit layout runs: {exc}")
    assert grad_accum == 1


def test_planner_auto_names_the_lora_plus_rule_not_memory(monkeypatch):
    """Fixed: LoRA+ with muon under `parallel: auto` is refused as 'no layout ... runs this job ... use more
    devices, a shorter data.max_length or method.finetuning=lora' (it IS lora); the explicit layout gets the
    rule's own message (method.lora.plus_lr_ratio ... use adamw or adamw_8bit)."""
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    cfg = load_config(
        REPO / "examples" / "demo.yaml",
        [
            "parallel.auto=true",
            "method.finetuning=lora",
            "method.lora.plus_lr_ratio=16",
            "train.optimizer.name=muon",
        ],
    )
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 1, model_source(cfg.model)[0])
    assert "plus_lr_ratio" in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["muon", "galore", "adam_mini", "adamw_8bit"])
def test_planner_auto_resolves_a_layout_each_whole_tensor_optimizer_accepts(monkeypatch, name):
    from shardforge.config.optimizers import layout_refusal
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "examples" / "demo.yaml", ["parallel.auto=true", f"train.optimizer.name={name}"])
    shape = model_source(cfg.model)[0]
    resolved, dims, grad_accum, _, _ = preflight(cfg, 2, shape)
    p = resolved.parallel
    assert (
        layout_refusal(
            resolved.train.optimizer,
            world=dims.dp,
            zero_stage=p.zero_stage,
            tp=dims.tp,
            pp=dims.pp,
            offload=p.offload,
            grad_accum=grad_accum,
            clip=resolved.train.clip,
            finetuning="full",
            lora_plus=False,
        )
        is None
    )


def test_resuming_with_another_optimizer_is_a_clear_error(tmp_path):
    """Fixed: a run checkpointed with AdamW and resumed (same output_dir) with train.optimizer.name=muon dies
    in torch.distributed.checkpoint with CheckpointException ('Missing key ... momentum_buffer'), a
    BaseException that even escapes `except Exception` and the CLI's handler: a traceback. It should be a
    ConfigError naming train.optimizer.name (the checkpoint's optimizer and the config's)."""
    from shardforge.train.trainer import Trainer
    from tests.dist._training import stopped_at

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(24))
    ckpt = {"save_final": False, "every": 2}
    stopped_at(tiny_config(tmp_path, data, train={"steps": 4}, checkpoint=ckpt), 2)
    cfg = tiny_config(tmp_path, data, train={"steps": 4, "optimizer": {"name": "muon"}}, checkpoint=ckpt)
    try:
        Trainer(load_config(None, base=cfg)).train()
    except ShardforgeError as exc:
        assert "optimizer" in str(exc)
    except BaseException as exc:
        pytest.fail(f"resuming an AdamW checkpoint with muon raised {type(exc).__name__}: {str(exc)[-200:]}")


@pytest.mark.parametrize("name", ["muon", "galore", "adam_mini"])
def test_grad_accum_and_clip_equal_one_big_batch(tmp_path, name):
    """grad_accum 2 x micro_batch 1 and micro_batch 2 x grad_accum 1 with train.clip: the same losses (the
    menu's optimizers see the accumulated, clipped gradient once per step)."""
    from shardforge.train.trainer import train

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(24))
    losses = []
    for mb, accum in ((2, 1), (1, 2)):
        run = tmp_path / f"r{mb}"
        cfg = tiny_config(
            run,
            data,
            train={
                "steps": 3,
                "micro_batch": mb,
                "grad_accum": accum,
                "clip": 0.5,
                "optimizer": {"name": name},
            },
            checkpoint={"save_final": False},
        )
        train(load_config(None, base=cfg))
        losses.append(
            [json.loads(x)["loss"] for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        )
    assert losses[0] == pytest.approx(losses[1], rel=1e-4), losses


def test_tied_embeddings_are_one_parameter_in_each_optimizer():
    """A tied embedding/head is one parameter: no optimizer holds it twice (a double step), and each steps."""
    from dataclasses import replace

    from shardforge.models.build import model_source
    from shardforge.models.spec import spec_for
    from shardforge.train.optim import build_optimizer

    for name in ("muon", "galore", "adam_mini", "adamw", "adamw_8bit"):
        cfg = _cfg({"name": name})
        shape = replace(model_source(cfg.model)[0], tie_embeddings=True)
        torch.manual_seed(0)
        model = spec_for(shape.family).build(shape).float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        assert len(ids) == len(set(ids)), name
        _steps(model, opt)
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
