"""The element-wise work of a decoder block (RMS norm, rotary embedding, SiLU(gate) * up) behind one object,
so that inference can run it as fused CPU kernels (infer/fused_ops.py) through the same forward. `Elementwise`
is torch's eager ops: autograd, any device and dtype, what training, tensor parallel and compile trace. A
module that runs its element-wise work through `self.ops` declares it by deriving from `UsesElementwise`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, computed in fp32 (as HF's Llama norm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's rotary layout: the two halves of head_dim are the pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Elementwise:
    """Torch's eager ops; a subclass may run some calls its own way and hand the rest to these."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, heads, s, d] and k [b, kv_heads, s, d] rotated by cos and sin [b, 1, s, d]."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


EAGER = Elementwise()


class UsesElementwise:
    """A module whose forward runs its element-wise work through `ops` (torch's eager ops unless inference
    set its own on the instance)."""

    ops: Elementwise = EAGER
