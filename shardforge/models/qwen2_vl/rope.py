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
    numbered on its own; None: one sequence per row. Tensor ops throughout (no loop over tokens), on the
    tokens' device: a text token advances the position by one, an image by its larger merged side."""
    b, s = tokens.shape
    device = tokens.device
    is_image = (tokens == image_token).flatten()
    grids = grids.to(device).long()
    t, gh, gw = grids[:, 0], grids[:, 1] // merge, grids[:, 2] // merge
    sizes = t * gh * gw  # each image's tokens
    where = is_image.nonzero().squeeze(1)  # the image tokens' flat indices, row-major
    if len(where) != int(sizes.sum()) or bool((sizes == 0).any()):
        raise ModelError(
            f"the batch's {len(where)} image tokens do not match the images' patch grids ({grids.tolist()}): "
            f"each image needs t*h*w/{merge * merge} tokens in a row"
        )
    image = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)  # each token's image
    first = torch.cumsum(sizes, 0) - sizes
    k = torch.arange(len(where), device=device) - first[image]  # its place in its image
    start = where[first][image]  # the flat index of its image's first token
    if bool((where != start + k).any()) or bool(((start % s) + sizes[image] > s).any()):
        raise ModelError(
            f"the image tokens do not match the images' patch grids ({grids.tolist()}): each image's "
            f"t*h*w/{merge * merge} tokens must be one run within a row"
        )
    # how far each token moves the position on: text 1, an image its larger merged side (at its last token)
    step = torch.ones(b * s, dtype=torch.long, device=device)
    step[where] = 0
    last = where[first + sizes - 1]
    step[last] = torch.maximum(gh, gw)
    starts = torch.zeros(b, s, dtype=torch.bool, device=device) if positions is None else positions == 0
    starts = starts.clone()
    starts[:, 0] = True
    before = (torch.cumsum(step, 0) - step).view(b, s)  # moved on by the tokens before, over the batch
    document = torch.cumsum(starts.flatten().long(), 0) - 1  # each token's document
    pos = before.flatten() - before.flatten()[starts.flatten().nonzero().squeeze(1)][document]
    out = pos.expand(3, -1).clone()
    offsets = torch.stack([k // (gh * gw)[image], (k // gw[image]) % gh[image], k % gw[image]])
    out[:, where] = pos[start] + offsets
    return out.view(3, b, s)


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
