"""What the import checks cannot see: a module reading another's private members, two public functions or
classes of one name (a reader cannot tell from a call which is meant), and a loop closed by a kind's factory named
as a string."""

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("parnas",)  # parnas/strategies/ is parnas.strategies: every package sits where its import path says
SCRIPTS = ("benchmarks", "tools")

# Private names of other libraries that have no public equivalent, each with why it is used.
THIRD_PARTY_PRIVATE = {
    "_arch_alpha": "NNI 3.0's mixed layers keep their logits there; NNI's own arch_parameters() returns them as a "
                   "set, whose order changes between processes, and there is no public accessor per layer",
    "_SubParsersAction": "argparse's subparsers action, the type add_subparsers returns, has no public name",
    "_profiler_enabled": "torch's profiler has no public way to ask whether it records; the benchmarks' step phases "
                         "open a range only then (one costs 5 us even when nothing records it)",
}
# A script that reaches into parnas on purpose, with why.
WHITE_BOX = {
    ("benchmarks/train_step.py", "_skipped"): "the benchmark puts back the old path that called identity blocks, "
                                              "to measure what skipping them saves",
    ("benchmarks/train_step.py", "_TargetNLL"): "the benchmark puts back the old path of the loss, to measure what "
                                                "the new one saves",
}
# One interface that several modules implement, called through their module (kinds.get, strategy_registry.get).
SHARED_INTERFACES = {
    "add_commands": "every command module's hook for parnas.cli",
    "get": "the registries' lookup", "names": "the registries' listing", "is_known": "the registries' test",
    "register": "the registries' registration", "unregister": "the registries' removal",
    "unknown_message": "the registries' error line",
}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the checks here (they only read it)."""
    return ast.parse(path.read_text(), str(path))


def modules(packages):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), parsed(path)


def own_names(tree: ast.Module) -> set[str]:
    """Names a module defines itself: its functions, classes, module-level names and attributes set on self/cls."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(path: str, tree: ast.Module) -> list[str]:
    """``obj._name`` (and ``getattr(obj, "_name")``, ``from module import _name``) where obj is not self or cls
    and this module does not define ``_name`` itself."""
    mine, found = own_names(tree), []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name)
                                                    and node.value.id in ("self", "cls")):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PACKAGES:
            found += [f"{path}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if private(a.name) and (path, a.name) not in WHITE_BOX]
        if name is None or not private(name) or name in THIRD_PARTY_PRIVATE or (path, name) in WHITE_BOX:
            continue
        if name not in mine or isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_members():
    found = [line for path, tree in modules(PACKAGES + SCRIPTS) for line in private_reads(path, tree)]
    assert not found, "private members read across modules (make them public, or list why):\n" + "\n".join(found)


def test_the_check_finds_a_private_read_across_modules():
    tree = ast.parse("def f(task):\n    return task._memory, task.memory\n\nclass A:\n    def g(self):\n"
                     "        self._own = 1\n        return self._own, other._own, getattr(task, '_x')\n")
    assert [line.split(": ", 1)[1] for line in private_reads("m.py", tree)] == ["task._memory", "getattr(task, '_x')"]


def test_no_two_public_functions_or_classes_share_a_name():
    where = defaultdict(list)
    for path, tree in modules(PACKAGES):
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where[node.name].append(path)
    shared = {name: paths for name, paths in where.items() if len(paths) > 1 and name not in SHARED_INTERFACES}
    assert not shared, f"one name, several definitions: {shared}"


def source_of(name: str) -> Path | None:
    """The file of module ``name`` in the checkout, None if none."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_imports(name: str) -> set[str]:
    """The ``parnas`` modules that module ``name`` imports when it loads: its top-level imports, not those under
    ``if TYPE_CHECKING`` or inside functions."""
    found = set()
    for node in parsed(source_of(name)).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parnas"):
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("parnas")}
    return {m for m in found if source_of(m) is not None}


def loaded_by(module: str) -> set[str]:
    """Every ``parnas`` module that loading ``module`` loads, itself included."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(module_imports(name))
    return seen


def test_no_string_target_in_parnas_closes_a_loop():
    """A ``"module:attribute"`` string in parnas's code is an arrow import-linter cannot see: the module it names
    must not load, even through others, the module the string is written in. (The built-in search strategies were
    once named so from the registry, which their modules import; they register through an entry point now.)"""
    target = re.compile(r"^(parnas(?:\.\w+)+):\w+(?:\.\w+)*$")
    checked = 0
    for path, tree in modules(PACKAGES):
        rel = Path(path).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        here = ".".join(parts if parts[0] == "parnas" else ("parnas", *parts))
        for node in ast.walk(tree):
            match = isinstance(node, ast.Constant) and isinstance(node.value, str) and target.match(node.value)
            if match and source_of(match[1]) is not None:
                checked += 1
                assert here not in loaded_by(match[1]), f"{here} names {node.value}, which loads {here} back"
    assert checked  # the kinds' factories at least


def test_no_kind_factory_named_by_a_string_imports_the_registry_back():
    """A built-in kind names its factory as ``"module:attribute"`` (the registry imports no torch), an arrow
    import-linter cannot see: the module it names must not load, even through others, what imports the registry
    (``parnas.kinds``, ``parnas.config``), or the string closes a loop."""
    from parnas import kinds

    for name in kinds.names():
        factory = kinds.get(name).factory
        if not isinstance(factory, str):
            continue
        registry = {"parnas.kinds", "parnas.kinds.builtin", "parnas.kinds.registry", "parnas.config"}
        loops = loaded_by(factory.split(":")[0]) & registry
        assert not loops, f"{name}: {factory} loads {sorted(loops)}"
