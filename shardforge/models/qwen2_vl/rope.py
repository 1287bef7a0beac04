"""Qwen2-VL's multimodal rotary embedding (M-RoPE): each token has a (temporal, height, width) position;
the rotary frequencies are cut into three sections, each turned by one of the three. Text tokens have the
same value in all three (plain RoPE); an image's tokens are laid out on its merged patch grid, after which
text resumes at the largest position the image used plus one. As transformers' Qwen2VLModel.get_rope_index
computes them (checked against it in tests/unit/test_vision_language.py)."""

from __future__ import annotations

import torch

from shardforge.errors import ModelError


def rope_index(
    tokens: torch.Tensor,
    image_token: int,
    grids: torch.Tensor,
    merge: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, b, s] positions of rows whose images' tokens are runs of `image_token`, the images' (t, h, w)
    patch `grids` [images, 3] in order, `merge` x `merge` patches per token. `positions` [b, s]: the rows'
    1-D positions as collate lays them out (packed documents and padding restart at 0), each document
    numbered on its own; None: one sequence per row."""
    b, s = tokens.shape
    out = torch.zeros(3, b, s, dtype=torch.long)
    grid = iter(grids.tolist())
    is_image = (tokens == image_token).cpu()
    starts = torch.zeros(b, s, dtype=torch.bool) if positions is None else (positions == 0).cpu()
    for r in range(b):
        col, pos = 0, 0
        while col < s:
            if not is_image[r, col]:  # a run of text (to a document's start): positions go on one by one
                if starts[r, col]:
                    pos = 0
                end = col + 1
                while end < s and not is_image[r, end] and not starts[r, end]:
                    end += 1
                out[:, r, col:end] = torch.arange(pos, pos + end - col)
                pos += end - col
                col = end
                continue
            if starts[r, col]:
                pos = 0
            t, h, w = next(grid, (0, 0, 0))
            gh, gw = h // merge, w // merge
            n = t * gh * gw
            if n == 0 or col + n > s or not bool(is_image[r, col : col + n].all()):
                raise ModelError(
                    f"row {r}: the image tokens at column {col} do not match the images' patch grids "
                    f"({grids.tolist()}); each image needs t*h*w/{merge * merge} tokens in a row"
                )
            grid_t = torch.arange(t).repeat_interleave(gh * gw)
            grid_h = torch.arange(gh).repeat_interleave(gw).repeat(t)
            grid_w = torch.arange(gw).repeat(t * gh)
            out[:, r, col : col + n] = torch.stack([grid_t, grid_h, grid_w]) + pos
            pos += max(gh, gw)
            col += n
    if next(grid, None) is not None:
        raise ModelError(f"more images ({len(grids)}) than runs of image tokens in the batch")
    return out.to(tokens.device)


def mrope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    sections: tuple[int, ...],
    dtype: torch.dtype,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [b, 1, s, head_dim] for [3, b, s] positions: frequency j turned by the position component
    it is given: Qwen2-VL's sections run one after another (section i takes component i mod 3); Qwen3-VL's
    interleave (h at every third frequency from 1, w from 2, as far as three times their sections, t at
    the rest), as transformers' Qwen3VLTextRotaryEmbedding lays them out."""
    n = inv_freq.shape[0]
    if interleaved:
        component = torch.zeros(n, dtype=torch.long)
        component[1 : 3 * sections[1] : 3] = 1
        component[2 : 3 * sections[2] : 3] = 2
    else:
        component = torch.cat([torch.full((k,), i % 3, dtype=torch.long) for i, k in enumerate(sections)])
    component = component.to(position_ids.device)
    freqs = position_ids[..., None].float() * inv_freq.float()  # [3, b, s, head_dim / 2]
    index = component.expand(1, *freqs.shape[1:])
    freqs = freqs.gather(0, index)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
