"""Generate the vision-language example's bundle: a tiny Qwen2-VL (vision tower of 2 blocks, decoder of 2
layers, hidden 64; freshly initialized by transformers), the demo tokenizer with Qwen2-VL's vision tokens,
the family's image processor, and a handful of pictures (a shape in one of six colours on a grey
background, of varied sizes) in LLaMA-Factory's multimodal form: ``vlm_demo.json`` (sharegpt `messages` with
`<image>` marks and an `images` list) declared in ``dataset_info.json`` as ``vlm_demo``.
Run: ``python examples/data/make_vlm_demo.py [--out DIR]`` (writes DIR/tiny_vlm/ and DIR/vlm_demo*)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "purple": (140, 50, 170), "orange": (240, 140, 30)}  # fmt: skip
SHAPES = ("square", "circle")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QUESTIONS = ("<image>What colour is the shape?", "Look at this picture: <image> Which colour do you see?")


def picture(r: random.Random, colour: str, shape: str, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    w, h = size
    grey = r.randrange(90, 170)
    image = Image.new("RGB", (w, h), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    box = (w // 5, h // 5, w - w // 5, h - h // 5)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image


def model_folder(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 176,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={"depth": 2, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    out: Path = ap.parse_args().out
    model_folder(out / "tiny_vlm", out / "tokenizer")
    images = out / "vlm_demo_images"
    images.mkdir(parents=True, exist_ok=True)
    r = random.Random(0)
    records = []
    for i in range(48):
        colour, shape = r.choice(list(COLOURS)), r.choice(SHAPES)
        size = (r.choice((56, 84, 112)), r.choice((56, 84)))
        picture(r, colour, shape, size).save(images / f"{i:02d}.png")
        records.append({
            "messages": [{"role": "user", "content": r.choice(QUESTIONS)},
                         {"role": "assistant", "content": f"A {colour} {shape}."}],
            "images": [f"vlm_demo_images/{i:02d}.png"],
        })  # fmt: skip
    (out / "vlm_demo.json").write_text(json.dumps(records, indent=1) + "\n")
    entry = {"file_name": "vlm_demo.json", "formatting": "sharegpt",
             "columns": {"messages": "messages", "images": "images"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                      "assistant_tag": "assistant"}}  # fmt: skip
    (out / "vlm_demo_info.json").write_text(json.dumps({"vlm_demo": entry}, indent=1) + "\n")
    print(f"wrote {out / 'tiny_vlm'}, {len(records)} records in {out / 'vlm_demo.json'}")


if __name__ == "__main__":
    main()
