"""Run by LLaMA-Factory's own Python (the reference environment, tests/lf/reference_env.py).

    python lf_reference.py parse cases.json out.json
    python lf_reference.py preprocess ARGS.json TOKENIZER out.json   (in LF's source folder)
    python lf_reference.py lora_targets CASES.json out.json

parse: each case's YAML mapping through LF 0.9.5's argument parser, answered with the resolved value of
every key the converter reads and the learning rate transformers' scheduler gives at each step, as LF's
trainer would build it. cases.json: {"keys": [...], "steps": N, "cases": {name: mapping}}; each answer
{"args": {key: value}, "lr": [...]} or {"error": "<LF's message>"}. Keys the parser cannot take on this
machine are set aside first (deepspeed: the package is not installed; the converter reads the JSON itself)
and `use_cpu` is added (no GPU here).

preprocess: LF's own data pipeline (`get_dataset`) on the data set its arguments name (ARGS.json: stage,
dataset, cutoff_len, template, dataset_dir, ...), answered with each encoded column (input_ids, labels, and
chosen_ / rejected_ / kl_ ones) of its train and eval splits. With "processor": true in ARGS.json (taken out
before LF parses the rest), the records' images go through LF's multimodal plugin with a processor made as
LF's loader would patch one (`patch_processor`): the tokenizer folder's image processor (transformers'
AutoProcessor would also want a video processor, which needs torchvision), LF's tokenizer, and the media
settings of LF's model arguments; the answer then also carries each record's image_grid_thw and pixel_values
as the plugin makes them.

lora_targets: the modules LF's LoRA adapts in vision-language models (CASES.json: {name: {"model": folder,
"args": {lora_target and the freeze_vision_tower / freeze_multi_modal_projector / freeze_language_model
switches}}}): each model built from its folder's config.json as transformers defines it, LF's own target
list (`find_all_linear_modules` for `all`, then `patch_target_modules`), handed to peft as LF's adapter
setup does; answered with the names of the modules peft wrapped, per case."""

import enum
import importlib.machinery
import json
import os
import sys
import types

# LF's data package imports torchaudio (and av, where found) for its multimodal plugin, neither of which
# installs beside this CPU torch: empty stand-ins let it import (its image and text paths use neither). Not
# torchvision: with Pillow installed, transformers takes a module of that name for the real one and imports
# from it; without one, transformers' image processors are its PIL ones
for _name in ("torchaudio", "av"):
    _stub = types.ModuleType(_name)
    _stub.__spec__ = importlib.machinery.ModuleSpec(_name, None)
    sys.modules.setdefault(_name, _stub)

import torch  # noqa: E402
from llamafactory.hparams.parser import _parse_train_args  # noqa: E402
from transformers import get_scheduler  # noqa: E402


def plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def resolve(mapping: dict, keys: list[str], steps: int) -> dict:
    args = {k: v for k, v in mapping.items() if k != "deepspeed"}
    args.setdefault("output_dir", "lf_reference_out")
    args["use_cpu"] = True
    try:
        parsed = _parse_train_args(args)
    except (ValueError, TypeError, SystemExit) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out = {}
    for key in keys:
        for part in parsed:
            if hasattr(part, key):
                out[key] = plain(getattr(part, key))
                break
    training = parsed[2]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=training.learning_rate)
    scheduler = get_scheduler(
        training.lr_scheduler_type, optimizer, num_warmup_steps=training.get_warmup_steps(steps),
        num_training_steps=steps, scheduler_specific_kwargs=training.lr_scheduler_kwargs or {},
    )  # fmt: skip
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return {"args": out, "lr": lrs}


def processor_for(tokenizer_path: str, tokenizer, model_args) -> types.SimpleNamespace:
    """What LF's loader makes of a multimodal model's processor (llamafactory/model/patcher.py
    patch_processor sets each attribute but `image_processor` from LF's tokenizer and model arguments). The
    image processor is transformers' PIL one of the folder's type: AutoImageProcessor wants torchvision."""
    import transformers

    with open(os.path.join(tokenizer_path, "preprocessor_config.json")) as f:
        kind = json.load(f)["image_processor_type"].removesuffix("Fast")
    image_processor = getattr(transformers, f"{kind}Pil").from_pretrained(tokenizer_path)
    keys = ("image_max_pixels", "image_min_pixels", "image_do_pan_and_scan", "crop_to_patches",
            "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
            "audio_sampling_rate")  # fmt: skip
    # LF's Qwen3-VL plugin reads the video processor's merge size even for images only; transformers'
    # video processors need torchvision, so a stand-in carries the image processor's
    video = types.SimpleNamespace(merge_size=getattr(image_processor, "merge_size", 1))
    return types.SimpleNamespace(
        image_processor=image_processor, video_processor=video, tokenizer=tokenizer,
        **{k: getattr(model_args, k) for k in keys},
    )  # fmt: skip


def preprocess(lf_args: dict, tokenizer_path: str) -> dict:
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from transformers import AutoTokenizer

    lf_args = dict(lf_args)
    with_processor = lf_args.pop("processor", False)
    args = {"model_name_or_path": "unused", "output_dir": "lf_reference_out", "use_cpu": True,
            "do_train": True, "overwrite_cache": True, "preprocessing_num_workers": 1, **lf_args}  # fmt: skip
    stage = args["stage"]
    model_args, data_args, training_args, _, _ = _parse_train_args(args)
    data_args.packing = data_args.packing if data_args.packing is not None else stage == "pt"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    processor = processor_for(tokenizer_path, tokenizer, model_args) if with_processor else None
    lf_stage = "rm" if stage == "dpo" else stage  # LF's DPO workflow reads its data as stage rm
    module = get_dataset(
        template, model_args, data_args, training_args, lf_stage, tokenizer=tokenizer, processor=processor
    )
    out = {}
    for split in ("train", "eval"):
        data = module.get(f"{split}_dataset")
        if data is not None:
            out[split] = {c: list(data[c]) for c in data.column_names if c.endswith(("input_ids", "labels"))}
            if processor is not None and "images" in data.column_names:  # each record's, by LF's plugin
                made = [template.mm_plugin._get_mm_inputs(i or [], [], [], processor) for i in data["images"]]
                for key in ("image_grid_thw", "pixel_values"):
                    out[split][key] = [m[key].tolist() if key in m else [] for m in made]
    return out


def lora_targets(lf_args: dict, model_path: str) -> list[str]:
    from llamafactory.model.model_utils.misc import find_all_linear_modules
    from llamafactory.model.model_utils.visual import patch_target_modules
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_path))
    switches = {k: lf_args.get(k, True) for k in
                ("freeze_vision_tower", "freeze_multi_modal_projector")}  # fmt: skip
    finetuning = types.SimpleNamespace(
        **switches, freeze_language_model=lf_args.get("freeze_language_model", False)
    )
    target = lf_args.get("lora_target", "all").split(",")
    targets = find_all_linear_modules(model, finetuning.freeze_vision_tower) if target == ["all"] else target
    targets = patch_target_modules(model, finetuning, targets)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    return sorted(
        n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)
    )


def main() -> None:
    if sys.argv[1] == "lora_targets":
        with open(sys.argv[2]) as f:
            answer = {name: lora_targets(c["args"], c["model"]) for name, c in json.load(f).items()}
    elif sys.argv[1] == "preprocess":
        with open(sys.argv[2]) as f:
            answer = preprocess(json.load(f), sys.argv[3])
    else:
        with open(sys.argv[2]) as f:
            request = json.load(f)
        answer = {name: resolve(m, request["keys"], request["steps"]) for name, m in request["cases"].items()}
    with open(sys.argv[-1], "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main()
