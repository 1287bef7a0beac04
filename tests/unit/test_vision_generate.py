"""Vision-language models in the inference engine: greedy tokens with images equal transformers' generate
(Qwen2-VL with its M-RoPE positions after the prompt, LLaVA), with the prompt's images split over prefill
chunks and KV blocks, and prompts alike in text but not in images batched together without sharing cached
blocks."""

from __future__ import annotations

import pytest
import torch

from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.sampling import GenerationDefaults, SamplingParams
from tests.unit.test_vision_language import FAMILIES, SAMPLES, encode, reference_inputs, reference_model

NEW = 12


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _expected(folder, ids, kwargs):
    """transformers' greedy tokens and each one's log-probability."""
    reference = reference_model(folder)
    kwargs = reference_inputs(reference, ids, kwargs)
    with torch.no_grad():
        out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kwargs)  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _same(completion, expected) -> None:
    tokens, logprobs = expected
    assert completion.tokens == tokens
    assert [lp for lp, _ in completion.logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("chunk", [512, 7], ids=["whole-prompt", "prompt-in-chunks"])
def test_greedy_tokens_with_images_equal_transformers(folder, chunk):
    from transformers import AutoTokenizer

    from shardforge.models import load_model

    prompts = [encode(folder, sizes, seed=3 * k) for k, sizes in enumerate(SAMPLES)]
    config = EngineConfig(block_size=4, num_blocks=256, max_step_tokens=chunk)
    engine = Engine(load_model(folder), AutoTokenizer.from_pretrained(folder), config, GenerationDefaults())
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    done = engine.generate(
        [ids[0].tolist() for ids, _, _ in prompts], params, images=[im for _, im, _ in prompts]
    )
    for (ids, _, kwargs), completions in zip(prompts, done, strict=True):
        _same(completions[0], _expected(folder, ids, kwargs))


def test_same_text_other_images_never_share_cached_blocks(folder):
    from transformers import AutoTokenizer

    from shardforge.models import load_model

    first, second = encode(folder, SAMPLES[1], seed=0), encode(folder, SAMPLES[1], seed=11)
    assert torch.equal(first[0], second[0])  # the same tokens: only the images differ
    engine = Engine(load_model(folder), AutoTokenizer.from_pretrained(folder),
                    EngineConfig(block_size=4, num_blocks=256), GenerationDefaults())  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompts in ([first], [first, second]):  # the first run fills the prefix cache with the first's blocks
        done = engine.generate([p[0][0].tolist() for p in prompts], params, images=[p[1] for p in prompts])
        for (ids, _, kwargs), completions in zip(prompts, done, strict=True):
            _same(completions[0], _expected(folder, ids, kwargs))
    assert engine.stats().prefix_hits > 0  # the first prompt's blocks were found again, the second's not


def test_images_for_a_text_model_are_a_request_error(tmp_path):
    from transformers import AutoTokenizer

    from shardforge.infer.engine_types import RequestError
    from shardforge.models import load_model
    from tests.conftest import tiny_chat_model

    folder = tiny_chat_model(tmp_path, context=64)
    engine = Engine(load_model(folder), AutoTokenizer.from_pretrained(folder))
    _, images, _ = encode(tiny_qwen2_vl_folder(tmp_path), SAMPLES[1])
    with pytest.raises(RequestError, match="text model"):
        engine.add("r", [1, 2, 3], SamplingParams(max_tokens=2), images)


def tiny_qwen2_vl_folder(tmp_path):
    from tests.vision import tiny_qwen2_vl

    return tiny_qwen2_vl(tmp_path / "vl")


def test_the_generate_command_reads_images_in_both_forms(tmp_path, folder, capsys):
    """`shardforge generate` (the CLI as a user runs it, prepacked CPU layout included) on a prompts file with
    an OpenAI image part (a path from the file's folder) and an LLaMA-Factory `images` list with `<image>`
    marks: each line's greedy tokens equal transformers' generate on the same chat, image and processor."""
    import json

    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.cli import main
    from shardforge.config.schema import ModelSection
    from shardforge.models.build import check_model_source
    from tests.vision import random_image

    random_image(56, 84, seed=5).save(tmp_path / "pic.png")
    part = {"type": "image_url", "image_url": {"url": "pic.png"}}
    lines = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe "}, part]}]},
        {"messages": [{"role": "user", "content": "Describe <image>"}], "images": ["pic.png"]},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(folder), "--prompts", str(prompts), "--out", str(out), "--temperature", "0",
            "--max-tokens", str(NEW)]  # fmt: skip
    assert main(argv) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    picture = Image.open(tmp_path / "pic.png").convert("RGB")
    processed = AutoImageProcessor.from_pretrained(folder)(images=[picture], return_tensors="pt")
    prompt = check_model_source(ModelSection(path=str(folder))).image_prompt(tokenizer)
    if "image_grid_thw" in processed:
        grid, kwargs = processed["image_grid_thw"][0].tolist(), dict(processed)
    elif "image_sizes" in processed:  # LLaVA-NeXT: tiles, and the size its tokens depend on
        grid, kwargs = [0, *processed["image_sizes"][0].tolist()], dict(processed)
    else:
        grid, kwargs = [1, 56, 56], {"pixel_values": processed["pixel_values"]}
    chat = [{"role": "user", "content": "Describe " + prompt.text(tuple(grid))}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    if "image_grid_thw" in kwargs:
        kwargs["mm_token_type_ids"] = (ids == prompt.token_id).int()
    expected, _ = _expected(folder, ids, kwargs)
    eos = tokenizer.eos_token_id
    expected = expected[: expected.index(eos) + 1] if eos in expected else expected
    for result in results:
        assert result["completions"][0]["tokens"] == expected


def test_the_server_takes_image_parts_within_its_rules(tmp_path, folder):
    """POST /v1/chat/completions with image_url parts: a data URL and a path under --image-root give the
    greedy tokens of the same chat through the engine (and the same as each other); a path outside the
    root, a remote URL, a broken data URL and (on a text model) any image are 400s naming the problem."""
    import base64

    from starlette.testclient import TestClient

    from shardforge.infer.load import load_for_inference
    from shardforge.infer.runner import EngineRunner
    from shardforge.infer.server import build_app
    from tests.vision import random_image

    root = tmp_path / "images"
    root.mkdir()
    random_image(56, 84, seed=5).save(root / "pic.png")
    (tmp_path / "secret.png").write_bytes((root / "pic.png").read_bytes())
    data = "data:image/png;base64," + base64.b64encode((root / "pic.png").read_bytes()).decode()
    loaded = load_for_inference(str(folder))
    runner = EngineRunner(Engine(loaded.model, loaded.tokenizer, EngineConfig(block_size=4), loaded.defaults))
    client = TestClient(build_app(loaded, runner, "vlm", image_root=root), raise_server_exceptions=False)

    def ask(url: str):
        content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                "temperature": 0, "logprobs": True}  # fmt: skip
        return client.post("/v1/chat/completions", json=body)

    try:
        first, second = ask(data), ask("pic.png")
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
        assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]
        for url, said in [("../secret.png", "outside the server's --image-root"),
                          ("https://example.com/a.png", "remote image URLs are not fetched"),
                          ("data:image/png;base64,AAAA", "cannot read image")]:  # fmt: skip
            refused = ask(url)
            assert refused.status_code == 400 and said in refused.json()["error"]["message"], refused.text
    finally:
        runner.close()


def test_chat_takes_an_image_path_for_the_next_message(tmp_path, folder, monkeypatch):
    """`shardforge chat`'s loop: `/image PATH` then a message makes the request `generate` makes for the same
    image and text (the same prompt tokens and pixels), and the same reply; a missing path is said, not
    raised."""
    import json

    from shardforge.infer.load import load_for_inference
    from shardforge.infer.offline import chat_loop, generate_file
    from tests.vision import random_image

    monkeypatch.chdir(tmp_path)
    random_image(84, 56, seed=7).save(tmp_path / "pic.png")
    loaded = load_for_inference(str(folder))
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(block_size=4), loaded.defaults)
    requests = []
    add = engine.add
    monkeypatch.setattr(engine, "add", lambda *a: (requests.append((a[1], a[3])), add(*a))[1])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    lines = iter(["/image missing.png", "/image pic.png", "What is this?", "/exit"])
    written: list[str] = []
    chat_loop(engine, params, lambda _prompt: next(lines), written.append, loaded.images)
    said = "".join(written)
    assert "image 'missing.png' not found" in said
    line = {"messages": [{"role": "user", "content": "<image>What is this?"}], "images": ["pic.png"]}
    (tmp_path / "p.jsonl").write_text(json.dumps(line))
    generate_file(engine, tmp_path / "p.jsonl", tmp_path / "out.jsonl", params, reader=loaded.images)
    (chat_ids, chat_images), (file_ids, file_images) = requests
    assert chat_ids == file_ids and chat_images is not None
    assert torch.equal(chat_images.pixel_values, file_images.pixel_values)
    reply = json.loads((tmp_path / "out.jsonl").read_text())["completions"][0]["text"]
    assert said.endswith(reply + "\n")
