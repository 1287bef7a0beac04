"""The element-wise work of a decoder block (RMS norm, rotary embedding, SiLU(gate) * up) behind one object,
so that inference can run it as fused CPU kernels (infer/fused_ops.py) through the same forward. `Elementwise`
is torch's eager ops: autograd, any device and dtype, what training, tensor parallel and compile trace. A
module that runs its element-wise work through `self.ops` declares it by deriving from `UsesElementwise`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, computed in fp32 (as HF's Llama norm)."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """HF's Llama norm, keeping for its backward the input in its own dtype and the fp32 reciprocal rms per
    row: autograd of the same ops would keep an fp32 copy of a low-precision input (and the normalized one),
    where Megatron keeps the input alone. The backward follows those ops' dtypes: the gradient reaching the
    normalized input rounded to the input's dtype, the rest in fp32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        # autograd's own steps for the composite above, in its order (the same bits as before this Function)
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        normed = xf * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).sum(dim=tuple(range(grad.ndim - 1)))
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).float()  # the normalized input's gradient, in its dtype
            grad_rstd = (g * xf).sum(-1, keepdim=True)
            grad_mean = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt's backward
            grad_square = grad_mean.expand_as(xf) / xf.shape[-1]  # mean's
            grad_x = (g * rstd + grad_square * (2 * xf)).to(x.dtype)  # the product's, then pow's
        return grad_x, grad_weight, None


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
