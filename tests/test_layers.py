"""The layout's rules, read from the code: imports flow one way between the layers, and the task,
data and reports layers never import torch (so a bad spec or input fails before torch loads)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "prefixcache"
# What each layer may import (besides itself); the ground (compat, errors, safefile) is open to all.
ALLOWED = {
    "cli": {"serve", "tune", "labelled", "run", "reports", "scoring", "model", "data", "task"},
    "serve": {"scoring", "model", "data", "task"},
    "api": {"tune", "labelled", "run", "reports", "scoring", "model", "data", "task"},
    "tune": {"run", "reports", "scoring", "model", "data", "task"},
    "labelled": {"run", "reports", "scoring", "model", "data", "task"},
    "run": {"reports", "scoring", "model", "data", "task"},
    "reports": {"data", "task"},
    "scoring": {"model", "data", "task"},
    "model": set(),
    "data": {"task"},
    "task": set(),
}
GROUND = {"compat", "errors", "safefile", "__init__"}
NO_TORCH = ("task", "data", "reports")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(the first part under prefixcache, or an outside top-level module, imported at module level?)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    layer = path.relative_to(PACKAGE).parts
    found = []
    for node in ast.walk(tree):
        top = node in tree.body or any(node in getattr(n, "body", []) for n in tree.body if isinstance(n, ast.If)
                                       and "TYPE_CHECKING" not in ast.unparse(n.test))
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(layer[:-1])[: len(layer) - node.level]
            parts = base + (node.module.split(".") if node.module else [])
            if not node.module:
                parts += [alias.name for alias in node.names]
            name = parts[0] if parts else "__init__"
            known = (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()
            found.append((name if known else "__init__", top))
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append(("outside:" + node.module.split(".")[0], top))
        elif isinstance(node, ast.Import):
            found += [("outside:" + alias.name.split(".")[0], top) for alias in node.names]
    return found


def _modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if len(p.relative_to(PACKAGE).parts) == 2]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_down_the_layers(path):
    layer = path.relative_to(PACKAGE).parts[0]
    for target, _ in _imports(path):
        if target.startswith("outside:") or target in GROUND or target == layer:
            continue
        assert target in ALLOWED[layer], f"{path.relative_to(PACKAGE)} imports {target}: {layer} may import only {sorted(ALLOWED[layer])}"


@pytest.mark.parametrize("path", [p for p in _modules() if p.relative_to(PACKAGE).parts[0] in NO_TORCH],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_lower_layers_do_not_import_torch(path):
    assert ("outside:torch", True) not in _imports(path), f"{path.relative_to(PACKAGE)} imports torch at module level"


def test_every_layer_says_what_it_owns_and_may_import():
    for layer in ALLOWED:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "import" in doc, f"prefixcache/{layer}/__init__.py has no docstring saying what it may import"


def test_no_module_is_named_after_the_standard_library():
    import sys

    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    assert not names & set(sys.stdlib_module_names)


def test_a_wrong_way_import_is_caught(tmp_path, monkeypatch):
    """The rule above can fail: a task module importing the engine is refused."""
    layer = tmp_path / "prefixcache" / "task"
    layer.mkdir(parents=True)
    (tmp_path / "prefixcache" / "model").mkdir()
    bad = layer / "bad.py"
    bad.write_text("from ..model.engine import Engine\nimport torch\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "prefixcache")
    with pytest.raises(AssertionError, match="task may import only"):
        test_imports_flow_down_the_layers(bad)
    with pytest.raises(AssertionError, match="imports torch"):
        test_the_lower_layers_do_not_import_torch(bad)


def test_the_command_line_imports_no_torch_until_a_model_is_needed():
    """Everything up to the model load (the CLI, the run's plan, the readers) loads without torch."""
    import subprocess
    import sys

    code = ("import sys, prefixcache.cli, prefixcache.run.job, prefixcache.run.plan, prefixcache.reports.diff; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


# The run layer's public entry points: all the library's face may use of it.
RUN_PUBLIC = {"pipeline": {"classify", "RunStats"}}


def _from_imports(path: Path) -> list[tuple[str, str]]:
    """(module path under prefixcache, name) of every `from ... import name` in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    layer = list(path.relative_to(PACKAGE).parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = layer[: len(layer) - node.level + 1]
            module = ".".join(base + (node.module.split(".") if node.module else []))
            found += [(module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", sorted((PACKAGE / "api").glob("*.py")), ids=lambda p: p.name)
def test_the_face_uses_run_only_through_its_public_entry_points(path):
    for module, name in _from_imports(path):
        if module == "run" or module.startswith("run."):
            sub = module.removeprefix("run.")
            assert name in RUN_PUBLIC.get(sub, set()), (
                f"api/{path.name} imports {name} from {module}: the face may use only {RUN_PUBLIC}")


def test_a_face_reaching_into_run_is_caught(tmp_path, monkeypatch):
    (tmp_path / "prefixcache" / "api").mkdir(parents=True)
    bad = tmp_path / "prefixcache" / "api" / "bad.py"
    bad.write_text("from ..run.job import load_scorer\nfrom ..run.pipeline import classify\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "prefixcache")
    with pytest.raises(AssertionError, match="imports load_scorer from run.job"):
        test_the_face_uses_run_only_through_its_public_entry_points(bad)


def test_scorers_are_built_in_one_place():
    """`scoring/build.py` builds every scorer the program uses (bench's --exact pair apart: it
    measures the pair even where `run` would not make one); pruning is decided there."""
    makers = ("Scorer.load(", "Scorer.on(", "Scorer.start(", ".prune(")
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE)
        if where.parts[0] == "scoring":
            continue
        text = path.read_text(encoding="utf-8")
        for maker in makers:
            if maker in text:
                assert str(where) == "run/bench.py" and maker in (".prune(",), f"{where} calls {maker}: use scoring/build.py"


def test_every_module_is_listed_in_its_folders_docstring():
    for folder in [p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        missing = [p.name for p in folder.glob("*.py") if p.name != "__init__.py" and p.name not in doc]
        assert not missing, f"prefixcache/{folder.name}/__init__.py does not list {missing}"


def _private_uses(path: Path) -> list[str]:
    """`module._name` and `from prefixcache... import _name` in a test file, for names bound to
    prefixcache modules or objects."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefixcache"):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            bound.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("prefixcache"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(ast.unparse(node))
    return found


def test_tests_use_only_public_names_of_the_package():
    """A test that reaches a private name breaks on a rename that changes no behaviour."""
    tests = PACKAGE.parent / "tests"
    offenders = {str(p.relative_to(tests)): _private_uses(p) for p in tests.rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_a_test_reaching_a_private_name_is_caught(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("from prefixcache.model import load\nfrom prefixcache.errors import _x\nload._usable(1)\n")
    assert sorted(_private_uses(bad)) == ["from prefixcache.errors import _x", "load._usable"]


def test_no_function_of_the_package_is_over_50_lines():
    """A function longer than a screen does several things: give each its name."""
    long = [f"{p.relative_to(PACKAGE)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in PACKAGE.rglob("*.py") for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 50]
    assert not long


def engine_reads(root: Path = PACKAGE) -> list[tuple[str, str]]:
    """(module, attribute) of every read of an engine's attribute outside model/, where the
    engine is reached as `engine.X` or `.engine.X`."""
    import re

    found = []
    for path in root.rglob("*.py"):
        where = path.relative_to(root)
        if where.parts[0] == "model":
            continue
        for name in re.findall(r"\bengine\.([A-Za-z_]\w*)", path.read_text(encoding="utf-8")):
            found.append((str(where), name))
    return found


def test_nothing_outside_the_model_asks_an_engine_more_than_its_protocol():
    """The engine protocol (model/protocol.py) is the seam: the scorer, pruning's callers, serve,
    tune, fit and the Python API read only its members of an engine, so another engine can serve;
    `bench` also the members it times with (`TimedEngine`)."""
    from prefixcache.model.protocol import MEMBERS, TIMED

    reads = engine_reads()
    beyond = [r for r in reads if r[1] not in MEMBERS and not (r[0] == "run/bench.py" and r[1] in TIMED)]
    assert reads and not beyond, beyond


ENGINE_NAMES = ("transformers", "llama.cpp")


def engine_name_tests(root: Path = PACKAGE) -> list[str]:
    """Places outside model/ that compare something with an engine's name (a capability asked
    by name), or import torch, or an engine's module: all of that is the model layer's."""
    found = []
    for path in root.rglob("*.py"):
        where = path.relative_to(root)
        if where.parts[0] == "model" or where.parts[0] not in {p.name for p in root.iterdir() if p.is_dir()}:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ENGINE_NAMES for c in [node.left, *node.comparators]):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant) and node.value.value in ENGINE_NAMES:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("torch", "llama_cpp") for a in node.names):
                found.append(f"{where}:{node.lineno} imports {node.names[0].name}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "llama_cpp"):
                found.append(f"{where}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("model.engine", "engine", "model.llamacpp",
                                                                      "llamacpp") and node.level:
                found.append(f"{where}:{node.lineno} imports an engine's module")
    return found


def test_no_engine_name_or_torch_outside_the_model_layer():
    """What an engine can do is asked of the registry (model/engines.py) and the protocol, never of
    its name; torch and the engines' modules are the model layer's alone."""
    assert not engine_name_tests()


def test_the_engine_name_check_finds_a_test_by_name(tmp_path):
    bad = tmp_path / "pkg"
    (bad / "scoring").mkdir(parents=True)
    (bad / "scoring" / "x.py").write_text("import torch\nfrom ..model.engine import Engine\n"
                                          "def f(e):\n    return e.name == 'llama.cpp' or g(backend='transformers')\n")
    found = engine_name_tests(bad)
    assert len(found) == 4 and "imports torch" in found[0] and "'llama.cpp'" in " ".join(found)


def test_the_protocol_check_finds_a_read_beyond_it(tmp_path):
    bad = tmp_path / "pkg"
    (bad / "scoring").mkdir(parents=True)
    (bad / "scoring" / "x.py").write_text("def f(scorer):\n    return scorer.engine.model.config\n")
    assert engine_reads(bad) == [("scoring/x.py", "model")]


def test_every_zip_in_the_tests_says_whether_its_lengths_must_match():
    """A test zipping what it got with what it wants compares nothing past the shorter one: each
    `zip` in the tests passes `strict` (a short list then fails the test instead of passing it)."""
    loose = []
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "zip" \
                    and node.args and not any(k.arg == "strict" for k in node.keywords):
                loose.append(f"{path.name}:{node.lineno}")
    assert not loose, loose


def _module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports anywhere in it (lazy imports
    inside functions, and TYPE_CHECKING ones, included)."""
    mods = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    found = f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target
                    if found in mods and found != name:
                        graph[name].add(found)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in mods and a.name != name}
    return graph


def test_no_two_modules_import_each_other_directly_or_through_others():
    graph = _module_graph()
    circles = []
    for start in graph:  # a module reached again from itself
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module == start:
                circles.append(start)
                break
            if module not in seen:
                seen.add(module)
                todo += graph[module]
    assert not circles, sorted(circles)
