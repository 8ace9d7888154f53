"""The package's shape (docs/architecture.md): layers that import one way, commands on top, no import circles, no
project imports hidden in functions to dodge one, no module over the house limit."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from fsdp_opt.config.method import union_flags

PACKAGE = ROOT / "fsdp_opt"
# Bottom to top. A module may import its own layer and those below it, never one above.
LAYERS = ["base", "config", "runtime", "data", "model", "engine", "checkpoint", "tracking", "hub", "planner", "train"]
# the package's root: its entry points; the commands, one module a verb, sit in fsdp_opt/commands
COMMANDS = {"__init__", "__main__", "cli", "commands"}
MAX_LINES = 400
# Project imports inside functions, each with its reason written beside it in the code.
ALLOWED_LATE = {
    ("fsdp_opt.commands.train", "fsdp_opt.train.run"),
    ("fsdp_opt.commands.plan", "fsdp_opt.commands.planning"),
    ("fsdp_opt.engine.benchmarks", "fsdp_opt.engine.lmeval"),  # the optional lm-eval, imported only to score
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def project_imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for each `from fsdp_opt... import` of a file."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("fsdp_opt"):
                names = [f"{child.module}.{a.name}" for a in child.names]
                for name in names:
                    found.append((name, in_function, child.lineno))
            elif isinstance(child, ast.Import):
                found.extend((a.name, in_function, child.lineno) for a in child.names if a.name.startswith("fsdp_opt"))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def resolve(name: str, known: dict[str, Path]) -> str:
    """`fsdp_opt.a.b.NAME` -> the module it comes from (`fsdp_opt.a.b`, or `fsdp_opt.a.b.NAME` if a module)."""
    return name if name in known else name.rsplit(".", 1)[0]


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {resolve(n, known) for n, _, _ in project_imports(p)} - {m} for m, p in known.items()}


def test_layers_import_one_way_and_no_layer_imports_a_command():
    assert set(LAYERS) | COMMANDS >= {layer_of(m) for m in modules()}, "a module outside every layer"
    wrong = []
    for module, targets in graph().items():
        mine = layer_of(module)
        if mine in COMMANDS:
            continue
        for target in targets:
            theirs = layer_of(target)
            if (
                theirs in COMMANDS
                and target != "fsdp_opt"
                or theirs in LAYERS
                and LAYERS.index(theirs) > LAYERS.index(mine)
            ):
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_no_import_circle_between_modules():
    edges = graph()
    state: dict[str, int] = {}
    circles = []

    def walk(m: str, trail: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                circles.append(trail[trail.index(t) :] + [t])
            elif t in edges and t not in state:
                walk(t, trail + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m, [m])
    assert not circles, circles


def test_project_imports_sit_at_the_top_of_modules():
    known = modules()
    late = {(m, resolve(n, known)) for m, p in known.items() for n, inside, _ in project_imports(p) if inside}
    assert late == ALLOWED_LATE


def test_no_module_over_the_house_limit():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a model module importing the trainer is both an upward import and a circle."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "fsdp_opt")
    bad = tmp_path / "fsdp_opt" / "model" / "sources.py"
    bad.write_text(bad.read_text() + "\nfrom fsdp_opt.train.run import setup  # noqa\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "fsdp_opt")
    for check in (test_layers_import_one_way_and_no_layer_imports_a_command, test_no_import_circle_between_modules):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} missed model.sources -> train.run")


# The method registry: the only modules that may ask which method a run trains (config/methods/ names the methods
# and their specs, config/method.py checks their flags; train/methods/ holds their objects). Everywhere else asks a
# method's spec or calls its object.
REGISTRY = ("fsdp_opt/config/methods/", "fsdp_opt/config/method.py", "fsdp_opt/train/methods/")
# isinstance/hasattr on these would ask which method's sequences a module holds
METHOD_SEQUENCES = {"Pairs", "PairPlan", "Prompts", "PromptPlan"}


def method_names() -> set[str]:
    from fsdp_opt.config.methods import METHODS

    return set(METHODS)


# a method's name that is also a flag's (--reward: the reward functions of GRPO and RLOO) is a setting as an attribute
FLAG_NAMES = set(union_flags())


def naming_a_method(path: Path, names: set[str]) -> list[str]:
    """Where a module asks which method it runs: a comparison with a method's name, an attribute named for a method
    (`config.method.dpo`), an isinstance of a method's sequences, or hasattr for a method's part."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    found.append(f"{node.lineno}: compares with a method's name")
        elif isinstance(node, ast.Attribute) and node.attr in names - FLAG_NAMES:
            if not (isinstance(node.value, ast.Name) and node.value.id == "args"):  # a command's own --dpo flag
                found.append(f"{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "hasattr")
        ):
            arg = node.args[1] if len(node.args) > 1 else None
            if isinstance(arg, ast.Name) and arg.id in METHOD_SEQUENCES:
                found.append(f"{node.lineno}: isinstance(..., {arg.id})")
            if node.func.id == "hasattr" and isinstance(arg, ast.Constant) and arg.value in ("digest", "reference"):
                found.append(f"{node.lineno}: hasattr(..., {arg.value!r})")
    return found


def test_no_module_outside_the_method_registry_names_a_method():
    names = method_names()
    bad = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(REGISTRY):
            continue
        found = naming_a_method(path, names)
        if found:
            bad[rel] = found
    assert not bad, f"modules that ask which method they run (use its spec or its object): {bad}"


def test_the_registry_check_finds_each_way_of_naming_a_method(tmp_path):
    code = tmp_path / "m.py"
    code.write_text(
        'if config.method.method == "dpo":\n    pass\n'
        'x = s.method in ("sft", "grpo")\n'
        "y = config.method.dpo\n"
        'z = isinstance(blocks, Pairs) or hasattr(blocks, "digest")\n'
        'ok = args.dpo and ["--method", "dpo"]\n'
    )
    assert sorted(naming_a_method(code, method_names())) == [
        "1: compares with a method's name",
        "3: compares with a method's name",
        "4: .dpo",
        "5: hasattr(..., 'digest')",
        "5: isinstance(..., Pairs)",
    ]


@pytest.mark.quick
def test_ruff_formats_and_lints_the_project_clean():
    """`ruff format` would change nothing and `ruff check` finds nothing (pyproject.toml [tool.ruff]): the project's
    code is in one format, written by the tool, with nothing left for a reviewer to point at."""
    for args in (["format", "--check", "."], ["check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
