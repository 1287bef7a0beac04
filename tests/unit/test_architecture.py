"""The layering rules, checked on the source: no import cycles (between modules, and between the top-level
packages), the parallel layer knows neither objectives nor data nor the loop, the composition root imports
only builders, no layer outside objectives/ and config/ asks a stage's name, and the loop, the layouts,
inference and the planner never probe an objective or a model for a capability."""

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


# What the composition root (train/setup.py) may import: builders (each component builds itself from its
# config section) and the types it names. A new import is a new builder here, or the root is doing a
# component's work.
COMPOSITION_ROOT_IMPORTS = {
    "build_checkpoints", "CheckpointManager", "Config", "BatchSource", "BatchSplit", "build_data",
    "packing_for", "RowSet", "model_source", "CostModel", "costs_for", "Objective", "SourceContext",
    "build_objective", "reading_of", "ParallelDims", "local_rank_from_env", "pick_device", "rank_from_env",
    "world_size_from_env", "Engine", "parallelize", "PipelinePlan", "resolve_layout", "resolve_with_data",
    "MoEBalancer",
    "build_optimizer", "build_scheduler", "count_steps", "build_policy", "Precision", "bind_objective",
    "TrainingSampler", "build_peak", "build_workspace", "start_processes", "get_logger",
}  # fmt: skip


def test_the_composition_root_imports_only_builders_and_stays_short():
    tree = ast.parse((PACKAGE / "train" / "setup.py").read_text())
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardforge")
        for alias in node.names
    }
    assert imported <= COMPOSITION_ROOT_IMPORTS, imported - COMPOSITION_ROOT_IMPORTS
    (build_run,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_run"]
    assert build_run.end_lineno - build_run.lineno + 1 <= 60


def _python_files(*packages: str) -> list[Path]:
    return [p for package in packages for p in sorted((PACKAGE / package).rglob("*.py"))]


def test_no_stage_name_is_compared_outside_objectives_and_config():
    """Layers ask an objective's traits, never which stage it is: no comparison with a stage name (or with
    `method.stage`) outside objectives/ and config/."""
    from shardforge.config.stages import STAGES

    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ("objectives", "config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                names = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                staged = any(isinstance(n, ast.Constant) and n.value in STAGES for n in names)
                asked = isinstance(side, ast.Attribute) and side.attr == "stage"
                if staged or asked:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_the_stage_check_finds_a_stage_comparison(tmp_path):
    code = "def f(cfg):\n    return cfg.method.stage in ('dpo', 'kto')\n"
    compares = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Compare)]
    assert isinstance(compares[0].left, ast.Attribute) and compares[0].left.attr == "stage"


def test_no_capability_probe_in_the_loop_layout_inference_or_planner():
    """Objectives and models declare what they have (traits, hooks, typed fields): train/, parallel/,
    infer/ and planner/ never ask `getattr(objective | model | a model config, NAME, default)`."""
    probed = ("objective", "model", "shape", "model_config", "critic", "net", "root", "block", "layer")
    found = []
    for path in _python_files("train", "parallel", "infer", "planner"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
            if not probe:  # a getattr without a default reads a name the caller knows is there
                continue
            target = node.args[0]
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if any(word in name for word in probed):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


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


CALLBACKS = ("say", "warn", "print_fn", "log_fn")


def test_no_library_function_takes_a_callback_to_say_things_through():
    """The library logs through shardforge/log.py; a `say`, `warn` or `print` parameter would be a second
    channel that a face has to remember to wire."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    if arg.arg in CALLBACKS:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {arg.arg}")
            if isinstance(node, ast.ClassDef):  # a dataclass field is a constructor parameter too
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) in CALLBACKS:
                        found.append(f"{path.relative_to(PACKAGE)}:{item.lineno} {item.target.id}")
    assert found == []
