"""No import circle between modules anywhere in the house: every root package of ``.importlinter``, imports inside
functions and under ``TYPE_CHECKING`` included (grimp, which import-linter uses, counts them all). Circles between
sibling packages are ``.importlinter``'s ``no-circles`` contract (test_layering.py)."""

import configparser
import sys
import textwrap
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def root_packages() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    return cfg["importlinter"]["root_packages"].split()


def circles(packages: list[str], depth: int | None = None) -> list[list[str]]:
    """Each set of modules that import each other in a circle (a strongly connected component of more than one
    module, or a module importing itself), by Tarjan's algorithm without recursion. ``depth``: modules taken as
    their package that many names deep (1: the root packages), for circles between packages."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    name = (lambda m: m) if depth is None else (lambda m: ".".join(m.split(".")[:depth]))
    edges: dict[str, set] = {}
    for m in graph.modules:
        edges.setdefault(name(m), set()).update(name(i) for i in graph.find_modules_directly_imported_by(m))
    if depth is not None:
        for k in edges:
            edges[k].discard(k)  # a package's modules importing each other is no circle between packages
    edges = {k: sorted(v) for k, v in edges.items()}
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            for j in range(i, len(edges[v])):
                w = edges[v][j]
                if w not in index:
                    work += [(v, j + 1), (w, 0)]
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in edges[v]:
                        found.append(sorted(comp))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
    return found


def test_no_module_imports_itself_around_a_circle():
    found = circles(root_packages())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_root_package_imports_another_around_a_circle():
    assert circles(root_packages(), depth=1) == []


def test_the_check_sees_a_circle_through_a_lazy_and_a_type_checking_import(tmp_path, monkeypatch):
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text(textwrap.dedent("""
        def late():
            from .c import C
            return C
    """))
    (pkg / "c.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .a import b
        C = 1
    """))
    (pkg / "d.py").write_text("from . import a\n")  # imports into the circle, not part of it
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "circled", raising=False)
    assert circles(["circled"]) == [["circled.a", "circled.b", "circled.c"]]
    assert circles(["circled"], depth=1) == []  # one package: no circle between packages
