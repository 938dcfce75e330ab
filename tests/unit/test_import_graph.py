"""The package's import direction: the runtime never loads the planner, and no module imports itself back.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` statement, at module
level or inside a function (a lazy import is still an arrow), relative ones resolved. An arrow points at the
module a statement names: ``from a import b`` at ``a.b`` when that is a module, else at ``a``. Importing
``a.b`` also runs ``a/__init__.py``; that implied arrow is not counted (every submodule would otherwise form a
cycle with a package that re-exports it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "leangrpo_mcore"
PLANNER = f"{PACKAGE}.planner"
# Entry points may use the planner; the runtime may reach it only through the package entry: engine.build's
# resolve_plan (plan_for_config, for ``schedule.name: auto``) and engine.throughput's step_throughput
# (step_flops_for_config, the FLOPs behind the per-step throughput metrics).
PLANNER_USERS = (f"{PACKAGE}.cli.plan", f"{PACKAGE}.cli.bench", f"{PACKAGE}.bench")
RUNTIME_ENTRY = f"{PACKAGE}.engine.build"
RUNTIME_ENTRIES = (RUNTIME_ENTRY, f"{PACKAGE}.engine.throughput")
ENGINE = f"{PACKAGE}.engine"
# engine/'s rooms: the step engine sees only itself and the optimizer helpers; checkpointing, run control and the
# run's outputs see only each other and the process helpers (launch). The run loop (trainer) uses them all.
STEP_ROOM = (f"{ENGINE}.step", f"{ENGINE}.optim")
SERVICE_ROOMS = (f"{ENGINE}.checkpoint", f"{ENGINE}.control", f"{ENGINE}.output", f"{ENGINE}.launch")


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module under ``root/leangrpo_mcore``."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _owner(name: str, modules: dict) -> str:
    """The longest prefix of ``name`` that is a module of the package ("" for none)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.AST, base: str, modules: dict) -> set[str]:
    """The package modules one import statement names (``base``: the package a relative import starts from)."""
    if isinstance(node, ast.Import):
        return {_owner(alias.name, modules) for alias in node.names if alias.name.startswith(PACKAGE)}
    if not isinstance(node, ast.ImportFrom):
        return set()
    source = node.module or ""
    if node.level:
        anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
        source = f"{anchor}.{source}" if source else anchor
    if not source.startswith(PACKAGE):
        return set()
    return {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else _owner(source, modules) for a in node.names}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: the package modules it imports}`` over every module of the package."""
    modules = _modules(root)
    graph = {}
    for name, (path, is_package) in modules.items():
        base = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        arrows = set().union(*(_targets(node, base, modules) for node in ast.walk(tree)))
        graph[name] = arrows - {name, ""}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]`` when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def _in_planner(module: str) -> bool:
    return module == PLANNER or module.startswith(PLANNER + ".")


def planner_importers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{module outside the planner: the planner modules it imports}``."""
    return {m: {t for t in targets if _in_planner(t)} for m, targets in graph.items()
            if not _in_planner(m) and any(_in_planner(t) for t in targets)}


def test_graph_reads_relative_and_lazy_imports():
    graph = import_graph()
    # rl/rewards/__init__.py registers its rewards with ``from . import aesthetic, ...``.
    assert f"{PACKAGE}.rl.rewards.aesthetic" in graph[f"{PACKAGE}.rl.rewards"]
    # resolve_plan and step_throughput import the planner inside the function.
    assert all(PLANNER in graph[entry] for entry in RUNTIME_ENTRIES)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_only_entry_points_import_the_planner():
    users = planner_importers(import_graph())
    allowed = {m for m in users if m in PLANNER_USERS or m.startswith(f"{PACKAGE}.bench.")}
    wrong = {m: sorted(t) for m, t in users.items() if m not in allowed and m not in RUNTIME_ENTRIES}
    assert not wrong, f"runtime modules importing the planner: {wrong}"
    # The runtime's one way in is the package entry, not a planner module.
    for entry in RUNTIME_ENTRIES:
        assert users.get(entry, {PLANNER}) == {PLANNER}, users[entry]


def _in(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


def test_engine_rooms_point_from_the_run_loop():
    graph = import_graph()
    # Only the train entry point imports the run loop (the reward bridge, the guards and the error helpers live
    # in rooms of their own, so the bench and the GPU check need nothing from it).
    assert {m for m, targets in graph.items() if f"{ENGINE}.trainer" in targets} == {f"{PACKAGE}.cli.train"}
    wrong = {}
    for module, targets in graph.items():
        inner = {t for t in targets if t.startswith(ENGINE + ".")}
        if _in(module, STEP_ROOM[:1]):
            wrong[module] = {t for t in inner if not _in(t, STEP_ROOM)}
        elif _in(module, SERVICE_ROOMS):
            wrong[module] = {t for t in inner if not _in(t, SERVICE_ROOMS)}
    wrong = {m: sorted(t) for m, t in wrong.items() if t}
    assert not wrong, f"engine rooms importing against the direction: {wrong}"
    assert f"{ENGINE}.checkpoint.save" in graph[f"{ENGINE}.checkpoint"]  # the rooms were found


HEAVY = ("torch._dynamo", "torch._inductor", "wandb")
"""What importing megatron-core would load, but a run's start-up does not need (``mcore_import.py``)."""


def test_runtime_imports_load_no_planner_module():
    runtime = [f"{PACKAGE}.parallel", f"{PACKAGE}.engine.trainer", f"{PACKAGE}.train"]
    code = (f"import importlib, pkgutil, sys, {PACKAGE}.parallel as par\n"
            f"for name in {runtime!r} + [m.name for m in pkgutil.iter_modules(par.__path__, par.__name__ + '.')]:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m == {PLANNER!r} or m.startswith({PLANNER + '.'!r})))\n"
            "print(sorted(m for m in sys.modules if m.startswith('nvidia')))\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
            "import megatron.core.jit as jit, leangrpo_mcore.mcore_import as lean, wandb\n"
            "print(jit.jit_fuser is lean.deferred_compile)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    planner, dali, heavy, deferred = out.stdout.strip().splitlines()
    assert planner == "[]", f"the runtime imported planner modules: {planner}"
    assert dali == "[]", f"a run without conditioning images imported DALI: {dali}"  # data/images.py loads it lazily
    # megatron-core came in without torch's compiler and wandb (mcore_import), and wandb still imports after it
    assert heavy == "[]" and deferred == "True", (heavy, deferred)
