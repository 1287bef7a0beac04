"""Run by LLaMA-Factory's own Python (the reference environment, tests/lf/reference_env.py).

    python lf_reference.py parse cases.json out.json
    python lf_reference.py preprocess ARGS.json TOKENIZER out.json   (in LF's source folder)

parse: each case's YAML mapping through LF 0.9.5's argument parser, answered with the resolved value of
every key the converter reads and the learning rate transformers' scheduler gives at each step, as LF's
trainer would build it. cases.json: {"keys": [...], "steps": N, "cases": {name: mapping}}; each answer
{"args": {key: value}, "lr": [...]} or {"error": "<LF's message>"}. Keys the parser cannot take on this
machine are set aside first (deepspeed: the package is not installed; the converter reads the JSON itself)
and `use_cpu` is added (no GPU here).

preprocess: LF's own data pipeline (`get_dataset`) on the data set its arguments name (ARGS.json: stage,
dataset, cutoff_len, template, dataset_dir, ...), answered with each encoded column (input_ids, labels, and
chosen_ / rejected_ / kl_ ones) of its train and eval splits."""

import enum
import importlib.machinery
import json
import sys
import types

# LF's data package imports torchaudio / torchvision / av for its multimodal plugin, none of which installs
# beside this CPU torch: empty stand-ins let it import (the text processors use none of them)
for _name in ("torchaudio", "torchvision", "av"):
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


def preprocess(lf_args: dict, tokenizer_path: str) -> dict:
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from transformers import AutoTokenizer

    args = {"model_name_or_path": "unused", "output_dir": "lf_reference_out", "use_cpu": True,
            "do_train": True, "overwrite_cache": True, "preprocessing_num_workers": 1, **lf_args}  # fmt: skip
    stage = args["stage"]
    model_args, data_args, training_args, _, _ = _parse_train_args(args)
    data_args.packing = data_args.packing if data_args.packing is not None else stage == "pt"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    lf_stage = "rm" if stage == "dpo" else stage  # LF's DPO workflow reads its data as stage rm
    module = get_dataset(template, model_args, data_args, training_args, lf_stage, tokenizer=tokenizer)
    out = {}
    for split in ("train", "eval"):
        data = module.get(f"{split}_dataset")
        if data is not None:
            out[split] = {c: list(data[c]) for c in data.column_names if c.endswith(("input_ids", "labels"))}
    return out


def main() -> None:
    if sys.argv[1] == "preprocess":
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
