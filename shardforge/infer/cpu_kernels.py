"""The CPU kernels of inference (cpu_kernels.cpp): decode attention (decode_attention.cpp: every decoding
sequence of a step attends over its slice of the paged pool in one call per layer, instead of one SDPA call
per sequence; measured on this CPU, SmolLM2-135M's heads, 64 decodes of 150-350 keys, one layer: 1.4 ms
against 3.0-3.3 ms for the loop of SDPA calls, which took 30% of a 64-request chat burst) and a block's
fused element-wise ops (elementwise.cpp, used through infer/fused_ops.py). Built on first use with torch's
C++ extension loader, for the machine it runs on (about 40 s, once: the build is cached under torch's
extensions folder); where it cannot be built (no compiler), inference keeps torch's ops and says so once."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [HERE / f"{name}.cpp" for name in ("cpu_kernels", "decode_attention", "elementwise")]
HEADER = HERE / "cpu_math.h"


@functools.cache
def cpu_kernels() -> Any:
    """The compiled module (`decode_attention`, `rms_norm`, `rope`, `silu_mul`: cpu_kernels.cpp), or None."""
    from torch.utils.cpp_extension import load

    began = time.perf_counter()
    path = os.environ.get("PATH", "")
    try:
        # always the `ninja` wheel's binary (a dependency), whatever PATH holds: another ninja version (the
        # system's) rewrites the build log and makes the next caller rebuild everything (~30 s)
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{path}"
        # built with -march=native: one build per instruction set, should the cache be shared by machines;
        # torch's loader rebuilds when a source changes, the digest when the header does
        capability = torch.backends.cpu.get_cpu_capability().lower()
        digest = hashlib.sha1(HEADER.read_bytes()).hexdigest()[:8]
        module = load(
            f"shardforge_cpu_kernels_{capability}_{digest}",
            [str(source) for source in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            verbose=False,
        )
    except Exception as exc:  # no compiler or headers: torch's ops serve (one SDPA call per sequence)
        log.warning("the CPU inference kernels could not be built (%s); using torch's ops", exc)
        return None
    finally:
        os.environ["PATH"] = path
    took = time.perf_counter() - began
    if took > 2:
        log.info("built the CPU inference kernels in %.0f s (once per machine)", took)
    return module
