"""The layering rules, checked on the source: no import cycles (between modules, and between the top-level
packages), the parallel layer knows neither objectives nor data nor the loop, and the loop stays short."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import torch
from torch import nn

PACKAGE = Path(__file__).resolve().parents[2] / "shardforge"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports() -> dict[str, set[str]]:
    """Module -> the shardforge modules it imports (every import statement, also inside functions)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                module = owner(target) if target.startswith("shardforge") else None
                if module not in (None, name, "shardforge"):
                    found.add(module)
        graph[name] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (iterative reachability; the graph is small)."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {node: reach(node) for node in graph}
    components = {frozenset({n} | {m for m in reachable[n] if n in reachable[m]}) for n in graph}
    return [set(c) for c in components if len(c) > 1]


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_between_modules_or_packages():
    graph = _imports()
    assert _cycles(graph) == []
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(_top(module), set()).update(_top(t) for t in targets if _top(t) != _top(module))
    assert _cycles(packages) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_parallel_knows_neither_objectives_nor_data_nor_the_loop():
    graph = _imports()
    for module, targets in graph.items():
        if module.startswith("shardforge.parallel"):
            above = {_top(t) for t in targets} & {
                "shardforge.objectives",
                "shardforge.data",
                "shardforge.train",
                "shardforge.checkpoint",
            }
            assert not above, (module, above)


def test_the_trainer_keeps_only_the_loop():
    assert len((PACKAGE / "train" / "trainer.py").read_text().splitlines()) <= 250


def test_a_family_spec_chooses_the_block_mlp():
    """A MoE family swaps the MLP of its blocks through its spec, without touching the model code."""
    from shardforge.models.presets import preset_config
    from shardforge.models.spec import spec_for

    class Doubled(nn.Module):
        def __init__(self, cfg, layer: int) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.full((cfg.hidden_size,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    spec = dataclasses.replace(spec_for("llama"), mlp=Doubled)
    model = spec.build(preset_config("tiny-llama", vocab_size=50))
    assert all(isinstance(block.mlp, Doubled) for block in model.blocks())
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 50)
