"""The package layout shows the data flow, and the rules that keep it so hold (issue 11).

spec → shards → index → streams → transforms → loading → integrations; parallel beside them; tools on top.
A module may import only its own layer and the layers below it, no import cycle exists (imports
inside functions count; ``if TYPE_CHECKING:`` blocks do not), no module grows past 400 lines, no
function grows past 80 lines, and ``import statefulset`` imports no framework.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "statefulset"

# What each layer may import besides itself (errors is everyone's).
ALLOWED = {
    "errors": set(),
    "settings": {"errors"},
    "spec": {"errors", "settings"},
    "shards": {"errors", "settings"},
    "index": {"errors", "settings", "shards"},
    "streams": {"errors", "settings", "spec", "shards", "index"},
    "transforms": {"errors", "settings", "spec", "shards", "index", "streams"},
    "parallel": {"errors", "settings"},
    "loading": {"errors", "settings", "spec", "shards", "index", "streams", "transforms", "parallel"},
    "integrations": {"errors", "settings", "spec", "shards", "index", "streams", "transforms", "parallel", "loading"},
    "tools": {"errors", "settings", "spec", "shards", "index", "streams", "transforms", "parallel", "loading"},
}
MAX_LINES = 400
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    """Every statefulset module ``path`` imports at run time, wherever the import statement is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("statefulset"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.startswith("statefulset"):
                for alias in node.names:  # `from statefulset.x import y` may name the module x.y
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m != module}


FILES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
MODULES = set(FILES)
GRAPH = {m: _imports(p, m) for m, p in FILES.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_sits_in_a_layer():
    stray = [m for m in MODULES if _layer(m) is None and m not in ("statefulset", "statefulset.__main__")]
    assert not stray, f"modules outside the layers: {sorted(stray)}"


def test_low_layers_never_import_high_ones():
    wrong = []
    for module, targets in GRAPH.items():
        layer = _layer(module)
        if layer is None:
            continue  # the package's public surface and __main__ may import anything
        for target in targets:
            other = _layer(target)
            if target == "statefulset" and layer == "tools":
                continue  # the top layer may use the public surface (e.g. __version__)
            if other is None or (other != layer and other not in ALLOWED[layer]):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    # Tarjan's strongly connected components over the run-time import graph.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH.get(node, ()):
            if target not in MODULES:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            connect(module)
    # A package's __init__ re-exporting its own modules is not a cycle of concerns.
    real = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not real, f"import cycles: {real}"


def test_modules_stay_small():
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in FILES.items()}
    long = {m: n for m, n in lines.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def _function_lengths(path: Path, module: str) -> dict[str, int]:
    """The length of every function (methods and nested functions too) in ``path``, by qualified name.

    The rule: a function's length is its body's lines after the docstring, every physical line up to the
    function's last one counted, comments and blank lines included (they are what a reader scrolls through);
    the ``def`` line, its decorators and its docstring are not counted. A nested function's lines count
    both for itself and for the function around it.
    """
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                first = child.body[0]
                has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                has_docstring = has_docstring and isinstance(first.value.value, str)
                start = first.end_lineno + 1 if has_docstring else first.lineno
                lengths[name] = max(0, child.end_lineno - start + 1)
                visit(child, name)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), module)
    return lengths


def test_functions_stay_short():
    lengths = {name: n for m, p in FILES.items() for name, n in _function_lengths(p, m).items()}
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers): {long}"


def test_no_grab_bag_modules():
    bags = [m for m in MODULES if m.rpartition(".")[2] in {"utils", "util", "helpers", "misc", "common"}]
    assert not bags, bags


def test_import_statefulset_imports_no_framework():
    code = (
        "import sys, statefulset\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning', 'megatron', "
        "'nanotron'}))\n"
        "print(statefulset.GPTBatchConfig.__module__, statefulset.build_nanotron_dataloader.__module__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    first, second = run.stdout.splitlines()
    assert first == "[]"
    assert second == "statefulset.integrations.megatron.batch statefulset.integrations.nanotron.dataloader"


def test_the_contract_names_import():
    from statefulset import (  # noqa: F401
        IndexedDataset,
        IndexedDatasetWriter,
        ParallelLayout,
        StatefulsetError,
        WorkerConfig,
        get_loader,
        get_savable_loader,
        get_train_dataset,
        get_val_dataset,
    )


def test_the_docs_show_every_layer():
    for page in ("docs/concepts.md", "README.md"):
        text = (PACKAGE.parent / page).read_text(encoding="utf-8")
        missing = [name for name in ALLOWED if name not in ("errors", "settings") and f"{name}/" not in text]
        assert not missing, f"{page} does not show {missing}"


def test_environment_is_read_in_one_place():
    """Only statefulset.settings reads the environment, and it declares every STATEFULSET_* name used."""
    import re

    from statefulset import settings

    declared = {s.name for s in settings.ALL}
    readers, undeclared = [], set()
    for module, path in FILES.items():
        text = path.read_text(encoding="utf-8")
        undeclared |= set(re.findall(r"STATEFULSET_[A-Z_]+[A-Z]", text)) - declared
        if module != "statefulset.settings" and re.search(r"os\.environ\.get|os\.getenv|environ\[", text):
            readers.append(module)
    assert not undeclared, f"not declared in statefulset/settings.py: {sorted(undeclared)}"
    # obstore_client mirrors botocore's own AWS_ENDPOINT_URL[_S3]; chunk_encoding sets TOKENIZERS_PARALLELISM.
    assert set(readers) <= {"statefulset.shards.obstore_client", "statefulset.tools.chunk_encoding"}, readers


def test_settings_page_is_generated():
    from statefulset import settings

    page = (PACKAGE.parent / "docs" / "settings.md").read_text(encoding="utf-8")
    assert settings.table() in page, "docs/settings.md is stale: run python docs/build_settings.py"


def _private_uses(path: Path, module: str) -> list[str]:
    """Each private name (``_x``, not ``__x__``) ``path`` takes from another statefulset module: by
    ``from statefulset.m import _x`` (relative or multi-line alike) or as ``m._x`` on an imported module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, modules = [], {}  # modules: local name -> the statefulset module it is bound to

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("statefulset") and alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if not base.startswith("statefulset"):
                continue
            for alias in node.names:
                if private(alias.name):
                    found.append(f"{path.name}:{node.lineno} from {base} import {alias.name}")
                elif f"{base}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = ast.unparse(node.value)
            target = modules.get(owner, owner)
            if target in MODULES and target != module:
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr} ({target})")
    return found


def test_no_private_imports():
    """No module takes a private name (``_x``) from another: a name shared across modules is public
    (without the underscore, even when it stays out of ``__all__`` and the docs)."""
    found = {m: uses for m, p in FILES.items() if (uses := _private_uses(p, m))}
    assert not found, f"private names used across modules (drop the underscore where they are defined): {found}"
