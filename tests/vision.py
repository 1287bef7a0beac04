"""Tiny vision-language checkpoints and images for tests: a random Qwen2-VL saved by transformers itself,
with the bundled tokenizer plus the family's vision tokens and its (PIL) image processor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen2_vl(folder: Path, std: float = 0.3, tie: bool = False) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    cfg = Qwen2VLConfig(
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
        },
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(folder)
    return folder


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
