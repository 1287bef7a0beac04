"""lm-evaluation-harness driving our model (shardforge/eval/harness.py) gives what lm-eval's own `hf` model
(HFLM: transformers on the same folder, CPU, fp32) gives: the same log-likelihoods and greedy flags per
request, the same generations, the same rolling log-likelihoods, and on the bundled tasks the same
accuracies. Offline: the tasks read their JSONL beside the YAML, the model is a local folder."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: F401  (pinned in the dev extra)
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from shardforge.errors import ConfigError
from shardforge.eval.harness import ShardforgeLM, bundled_tasks, run_tasks, summary, task_manager
from tests.conftest import tiny_chat_model

TASKS = ["shardforge_tiny_mc", "shardforge_tiny_gen", "shardforge_tiny_ppl"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("eval") / "tiny-chat", 256)


@pytest.fixture(scope="module")
def ours(model_dir):
    return ShardforgeLM(pretrained=str(model_dir), batch_size=3)  # a batch smaller than the requests


@pytest.fixture(scope="module")
def theirs(model_dir):
    return HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_hflms(ours, theirs):
    pairs = [
        ("Question: What is 2 + 3?\nAnswer:", " 5"),
        ("Question: What is 2 + 3?\nAnswer:", " 17"),
        ("The capital of France is ", "Paris, of course."),  # the trailing space moves to the continuation
        ("", "An empty context is scored after the prefix token."),
        ("x " * 300, " too long: cut from the left"),  # past the 256-token context
    ]
    got = ours.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    want = theirs.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    for (logprob, greedy), (ref_logprob, ref_greedy) in zip(got, want, strict=True):
        assert logprob == pytest.approx(ref_logprob, abs=1e-4)
        assert greedy == ref_greedy
    assert len({round(lp, 3) for lp, _ in got}) == len(pairs)  # distinct requests, distinct answers


def test_greedy_flag_is_true_for_the_models_own_continuation(ours, theirs):
    """The continuation the model generates greedily scores as greedy (the flag can be True, not only
    False as on a random model's answers)."""
    context = "Question: What is 7 times 3?\nAnswer:"
    made = ours.generate_until(
        _requests("generate_until", [(context, {"until": ["\n"], "max_gen_toks": 5})]), disable_tqdm=True
    )[0]
    ids = ours.tok_encode(context + made)[len(ours.tok_encode(context)) :]
    text = ours.tokenizer.decode(ids)
    (logprob, greedy), (_, ref_greedy) = (
        lm.loglikelihood(_requests("loglikelihood", [(context, text)]), disable_tqdm=True)[0]
        for lm in (ours, theirs)
    )
    assert greedy and ref_greedy and logprob < 0


def test_rolling_loglikelihoods_equal_hflms(ours, theirs):
    texts = [("A short document.",), ("word " * 400,)]  # the second takes two windows of 256
    got = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", texts), disable_tqdm=True)
    want = theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", texts), disable_tqdm=True)
    assert got == pytest.approx(want, abs=1e-3)


def test_generations_equal_hflms(ours, theirs):
    args = [
        ("Question: What is 11 + 5?\nAnswer:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
        ("Say something:", {"until": ["e"], "max_gen_toks": 20}),  # a stop string that comes early
        ("Count: 1 2 3", {"max_gen_toks": 7}),  # no stop strings: EOS or the length
    ]
    got = ours.generate_until(_requests("generate_until", args), disable_tqdm=True)
    want = theirs.generate_until(_requests("generate_until", args), disable_tqdm=True)
    assert got == want
    assert "e" not in got[1]


def test_bundled_tasks_are_found_and_a_missing_include_path_is_refused():
    assert set(TASKS) <= set(bundled_tasks()) <= set(task_manager(TASKS).all_tasks)
    with pytest.raises(ConfigError, match="--include-path /no/such: no such folder"):
        task_manager(["shardforge_tiny_mc"], "/no/such")


@pytest.mark.slow
def test_unknown_task_is_refused_with_the_bundled_ones():
    """Refused after looking through lm-eval's own tasks too (seconds: it indexes them all)."""
    with pytest.raises(
        ConfigError, match=r"unknown lm-eval task 'shardforge_tiny_mcq'; bundled: shardforge_tiny_"
    ):
        task_manager(["shardforge_tiny_mcq"])


def test_bundled_tasks_score_as_lm_evals_hf_model(ours, theirs):
    """The acceptance check: the bundled tasks through lm-eval's own evaluator give the same accuracy
    (acc, acc_norm), exact match and perplexities with our model as with lm-eval's `hf` model, item by
    item."""
    got, want = run_tasks(ours, TASKS), run_tasks(theirs, TASKS)
    mine, reference = summary(got), summary(want)
    for metric in ("acc,none", "acc_norm,none"):
        assert mine["shardforge_tiny_mc"][metric] == reference["shardforge_tiny_mc"][metric]
    assert (
        mine["shardforge_tiny_gen"]["exact_match,strip"]
        == reference["shardforge_tiny_gen"]["exact_match,strip"]
    )
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert mine["shardforge_tiny_ppl"][metric] == pytest.approx(
            reference["shardforge_tiny_ppl"][metric], rel=1e-4
        )
    for task in TASKS:
        assert len(got["samples"][task]) == len(want["samples"][task]) == 20
        for a, b in zip(got["samples"][task], want["samples"][task], strict=True):
            assert a["doc_id"] == b["doc_id"]
            if task == "shardforge_tiny_mc":
                for (lp, greedy), (ref_lp, ref_greedy) in zip(
                    [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
                ):
                    assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
                assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
            elif task == "shardforge_tiny_gen":
                assert a["resps"] == b["resps"]


def test_registered_under_shardforge_for_lm_evals_model_names():
    from lm_eval.api.registry import get_model

    assert get_model("shardforge") is ShardforgeLM


def test_a_lora_adapter_scores_as_hflm_with_peft(model_dir, tmp_path):
    """--adapter: the adapter merged into our model scores as transformers + peft score it unmerged."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    pairs = [("Question: What is 2 + 3?\nAnswer:", " 5"), ("Say:", " something else entirely")]
    adapted = ShardforgeLM(pretrained=str(model_dir), adapter=str(tmp_path / "adapter"))
    reference = HFLM(pretrained=str(model_dir), peft=str(tmp_path / "adapter"), device="cpu", dtype="float32")
    plain = ShardforgeLM(pretrained=str(model_dir))
    got, want, before = (
        [lp for lp, _ in lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)]
        for lm in (adapted, reference, plain)
    )
    assert got == pytest.approx(want, abs=1e-4)
    assert got != pytest.approx(before, abs=1e-2)  # the adapter changed the model
