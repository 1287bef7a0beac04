"""Model families, presets and HF checkpoint I/O."""

import shardforge.models.generic.spec  # registers the generic backend
import shardforge.models.llama.spec
import shardforge.models.llava.spec
import shardforge.models.qwen2_vl.spec  # noqa: F401  (registers Qwen2-VL)
from shardforge.models.io import load_model, save_model
from shardforge.models.presets import build_preset, preset_names
from shardforge.models.spec import ModelSpec, spec_for, supported

__all__ = ["ModelSpec", "build_preset", "load_model", "preset_names", "save_model", "spec_for", "supported"]
