"""Optional dependencies. The core install is what a plain fine-tune runs; each face or feature beyond it
comes with an extra of pyproject.toml, imported only where it is used, and its absence is a one-line error
that names the extra to install (never an ImportError traceback)."""

from __future__ import annotations

import importlib
from types import ModuleType

from shardforge.errors import ShardforgeError

# extra -> the modules it provides (pyproject.toml's [project.optional-dependencies] lists the packages)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "webui": ("gradio",),
    "eval": ("lm_eval", "jieba", "nltk", "rouge_chinese"),
    "track": ("mlflow", "wandb"),
    "parquet": ("pyarrow",),
    "optimizers": ("bitsandbytes", "galore_torch", "apollo_torch", "badam", "adam_mini"),
}


class MissingExtra(ShardforgeError):
    """An optional package is not installed: names it and the extra that installs it."""


def install_hint(extra: str) -> str:
    return f"pip install 'shardforge[{extra}]'"


def require(extra: str, what: str, *modules: str) -> list[ModuleType]:
    """Import `modules` (default: every module of `extra`) for `what` (the feature, as a user names it); a
    MissingExtra naming the missing package and the extra when one is not installed."""
    names = modules or EXTRAS[extra]
    assert set(names) <= set(EXTRAS[extra]), f"{names} are not all in the {extra} extra"
    loaded = []
    for name in names:
        try:
            loaded.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != name:
                raise  # the package is there but broken: its own error says more than ours would
            hint = install_hint(extra)
            raise MissingExtra(f"{what} needs {name}, which is not installed: {hint}") from None
    return loaded
