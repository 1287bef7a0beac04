"""Tiny vision-language checkpoints and images for tests: a random Qwen2-VL saved by transformers itself,
with the bundled tokenizer plus the family's vision tokens and its (PIL) image processor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen2_vl(folder: Path, std: float = 0.3, tie: bool = False, kind: str = "qwen2_vl") -> Path:
    """`kind` qwen2_5_vl: Qwen2.5-VL's tower (windowed attention in all blocks but one) instead."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config_cls, model_cls = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    }[kind]
    cfg = config_cls(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        } if kind == "qwen2_vl" else {
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        tie_word_embeddings=tie,
    )  # fmt: skip
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    return _save_random(model_cls, cfg, std, folder, tokenizer, processor)


def tiny_qwen3_vl(folder: Path, std: float = 0.3, tie: bool = False) -> Path:
    """A random Qwen3-VL-shaped model: a Qwen3 decoder (q/k norms) with interleaved M-RoPE, a tower of
    16-pixel patches with a learned 8 x 8 position grid and two deepstack feature maps (added after decoder
    layers 0 and 1), saved with the bundled tokenizer plus the vision tokens and a Qwen2-VL (PIL) image
    processor of 16-pixel patches, as Qwen3-VL's folders carry."""
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    cfg = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 512, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [4, 2, 2],
                                "mrope_interleaved": True},
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1],
        },
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        tie_word_embeddings=tie,
    )  # fmt: skip
    processor = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64)
    return _save_random(Qwen3VLForConditionalGeneration, cfg, std, folder, tokenizer, processor)


def vision_data_config(tmp_path: Path, model_dir: Path, train: list[dict], **data):
    """A small SFT config of `model_dir` on `train` (data entries), `data` overriding its data keys."""
    from shardforge.config import load_config

    return load_config(None, base={
        "model": {"path": str(model_dir)},
        "data": {"train": train, "max_length": 256, "packing": False, "cache_dir": str(tmp_path / "cache"),
                 **data},
        "train": {"steps": 2, "micro_batch": 2, "lr": 1e-3, "warmup": 0, "log_every": 1},
        "log": {"tensorboard": False, "plot": False, "progress": False},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip


def vision_rows(config):
    """The config's training rows, read and encoded as a run reads them (images in the dataset cache)."""
    from shardforge.data.build import build_data
    from shardforge.models.build import model_source
    from shardforge.objectives import build_objective, reading_of

    objective = build_objective(config.method)
    train, _ = build_data(config, model_source(config.model)[1], objective, reading_of(objective), True)
    return train


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def lf_image_dataset(folder: Path, count: int = 4) -> Path:
    """LLaMA-Factory's multimodal demo form (sharegpt `messages` with `<image>` marks, an `images` list of
    paths relative to the data folder, a dataset_info.json entry naming both), images of varied sizes made
    here; returns the dataset_info.json path (entry "mllm_demo")."""
    import json

    (folder / "mllm_demo_data").mkdir(parents=True, exist_ok=True)
    sizes = [(56, 84), (112, 56), (60, 90), (84, 84), (40, 120)]
    records = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        random_image(h, w, seed=i).save(folder / "mllm_demo_data" / f"{i}.png")
        images = [f"mllm_demo_data/{i}.png"]
        first = "<image>What is in this picture?" if i % 2 == 0 else "Look: <image> What colour dominates?"
        messages = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": f"A random picture number {i}, {h} by {w} pixels."},
        ]
        if i == 1:  # a second turn with a second image
            random_image(28, 56, seed=99).save(folder / "mllm_demo_data" / "extra.png")
            images.append("mllm_demo_data/extra.png")
            messages += [
                {"role": "user", "content": "And this one? <image>"},
                {"role": "assistant", "content": "A wide one."},
            ]
        records.append({"messages": messages, "images": images})
    (folder / "mllm_demo.json").write_text(json.dumps(records, indent=1))
    return sharegpt_info(folder, "mllm_demo.json")


def sharegpt_info(folder: Path, file_name: str) -> Path:
    """A dataset_info.json in `folder` whose entry "mllm_demo" reads `file_name` as LF's multimodal
    sharegpt form (`messages` and an `images` column)."""
    import json

    entry = {
        "file_name": file_name, "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                 "assistant_tag": "assistant"},
    }  # fmt: skip
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_demo": entry}, indent=1))
    return folder / "dataset_info.json"


def mixed_image_dataset(folder: Path) -> Path:
    """LF's multimodal demo form as lf_image_dataset writes it (4 records; record 1 has two images of
    different sizes) plus 3 records with no image (an empty `images` list); returns the dataset_info.json
    path (entry "mllm_demo")."""
    import json

    info = lf_image_dataset(folder, count=4)
    records = json.loads((folder / "mllm_demo.json").read_text())
    for i in range(3):
        messages = [
            {"role": "user", "content": f"Plain text question number {i}, no picture at all."},
            {"role": "assistant", "content": "A plain answer" + " indeed" * i + "."},
        ]
        records.append({"messages": messages, "images": []})
    (folder / "mllm_demo.json").write_text(json.dumps(records, indent=1))
    return info


def tiny_llava(folder: Path, std: float = 0.3) -> Path:
    """A random LLaVA-1.5-shaped model (a CLIP tower of 56-pixel images in 14-pixel tiles: 16 image tokens,
    features from its second-to-last layer; a Llama decoder), saved by transformers with the bundled
    tokenizer plus <image> and CLIP's (PIL) image processor."""
    from transformers import AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    cfg = LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        image_seq_length=16,
    )  # fmt: skip
    processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    return _save_random(LlavaForConditionalGeneration, cfg, std, folder, tokenizer, processor)


def tiny_llava_next(folder: Path, std: float = 0.3) -> Path:
    """A random LLaVA-NeXT-shaped model: a CLIP tower of 28-pixel tiles of 14-pixel patches (4 per tile),
    images resized onto one of five grid resolutions up to 3 tiles a side, features from the tower's
    second-to-last layer, a Llama decoder; saved with the bundled tokenizer plus <image> and LLaVA-NeXT's
    (PIL) image processor."""
    from transformers import AutoTokenizer, LlavaNextConfig, LlavaNextForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    pinpoints = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
    cfg = LlavaNextConfig(
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        image_grid_pinpoints=pinpoints, image_seq_length=4,
    )  # fmt: skip
    processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints
    )
    return _save_random(LlavaNextForConditionalGeneration, cfg, std, folder, tokenizer, processor)


GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def tiny_gemma3(folder: Path, std: float = 0.3) -> Path:
    """A random Gemma-3-shaped model: a SigLIP tower of 56-pixel images in 14-pixel patches, pooled 2 x 2
    into 4 image tokens a picture (bidirectional among themselves), a Gemma 3 decoder of two layers (one
    sliding, one global), saved with the bundled tokenizer plus Gemma 3's image tokens and its (PIL)
    image processor."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS)
    cfg = Gemma3Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "sliding_window": 8, "max_position_embeddings": 512,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 56, "patch_size": 14,
                       "vision_use_head": False},  # as Gemma 3 checkpoints: no pooling head
        mm_tokens_per_image=4, boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )  # fmt: skip
    processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    return _save_random(Gemma3ForConditionalGeneration, cfg, std, folder, tokenizer, processor)


def _save_random(model_cls, cfg, std: float, folder: Path, tokenizer, processor) -> Path:
    """transformers' model of `cfg` with weights N(0, std) (large enough that logits are peaked, so greedy
    tokens have no near-ties), saved with its tokenizer and image processor."""
    import torch

    torch.manual_seed(0)
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
