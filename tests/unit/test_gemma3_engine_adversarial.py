"""Adversarial checks of Gemma 3 with images in the inference engine (its recompute runner, which keeps
a prompt's image embeddings per cache slot): greedy tokens and log-probs against transformers' generate
under continuous batching, prefix-cache hits, preemption, tiny blocks, n > 1 and a sampled image token; and
a folder that cannot read images still serving text. Its prompt helpers are
test_gemma3_adversarial.py's."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_gemma3_adversarial import NEW, _prompt, _without
from tests.unit.test_vision_language import reference_inputs, reference_model
from tests.vision import tiny_gemma3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def reference(folder):
    return reference_model(folder)


@pytest.fixture(scope="module")
def ours(folder):
    from shardforge.models import load_model

    return load_model(folder).eval()


# ---- the engine (recompute runner) ----------------------------------------------------------------------


def _generate_reference(reference, ids, kwargs, new=NEW, **extra):
    """transformers' greedy tokens and each one's log-probability (of the raw logits)."""
    kwargs = reference_inputs(reference, ids, kwargs) if kwargs else {}
    with torch.no_grad():
        out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kwargs, **extra)  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _engine(folder, ours, **config):
    from transformers import AutoTokenizer

    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.sampling import GenerationDefaults

    return Engine(ours, AutoTokenizer.from_pretrained(folder), EngineConfig(**config), GenerationDefaults())


def _prompts(folder):
    """Prompts with images and without, two alike in tokens but not images, one alike in tokens and
    images (a prefix-cache hit), and a text-only one spelling the same tokens (image tokens as text)."""
    a = _prompt(folder, ["Describe", None, "in a few words, please."], 0)
    b = _prompt(folder, ["Describe", None, "in a few words, please."], 7)  # same tokens, other image
    c = _prompt(folder, [None, "and", None, "which is brighter?"], 3)
    d = _prompt(folder, ["Just some text, no pictures here at all, only words."], 0)
    literal = (a[0], None, {})  # a's tokens, no images: its image tokens are tokens
    return [a, b, c, d, a, literal, c]


@pytest.mark.parametrize(
    "config",
    [
        {"block_size": 4, "num_blocks": 256, "max_step_tokens": 512},
        {"block_size": 4, "num_blocks": 256, "max_step_tokens": 9},  # prompts in chunks
        {"block_size": 4, "num_blocks": 24, "max_step_tokens": 64},  # blocks reused: preemptions
        {"block_size": 2, "num_blocks": 40, "max_step_tokens": 16, "max_running": 3},
        {"block_size": 4, "num_blocks": 24, "max_step_tokens": 64, "prefix_cache": False},
        {"block_size": 8, "num_blocks": 12, "max_step_tokens": 5, "max_running": 2},
    ],
    ids=["roomy", "chunked", "preempting", "tiny-blocks", "no-prefix-cache", "big-blocks-few"],
)
def test_many_concurrent_requests_with_and_without_images_equal_transformers(folder, reference, ours, config):
    from shardforge.infer.sampling import SamplingParams

    prompts = _prompts(folder)
    engine = _engine(folder, ours, **config)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    done = engine.generate([p[0][0].tolist() for p in prompts], params, images=[p[1] for p in prompts])
    for k, ((ids, _, kwargs), completions) in enumerate(zip(prompts, done, strict=True)):
        tokens, logprobs = _generate_reference(reference, ids, kwargs)
        assert completions[0].tokens == tokens, k
        assert [lp for lp, _ in completions[0].logprobs] == pytest.approx(logprobs, abs=1e-4), k
    if config["num_blocks"] == 24:
        assert engine.stats().preemptions > 0
    if config["max_step_tokens"] == 9:  # admitted after the first ones' blocks are cached
        assert engine.stats().prefix_hits > 0  # the repeated prompts (same tokens, same images)
    # the runner never keeps an embedding for a slot that no live sequence or cached block holds an image in
    runner = engine.executor.runner
    assert all(runner.tokens[slot] == ours.config.image_token_id for slot in runner.images)


def test_n_greedy_completions_of_an_image_prompt_each_equal_transformers(folder, reference, ours):
    """n = 3 completions of one image prompt (the children share its cached blocks) beside another image
    request: each is transformers' greedy completion."""
    from shardforge.infer.sampling import SamplingParams

    prompts = _prompts(folder)[:3]
    engine = _engine(folder, ours, block_size=4, num_blocks=64, max_step_tokens=32)
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0, n=3),
              SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0, n=2),
              SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)]  # fmt: skip
    done = engine.generate([p[0][0].tolist() for p in prompts], params, images=[p[1] for p in prompts])
    for (ids, _, kwargs), completions, p in zip(prompts, done, params, strict=True):
        tokens, logprobs = _generate_reference(reference, ids, kwargs)
        assert len(completions) == p.n
        for completion in completions:
            assert completion.tokens == tokens
            assert [lp for lp, _ in completion.logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("bias", [100.0, 12.0])
def test_a_completion_that_samples_the_image_token_equals_transformers(folder, reference, ours, bias):
    """A completion's image token (pushed by logit_bias) is a token, as transformers' decode embeds it (no
    image, no both-ways mask): greedy tokens and raw log-probs equal transformers' generate with the same
    bias (its sequence_bias); a request preempted with such tokens in its output recomputes them the same."""
    from shardforge.infer.sampling import SamplingParams

    image = ours.config.image_token_id
    prompts = _prompts(folder)[:4]
    engine = _engine(folder, ours, block_size=4, num_blocks=26, max_step_tokens=64)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0,
                            logit_bias=((image, bias),))  # fmt: skip
    done = engine.generate([p[0][0].tolist() for p in prompts], params, images=[p[1] for p in prompts])
    sampled = 0
    for (ids, _, kwargs), completions in zip(prompts, done, strict=True):
        tokens, logprobs = _generate_reference(reference, ids, kwargs, sequence_bias={(image,): bias})
        sampled += tokens.count(image)
        assert completions[0].tokens == tokens
        assert [lp for lp, _ in completions[0].logprobs] == pytest.approx(logprobs, abs=1e-4)
    assert sampled > 0


# ---- inference on folders that cannot read images -------------------------------------------------------


@pytest.mark.parametrize("what", ["tokens", "processor"])
def test_text_generation_on_a_folder_that_cannot_read_images(tmp_path, folder, what):
    """A Gemma 3 folder without its image processor (e.g. what `export --merge` writes) or without the image
    tokens in its tokenizer: it still generates from text (as it still trains on text), transformers'
    greedy tokens; only a request with images is refused, by name."""
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.sampling import SamplingParams

    source = _without(folder, tmp_path, what)
    loaded = load_for_inference(str(source))
    assert loaded.images is None
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(block_size=4), loaded.defaults)
    ids = torch.tensor([loaded.tokenizer("Tell me something.", add_special_tokens=False)["input_ids"]])
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    done = engine.generate([ids[0].tolist()], params)
    assert done[0][0].tokens == _generate_reference(reference_model(folder), ids, {})[0]
