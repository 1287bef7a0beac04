"""Many LoRA adapters on one base (infer/multi_lora.py): requests under different adapters (ranks 2, 4, 8;
q/v only, all linears, MLP + o) and base requests in one engine run give, greedy and token for token, what
each adapter merged into the base gives alone, and what peft's PeftModel computes on transformers; the prefix
cache never shares blocks across adapters; what cannot be served is refused by name."""

from __future__ import annotations

import pytest
import torch

from shardforge.errors import ConfigError, ModelError
from tests.conftest import tiny_chat_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "every": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "use_rslora": True},
    "mlp": {"r": 2, "lora_alpha": 4, "target_modules": ["o_proj", "up_proj", "down_proj"]},
}


def write_adapter(base, folder, seed: int, **settings):
    """A PEFT LoRA folder over `base` with non-zero A and B (so it changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi-lora")
    base = tiny_chat_model(root / "base", 256)
    adapters = {
        name: write_adapter(base, root / name, i + 1, **s) for i, (name, s) in enumerate(SPECS.items())
    }
    return base, adapters


PROMPTS = [[5, 17, 42, 9, 100, 7], [3, 8, 13, 21, 34, 55, 89, 144, 2, 6, 11, 19, 23, 29, 31, 37, 41, 43]]
PARAMS = None


def _params():
    from shardforge.infer.sampling import SamplingParams

    return SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _engine(source, adapter=None, prepack=True, quantize=None):
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.packed import inference_layout

    loaded = load_for_inference(source, adapter, quantize=quantize)
    if prepack:
        inference_layout(loaded.model)
    config = EngineConfig(block_size=4, num_blocks=256, max_step_tokens=64)
    return loaded, Engine(loaded.model, loaded.tokenizer, config, loaded.defaults)


def _multi(folders, prepack=True, quantize=None):
    from shardforge.infer.multi_lora import attach

    base, adapters = folders
    loaded, engine = _engine(base, prepack=prepack, quantize=quantize)
    attach(engine, list(adapters.items()), loaded.folder)
    return engine


def _tokens(results):
    return [r[0].tokens for r in results]


@pytest.mark.parametrize("prepack", [True, False])
def test_mixed_adapters_in_one_batch_equal_each_merged_alone(folders, prepack):
    base, adapters = folders
    engine = _multi(folders, prepack)
    names = [None, *adapters]
    prompts = [p for p in PROMPTS for _ in names]
    which = [n for _ in PROMPTS for n in names]
    mixed = _tokens(engine.generate(prompts, _params(), adapters=which))
    for name in names:
        _, alone = _engine(base, adapters[name] if name else None, prepack)
        expect = _tokens(alone.generate(PROMPTS, _params()))
        got = [t for t, n in zip(mixed, which, strict=True) if n == name]
        assert got == expect, name
    assert len({tuple(t) for t in mixed[: len(names)]}) == len(names)  # every adapter changes the output


def test_an_adapter_equals_peft_on_transformers(folders):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapters = folders
    engine = _multi(folders)
    got = _tokens(engine.generate(PROMPTS, _params(), adapters=["every", "qv"]))
    for prompt, tokens, name in zip(PROMPTS, got, ["every", "qv"], strict=True):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters[name]).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(10):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert ids[0, len(prompt) :].tolist() == tokens, name


def test_prefix_cache_is_keyed_by_adapter(folders):
    engine = _multi(folders)
    prompt = PROMPTS[1]
    first = _tokens(engine.generate([prompt], _params(), adapters=["qv"]))
    hits = engine.stats().prefix_hits
    other = _tokens(engine.generate([prompt], _params(), adapters=["mlp"]))
    assert engine.stats().prefix_hits == hits  # another adapter: none of qv's blocks
    again = _tokens(engine.generate([prompt], _params(), adapters=["qv"]))
    assert engine.stats().prefix_hits > hits and again == first and other != first


def test_int8_base_serves_adapters(folders):
    from shardforge.infer.quantized import Quantization

    engine = _multi(folders, quantize=Quantization("int8"))
    out = _tokens(engine.generate([PROMPTS[0]] * 2, _params(), adapters=[None, "every"]))
    assert out[0] != out[1]


def test_refusals_name_what(folders, tmp_path):
    from shardforge.infer.engine_types import RequestError
    from shardforge.infer.multi_lora import parse_lora_flags

    base, adapters = folders
    engine = _multi(folders)
    with pytest.raises(RequestError) as err:
        engine.add("r", PROMPTS[0], _params(), adapter="nope")
    assert err.value.param == "model"
    dora = write_adapter(
        base, tmp_path / "dora", 9, r=2, lora_alpha=4, target_modules=["q_proj"], use_dora=True
    )
    with pytest.raises(ModelError, match="DoRA"):
        engine.lora.load("dora", dora)
    other = tiny_chat_model(tmp_path / "other", 256, hidden=32)
    wrong = write_adapter(other, tmp_path / "wrong", 3, r=2, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(ModelError, match="do not fit"):
        engine.lora.load("wrong", wrong)
    with pytest.raises(ConfigError, match="loaded already"):
        engine.lora.load("qv", adapters["qv"])
    with pytest.raises(ConfigError, match="NAME=FOLDER"):
        parse_lora_flags(["qv"])


def test_server_lists_chooses_loads_and_unloads_adapters(folders, tmp_path):
    import shutil

    from starlette.testclient import TestClient

    from shardforge.infer.runner import EngineRunner
    from shardforge.infer.server import build_app

    base, adapters = folders
    loaded, engine = _engine(base)
    from shardforge.infer.multi_lora import attach

    attach(engine, [("every", adapters["every"])], loaded.folder)
    root = tmp_path / "adapters"
    shutil.copytree(adapters["qv"], root / "qv")
    runner = EngineRunner(engine)
    try:
        client = TestClient(build_app(loaded, runner, "tiny", lora_root=root), raise_server_exceptions=False)
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [("tiny", None), ("every", "tiny")]

        def complete(model: str):
            body = {"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0}
            return client.post("/v1/completions", json=body)

        base_text, every = complete("tiny").json(), complete("every").json()
        assert every["model"] == "every" and every["choices"][0]["text"] != base_text["choices"][0]["text"]
        missing = complete("qv")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        outside = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["mlp"])}
        )
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "lora_path"
        no_name = client.post("/v1/load_lora_adapter", json={"lora_path": "qv"})
        assert no_name.status_code == 400 and no_name.json()["error"]["param"] == "lora_name"
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": "qv"}).is_success
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": "qv"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        assert complete("qv").is_success
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).is_success
        assert complete("qv").status_code == 404
        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
        shutil.copytree(adapters["qv"], root / "broken")
        (root / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
        broken = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "broken"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "lora_path"
    finally:
        runner.close()


def test_layouts_it_cannot_run_on_are_refused_and_engines_share_a_models_set(folders):
    from shardforge.infer.engine import Engine
    from shardforge.infer.executor import Executor
    from shardforge.infer.multi_lora import attach

    base, adapters = folders
    loaded, engine = _engine(base)
    first = attach(engine, [("qv", adapters["qv"])], loaded.folder)
    second = Engine(loaded.model, loaded.tokenizer, engine.config, loaded.defaults)
    assert attach(second, [("qv", adapters["qv"]), ("mlp", adapters["mlp"])], loaded.folder) is first
    assert sorted(second.lora.names()) == ["mlp", "qv"]
    engine.executor = Executor(object())  # not the one-process LocalRunner: --tp, pipeline, recompute
    with pytest.raises(ConfigError, match="--tp"):
        attach(engine, [], loaded.folder)
