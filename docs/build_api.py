"""Build the API reference (HTML) from the docstrings with pdoc: ``python docs/build_api.py [--out DIR]``.

Needs the ``docs`` extra (``pip install -e ".[docs]"``). Every module of the package and of its
subpackages gets a page; ``statefulset.integrations.lightning.datamodule`` needs the ``lightning``
extra and is left out, with a note, without it. Docstrings are reStructuredText (``:class:`...```
roles become links). Exits 1 when pdoc warns (a module that does not import, a docstring it cannot
render), so the build that
tests/test_api_docs.py runs fails on them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys
import warnings
from pathlib import Path


def modules() -> list[str]:
    """``statefulset`` and every module below it (pdoc alone walks only the package's ``__all__``)."""
    import statefulset

    found = pkgutil.walk_packages(statefulset.__path__, "statefulset.")
    # The compiled kernels' extension module (setup.py) is a library loaded with ctypes, not API.
    hidden = ("statefulset.__main__", "statefulset.index._kernels")
    names = ["statefulset", *sorted(m.name for m in found if m.name not in hidden)]
    if not any(importlib.util.find_spec(name) for name in ("lightning", "pytorch_lightning")):
        print(
            "build_api: leaving out statefulset.integrations.lightning.datamodule (needs the lightning extra)",
            file=sys.stderr,
        )
        names.remove("statefulset.integrations.lightning.datamodule")
    return names


def _roots(names: list[str]) -> list[str]:
    """The modules pdoc must be handed: it walks a package's submodules itself unless ``__all__`` hides them."""
    walked: set[str] = set()
    roots: list[str] = []
    for name in sorted(names, key=lambda n: n.count(".")):
        parent = name.rpartition(".")[0]
        if parent in walked.union(roots) and not hasattr(importlib.import_module(parent), "__all__"):
            walked.add(name)
        else:
            roots.append(name)
    return roots


def build(out: Path) -> list[str]:
    """Write the HTML into ``out``; return pdoc's warnings (empty when the build is clean)."""
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="restructuredtext", search=True, show_source=True)
    names = modules()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Imported first as a user imports them: pdoc runs imports with subprocesses suppressed, and a
        # dependency's first import may run one (lightning -> tensorboard -> matplotlib builds its font
        # cache with fc-list), which pdoc turns into a warning about pdoc, not about this package.
        for name in names:
            importlib.import_module(name)
        pdoc.pdoc(*_roots(names), output_directory=out)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/api"), help="output folder (default build/api)")
    args = parser.parse_args(argv)
    problems = build(args.out)
    for problem in problems:
        print(f"build_api: {problem}", file=sys.stderr)
    print(f"API reference in {args.out / 'index.html'}" + (f"; {len(problems)} warning(s)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
