"""Images through LLaMA-Factory's own data pipeline (0.9.5, its environment: reference_env.py) and ours: LF's
multimodal demo form (sharegpt messages with `<image>` marks, records of one and of two images of different
sizes) under its qwen2_vl template and a tiny Qwen2-VL whose chat template renders as that template does.
Each record encodes to the same token ids (each mark expanded to the same count of image tokens) and the same
targets (LF's labels), image tokens are never targets, and the images become the same patch grids and
pixels as LF's Qwen2-VL plugin makes of them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.chat_templates import QWEN_TOOLS
from tests.lf.reference_env import reference
from tests.vision import lf_image_dataset, random_image, tiny_qwen2_vl, tiny_qwen3_vl

pytestmark = pytest.mark.slow
# Qwen2-VL's own chat template, for string contents: Qwen 2.5's with "You are a helpful assistant." as the
# default system message, what LF's qwen2_vl template renders
QWEN2_VL = QWEN_TOOLS.replace(
    "'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.'", "'You are a helpful assistant.'"
)
assert QWEN2_VL != QWEN_TOOLS


def _odd_images(folder) -> None:
    """Two more records for LF's demo form lf_image_dataset wrote: a side under Qwen2-VL's 28 pixels and an
    aspect ratio over its 200, both of which LF's plugin resizes before the image processor."""
    records = json.loads((folder / "mllm_demo.json").read_text())
    for name, (height, width) in {"narrow": (20, 300), "strip": (28, 6000)}.items():
        random_image(height, width, seed=height).save(folder / "mllm_demo_data" / f"{name}.png")
        records.append({"messages": [
            {"role": "user", "content": f"<image>How wide is the {name} one?"},
            {"role": "assistant", "content": f"{width} pixels."},
        ], "images": [f"mllm_demo_data/{name}.png"]})  # fmt: skip
    (folder / "mllm_demo.json").write_text(json.dumps(records, indent=1))


CASES = {  # LF's arguments beyond the data set and template, and our data section's
    "replies": ({}, {}),
    "train_on_prompt": ({"train_on_prompt": True}, {"train_on_prompt": True}),
    "pixel_limits": (  # images resized down to the maximum, and up to the minimum, before the processor
        {"image_max_pixels": 4000, "image_min_pixels": 2500},
        {"image_max_pixels": 4000, "image_min_pixels": 2500},
    ),
}


# Qwen3-VL's instruct template without thinking and with no default system message, what LF's
# qwen3_vl_nothink template renders
QWEN3_VL = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
FAMILIES = {  # our tiny model, its chat template, and LF's template of the family
    "qwen2_vl": (tiny_qwen2_vl, QWEN2_VL, "qwen2_vl"),
    "qwen3_vl": (tiny_qwen3_vl, QWEN3_VL, "qwen3_vl_nothink"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_lf_s_multimodal_data_encodes_as_lf_encodes_it(tmp_path, case, family):
    from shardforge.config import load_config
    from shardforge.data.build import build_data
    from shardforge.models.build import model_source
    from shardforge.objectives import build_objective, reading_of

    ref = reference()
    make, chat_template, lf_template = FAMILIES[family]
    model = make(tmp_path / "model")
    (model / "chat_template.jinja").write_text(chat_template.strip() + "\n")
    folder = tmp_path / "data"
    info = lf_image_dataset(folder, count=5)
    _odd_images(folder)
    lf_extra, our_extra = CASES[case]
    lf_args = {"stage": "sft", "dataset": "mllm_demo", "dataset_dir": str(folder), "template": lf_template,
               "cutoff_len": 1024, "processor": True, **lf_extra}  # fmt: skip
    theirs = ref.preprocess(lf_args, model, tmp_path)["train"]
    config = load_config(None, base={
        "model": {"path": str(model)},
        "data": {"train": [{"name": "mllm_demo", "dataset_info": str(info)}], "template": "auto",
                 "max_length": 1024, "truncation": "lf", "packing": False, "cache": False, "workers": 1,
                 **our_extra},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    objective = build_objective(config.method)
    rows, _ = build_data(config, model_source(config.model)[1], objective, reading_of(objective), True)
    store = rows.examples
    records = json.loads((folder / "mllm_demo.json").read_text())
    assert len(store) == len(theirs["input_ids"]) == len(records)
    assert sorted(len(r["images"]) for r in records) == [1, 1, 1, 1, 1, 1, 2]
    pad = json.loads((model / "config.json").read_text())["image_token_id"]
    for i in range(len(store)):
        ids, trained = store.arrays(i)
        labels = [int(t) if f else -100 for t, f in zip(ids, trained, strict=True)]
        assert ids.tolist() == theirs["input_ids"][i], i
        lf_labels = theirs["labels"][i]
        # train_on_prompt: LF's labels are the prompt's ids, its image tokens too; ours never are targets
        if case == "train_on_prompt":
            assert pad in lf_labels, i
            lf_labels = [-100 if t == pad else t for t in lf_labels]
        else:
            assert pad not in lf_labels, i
        assert labels == lf_labels, i
        assert not trained[ids == pad].any() and trained.any(), i
        images = store.images(i)
        assert images.grids.tolist() == theirs["image_grid_thw"][i], i
        assert int((ids == pad).sum()) == int(images.grids.prod(-1).sum()) // 4, i
        np.testing.assert_array_equal(images.pixels, np.asarray(theirs["pixel_values"][i], np.float32))


LORA_CASES = {  # LF's switches and lora_target, as `shardforge convert` maps them to method.*
    "decoder": {},
    "tower_all": {"freeze_vision_tower": False},
    "tower_named": {"freeze_vision_tower": False, "lora_target": "q_proj,v_proj"},
    "language_frozen": {"freeze_vision_tower": False, "freeze_language_model": True},
}


def test_lora_adapts_the_modules_lf_s_lora_adapts(tmp_path):
    """LoRA on a vision-language model (Qwen2-VL, Qwen3-VL, LLaVA, LLaVA-NeXT) under each of LF's switches:
    the modules we adapt (as peft names them) are those LF's own target rules hand to peft (its
    find_all_linear_modules / patch_target_modules), but for LLaVA's tower layers after its feature layer,
    which reach no output (LF adapts them, their adapters never train; we leave them out). Where LF would
    adapt no module of an unfrozen tower (Qwen2-VL's tower has no q_proj), ours is an error saying so rather
    than a tower that silently stays frozen. LF's freeze_language_model leaves the decoder unadapted; ours
    adapts it and freezes its adapters (the same run: their B stays 0)."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.adapters.lora import LoRALinear
    from shardforge.adapters.peft_format import peft_keys
    from shardforge.config import lf_convert, load_config
    from shardforge.errors import ConfigError
    from shardforge.models import load_model
    from tests.vision import tiny_llava, tiny_llava_next, tiny_qwen3_vl

    makers = {"qwen2_vl": tiny_qwen2_vl, "qwen3_vl": tiny_qwen3_vl, "llava": tiny_llava,
              "llava_next": tiny_llava_next}  # fmt: skip
    models = {family: make(tmp_path / family) for family, make in makers.items()}
    cases = {(family, case): {"model": str(models[family]), "args": {"finetuning_type": "lora", **switches}}
             for family in models for case, switches in LORA_CASES.items()}  # fmt: skip
    answers = reference().lora_targets({f"{f}/{c}": v for (f, c), v in cases.items()}, tmp_path)
    unused = "vision_tower.encoder.layers.1."  # the tiny LLaVAs' towers have 2 layers, their feature layer -2
    for (family, case), request in cases.items():
        lf_args, switches = request["args"], LORA_CASES[case]
        theirs = {n.replace(".vision_model.", ".") for n in answers[f"{family}/{case}"]}
        theirs = {n for n in theirs if unused not in n}
        converted = lf_convert.convert_lf({"model_name_or_path": request["model"], "stage": "sft",
                                           "dataset": "mllm_demo", **lf_args})  # fmt: skip
        assert not converted.unsupported, converted.unsupported
        config = load_config(None, base={**converted.config, "output_dir": str(tmp_path / "run")})
        ours_model = load_model(models[family])
        tower_adapted = any(".visual." in n or ".vision_tower." in n for n in theirs)
        if not switches.get("freeze_vision_tower", True) and not tower_adapted:
            with pytest.raises(ConfigError, match="no linear of the vision tower is a target"):
                apply_finetuning(ours_model, config.method, 0)
            continue
        apply_finetuning(ours_model, config.method, 0)
        adapters = [f"{n}.lora_A" for n, m in ours_model.named_modules() if isinstance(m, LoRALinear)]
        ours = {
            k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            for k in peft_keys(ours_model.config.family, adapters).values()
        }
        ours = {n.replace(".vision_model.", ".") for n in ours}
        if switches.get("freeze_language_model"):
            ours = {n for n in ours if ".language_model." not in n}
        assert ours == theirs, (family, case, sorted(ours ^ theirs))
