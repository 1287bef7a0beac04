"""A vision-language job on shardforge and on what a transformers user runs, side by side, in one process:

- training: SFT of a random-init Qwen2-VL (a 4-block tower before a 4-layer decoder) on generated pictures
  in LLaMA-Factory's multimodal form, LLaMA-Factory's default freezing (tower and projector frozen) or LoRA on
  the decoder; shardforge's trainer (its defaults: packing with per-document attention, the LM head on targets
  only) against a plain loop over transformers' Qwen2VLForConditionalGeneration (+ peft for LoRA) on the very
  same encoded records (tokens, labels, pixel patches from shardforge's dataset cache), padded batches, AdamW
  with the same hyper-parameters. Throughput is timed after the first optimizer step.
- generation: the same image prompts, greedy, on shardforge's engine (continuous batching, each request's
  images encoded once) and on transformers' `generate` over one left-padded batch; tokens compared.

    python benchmarks/vlm.py [--method full|lora] [--steps 12] [--out benchmarks/results_vlm.json]

Reports images/s and tokens/s per side (real tokens: padding not counted; each record holds one image) and
their ratios. fp32, 2 threads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "data"))

from make_vlm_demo import COLOURS, SHAPES, VISION_TOKENS, picture  # noqa: E402

TEXT = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
}
VISION = {
    "depth": 4,
    "embed_dim": 128,
    "hidden_size": 256,
    "num_heads": 4,
    "mlp_ratio": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def build(folder: Path, records: int) -> tuple[Path, Path]:
    """The model folder and the data (dataset_info.json) of the job."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2VLConfig(
        text_config={**TEXT, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id},
        vision_config=VISION,
        vision_start_token_id=start,
        vision_end_token_id=end,
        image_token_id=image,
        video_token_id=video,
    )
    torch.manual_seed(0)
    model = folder / "model"
    Qwen2VLForConditionalGeneration(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224).save_pretrained(model)
    data = folder / "data"
    (data / "images").mkdir(parents=True)
    r = random.Random(0)
    rows = []
    for i in range(records):
        colour, shape = r.choice(list(COLOURS)), r.choice(SHAPES)
        picture(r, colour, shape, (r.choice((112, 168, 224)), r.choice((112, 168)))).save(
            data / "images" / f"{i}.png"
        )
        words = " ".join(
            r.choice(("bright", "small", "round", "flat", "plain")) for _ in range(r.randint(2, 30))
        )
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>Describe the picture."},
                    {"role": "assistant", "content": f"A {colour} {shape}, {words}."},
                ],
                "images": [f"images/{i}.png"],
            }
        )
    (data / "vlm.json").write_text(json.dumps(rows))
    entry = {
        "file_name": "vlm.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    }
    (data / "dataset_info.json").write_text(json.dumps({"vlm": entry}))
    return model, data / "dataset_info.json"


def config_for(folder: Path, model: Path, info: Path, args: argparse.Namespace):
    from shardforge.config import load_config

    method = {"stage": "sft", "finetuning": args.method} | (
        {"lora": {"rank": 16}} if args.method == "lora" else {}
    )
    return load_config(
        None,
        base={
            "output_dir": str(folder / "run"),
            "model": {"path": str(model)},
            "method": method,
            "data": {
                "train": [{"name": "vlm", "dataset_info": str(info)}],
                "max_length": 1024,
                "cache_dir": str(folder / "cache"),
            },
            "train": {
                "steps": args.steps,
                "micro_batch": args.batch,
                "lr": 1e-4,
                "warmup": 0,
                "log_every": 1,
                "schedule": "constant",
                "clip": 1.0,
            },
            "log": {"tensorboard": False, "plot": False, "progress": False},
            "checkpoint": {"save_final": False},
        },
    )


def shardforge_training(config) -> dict:
    from shardforge.train.trainer import train

    history = train(config).history[1:]  # after the first optimizer step
    seconds = sum(h["step_time_s"] for h in history)
    tokens = sum(h["tokens_per_s"] * h["step_time_s"] for h in history)
    return {"seconds": seconds, "tokens": tokens, "steps": len(history)}


def transformers_training(model_dir: Path, store, args: argparse.Namespace) -> dict:
    """The same records (tokens, labels, patches), args.batch a step, padded to the longest, with the same
    frozen parts (tower and projector) or peft's LoRA on the decoder's linears."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    if args.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = r"model\.language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(".visual." not in f".{name}")
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    pad = model.config.image_token_id
    order = list(range(len(store)))
    random.Random(0).shuffle(order)
    seconds = tokens = 0.0
    for step in range(args.steps):
        rows = [order[(step * args.batch + k) % len(order)] for k in range(args.batch)]
        seqs = [store.arrays(i) for i in rows]
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (tok, trained) in enumerate(seqs):
            t = torch.from_numpy(tok)
            ids[r, : len(t)], mask[r, : len(t)] = t, 1
            labels[r, : len(t)] = torch.where(torch.from_numpy(trained), t, -100)
        images = [store.images(i) for i in rows]
        pixels = torch.from_numpy(np.concatenate([im.pixels for im in images]))
        grids = torch.from_numpy(np.concatenate([im.grids for im in images]))
        started = time.perf_counter()
        out = model(
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=(ids == pad).int(),
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step:  # after the first optimizer step
            seconds += time.perf_counter() - started
            tokens += int(mask.sum())
    return {"seconds": seconds, "tokens": tokens, "steps": args.steps - 1}


def generation(model_dir: Path, info: Path, count: int, new: int) -> dict:
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from shardforge.data.images import ImageReader
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.offline import chat_ids
    from shardforge.infer.sampling import SamplingParams
    from shardforge.models.common.images import ImageInputs

    loaded = load_for_inference(str(model_dir))
    reader: ImageReader = loaded.images
    folder = info.parent
    prompts, images = [], []
    for i in range(count):
        pixels, grids = reader.process([str(folder / "images" / f"{i}.png")], "bench")
        text = reader.filler(grids)("<image>Describe the picture.")
        prompts.append(chat_ids(loaded.tokenizer, [{"role": "user", "content": text}]))
        images.append(ImageInputs(torch.from_numpy(pixels), torch.from_numpy(grids)))
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(), loaded.defaults)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], params, images=images[:1])  # warm-up (kernels built)
    started = time.perf_counter()
    ours = engine.generate(prompts, params, images=images)
    ours_s = time.perf_counter() - started
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    width = max(map(len, prompts))
    ids = torch.full((count, width), tokenizer.pad_token_id)
    mask = torch.zeros(count, width, dtype=torch.long)
    for r, p in enumerate(prompts):  # left-padded
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    pixels = torch.cat([im.pixel_values for im in images])
    grids = torch.cat([im.grid_thw for im in images])
    with torch.no_grad():
        started = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
        theirs_s = time.perf_counter() - started
    same = sum(o[0].tokens == out[r, width:].tolist() for r, o in enumerate(ours))
    return {
        "images": count,
        "new_tokens": count * new,
        "shardforge_s": ours_s,
        "transformers_s": theirs_s,
        "same_tokens": f"{same}/{count}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["full", "lora"], default="full")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--records", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from shardforge.data.build import build_data
    from shardforge.models.build import model_source
    from shardforge.objectives import build_objective, reading_of

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, info = build(folder, args.records)
        config = config_for(folder, model, info, args)
        objective = build_objective(config.method)
        store = build_data(config, model_source(config.model)[1], objective, reading_of(objective), True)[
            0
        ].examples
        ours = shardforge_training(config)
        theirs = transformers_training(model, store, args)
        gen = generation(model, info, args.prompts, args.new_tokens)
    per_image = float(np.mean(store.lengths))  # a record holds one image: images/s = tokens/s / its tokens
    result = {
        "method": args.method,
        "batch": args.batch,
        "threads": args.threads,
        "tokens_per_record": per_image,
    }
    for side, r in (("shardforge", ours), ("transformers", theirs)):
        rate = r["tokens"] / r["seconds"]
        result[f"train_{side}"] = {"images_per_s": rate / per_image, "tokens_per_s": rate}
    result["train_ratio"] = (
        result["train_shardforge"]["tokens_per_s"] / result["train_transformers"]["tokens_per_s"]
    )
    result["generation"] = gen | {
        "shardforge_tokens_per_s": gen["new_tokens"] / gen["shardforge_s"],
        "transformers_tokens_per_s": gen["new_tokens"] / gen["transformers_s"],
        "ratio": gen["transformers_s"] / gen["shardforge_s"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
