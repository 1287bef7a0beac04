"""The floating-point dtypes a run names, in their two spellings, in one place: precision names ("fp32",
"bf16", "fp16": train.precision, parallel.reduce_dtype) and torch names ("float32", "bfloat16", "float16":
model.dtype, inference's --dtype). Each spelling keeps its own table, so a name in the other spelling is
still refused where it was. A leaf: it imports torch only."""

from __future__ import annotations

import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in (PRECISION_DTYPES | TORCH_DTYPES).items()}
