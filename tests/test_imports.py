"""The import graph of hpcdl/, read from the source (imports at module level and inside functions alike):
no cycle, torch out of reach of what a login node runs, and no import inside a function but an optional
extra's. A module that needs torch is reached from the login node's modules only by name, through the tables
that say so: the CLI's commands (hpcdl.cli), the benchmarks (hpcdl.bench), the backends (hpcdl.distributed.backend)
and the optimizers (hpcdl.names.OPTIMIZER_TABLE). And the package's map (docs/contributing.md, "Layout") matches
the tree, with imports pointing down it and no entries of a folder in a cycle."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, REPO

PACKAGE = REPO / "hpcdl"
# Imported inside the function that uses them, so that hpcdl works without them: the extras of setup.py
# (mpi, plot, ipex, timm) and the decoders bench data compares when it finds them.
OPTIONAL = ("mpi4py", "timm", "safetensors", "sklearn", "matplotlib", "intel_extension_for_pytorch", "simplejpeg", "cv2",
            "torchvision", "torch.utils.tensorboard")
TORCH = ("torch", "torchvision")
# Imports inside a function on purpose, each with its reason: bench plugin's worker measures torch's entry points
# with hpcdl absent until the groups exist, so it imports hpcdl only then.
LATE = {("hpcdl.bench.plugin_worker", "hpcdl.bench.allreduce")}
# What a login node imports: the command line (its parsers, checks, sbatch and the planner).
LOGIN_NODE = ("hpcdl.cli", "hpcdl.cli.train", "hpcdl.cli.jobs", "hpcdl.cli.bench", "hpcdl.cli.plan", "hpcdl.cli.data",
              "hpcdl.cli.system")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, modules: set[str]) -> list[tuple[str, int, str]]:
    """(imported module, line, how) for every import in ``path``, how being "top" (module level), "function"
    or "deferred" (a string naming a module of hpcdl, for :mod:`hpcdl.deferred`); ``from hpcdl.x import y``
    names hpcdl.x.y when that is a module, hpcdl.x otherwise."""
    tree, name = ast.parse(path.read_text()), module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        how = "function" if id(node) in nested else "top"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] in modules:
            found.append((node.value.split(":")[0], node.lineno, "deferred"))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno, how) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full if full in modules else base, node.lineno, how))
    return found


@functools.cache
def graph() -> tuple[dict[str, list[tuple[str, int, str]]], dict[str, Path]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: imports(p, set(files)) for m, p in files.items()}, files


def edges(name: str, table) -> set[str]:
    """What importing ``name`` runs, now or in a function it calls: its imports, and the packages above each
    (their __init__ runs first); not what it names for :mod:`hpcdl.deferred`."""
    out = set()
    for target, _, how in table[name]:
        if how == "deferred":
            continue
        parts = target.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def cycles(table) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over hpcdl's own modules; a module named
    for :mod:`hpcdl.deferred` is an edge like an import."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def targets(v):
        return [t for t, _, _ in table[v] if t in table and t != v]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in targets(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(table):
        if v not in index:
            visit(v)
    return out


def reach(start: str, table) -> dict[str, str]:
    """Every module importing ``start`` runs, with the module that imports it."""
    seen, todo = {start: ""}, [start]
    while todo:
        v = todo.pop()
        for w in edges(v, table) if v in table else ():
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def chain(seen: dict[str, str], end: str) -> str:
    path = [end]
    while seen[path[-1]]:
        path.append(seen[path[-1]])
    return " -> ".join(reversed(path))


def test_no_module_of_hpcdl_is_in_an_import_cycle():
    table, files = graph()
    found = cycles(table)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{files[v].relative_to(REPO)}:{line} imports {t}" for v in c
                                                    for t, line, _ in table[v] if t in c) for c in found]
    assert not found, "\n".join(detail)


@pytest.mark.parametrize("start", LOGIN_NODE)
def test_torch_is_out_of_reach_of_the_login_node(start):
    table, _ = graph()
    seen = reach(start, table)
    hits = [chain(seen, t) for t in TORCH if t in seen]
    assert not hits, "\n".join(hits)


def test_imports_inside_functions_are_optional_extras_only():
    table, files = graph()
    inside = [f"{files[m].relative_to(REPO)}:{line} imports {t}" for m in sorted(table) for t, line, how in table[m]
              if how == "function" and not any(t == o or t.startswith(o + ".") for o in OPTIONAL) and (m, t) not in LATE]
    assert not inside, f"{len(inside)} imports inside functions:\n" + "\n".join(inside)


def test_the_checks_find_what_they_look_for(tmp_path):
    """A planted cycle, a planted torch import and a planted import in a function are each found."""
    table = {"hpcdl.a": [("hpcdl.b", 1, "top")], "hpcdl.b": [("hpcdl.a", 3, "function")], "hpcdl": []}
    assert cycles(table) == [["hpcdl.a", "hpcdl.b"]]
    table["hpcdl.b"] = [("hpcdl.a", 3, "deferred")]
    assert cycles(table) == [["hpcdl.a", "hpcdl.b"]] and "hpcdl.a" not in reach("hpcdl.b", table)
    table["hpcdl.b"] = [("torch.nn", 3, "function")]
    assert cycles(table) == [] and chain(reach("hpcdl.a", table), "torch") == "hpcdl.a -> hpcdl.b -> torch"


def test_the_graph_says_which_modules_import_torch_and_python_agrees():
    """Imported with torch and torchvision blocked, a module fails exactly when its imports at module level reach
    torch: the graph read from the source is the one Python runs."""
    table, _ = graph()
    code = ("import importlib, sys\nsys.modules['torch'] = sys.modules['torchvision'] = None\nfor m in sys.argv[1:]:\n"
            "    try:\n        importlib.import_module(m)\n    except ImportError:\n        print(m)\n")
    modules = sorted(m for m in table if not m.endswith("__main__"))
    failed = set(subprocess.run([PYTHON, "-c", code, *modules], capture_output=True, text=True, check=True,
                                cwd=REPO).stdout.split())
    needs = {m for m in modules if any(t.split(".")[0] in TORCH for t, _, _ in _closure_top(m, table))}
    assert failed == needs, (sorted(failed - needs), sorted(needs - failed))


def _closure_top(start: str, table) -> list:
    """The imports run when ``start`` is imported (module level only, through the modules it imports)."""
    seen, todo, out = {start}, [start], []
    while todo:
        v = todo.pop()
        for t, line, how in table.get(v, ()):
            if how != "top":
                continue
            out.append((t, line, how))
            parts = t.split(".")
            for w in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                if w in table and w not in seen:
                    seen.add(w)
                    todo.append(w)
    return out


# The map of the package: docs/contributing.md's "Layout" table, top to bottom. Its first column names top-level
# entries of hpcdl/; a folder's row names each of its entries in backticks (`name.py`, `name/`, `name.c`).
LAYOUT = REPO / "docs" / "contributing.md"


def layout_map(text: str) -> list[tuple[list[str], list[str]]]:
    """The Layout table's rows, top to bottom: (the row's top-level entries, the entries its folder's row names,
    relative to the folder: ``x.py``, ``x/``, and ``x/y.py`` for an entry of a folder inside it)."""
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) >= 2:
            entries = [e.removeprefix("hpcdl/") for e in re.findall(r"`(hpcdl/[^`]*)`", cells[0])]
            rows.append((entries, re.findall(r"`(?!hpcdl/)((?:\w+/)?[\w.]+(?:\.py|\.c|\.cpp|/))`", cells[1])))
    return rows


def tree_entries(folder: Path) -> set[str]:
    """A folder's modules, native sources and folders of modules (with an __init__.py or not), but __init__.py."""
    return {p.name + "/" if p.is_dir() else p.name for p in folder.iterdir()
            if (p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py"))) or p.suffix in (".py", ".c", ".cpp")} \
        - {"__init__.py"}


def entry(module: str, depth: int = 1) -> str | None:
    """The entry of hpcdl/ (``depth`` 1: "cli/", "names.py", "__init__.py") or of its folder (2: "distributed/group/",
    "distributed/backend.py") that ``module`` belongs to; None outside hpcdl, above ``depth`` (a folder's own
    __init__ at depth 2), or for an entry point inside a folder (``python -m hpcdl.train``, which runs the CLI: above
    everything)."""
    parts = module.split(".")
    if parts[0] != "hpcdl" or (len(parts) > 2 and parts[-1] == "__main__"):
        return None
    if len(parts) == 1:
        return "__init__.py" if depth == 1 else None
    if len(parts) <= depth:
        return None
    path = "/".join(parts[1:depth + 1])
    return path + "/" if (PACKAGE / path).is_dir() else path + ".py"


def arrows(table, files, depth: int = 1) -> dict[tuple[str, str], str]:
    """Imports between entries at ``depth`` (module level and in functions; a module named for :mod:`hpcdl.deferred`
    is a call up by name, not an import), each with one import that makes it."""
    out = {}
    for m in sorted(table):
        for target, line, how in table[m]:
            a, b = entry(m, depth), entry(target, depth)
            if how != "deferred" and a and b and a != b:
                out.setdefault((a, b), f"{files[m].relative_to(REPO)}:{line} imports {target}")
    return out


def upward(rows, found: dict[tuple[str, str], str]) -> list[str]:
    level = {e: i for i, (entries, _) in enumerate(rows) for e in entries}
    return [f"{a} -> {b} points up the map ({why})" for (a, b), why in sorted(found.items())
            if a in level and b in level and level[b] <= level[a]]


def entry_cycles(found: dict[tuple[str, str], str]) -> list[str]:
    """Entries that import each other, around a cycle of any length, with the imports that close it."""
    table = {}
    for a, b in found:
        table.setdefault(a, []).append((b, 0, "top"))
        table.setdefault(b, [])
    return [" -> ".join(c) + ": " + "; ".join(found[a, b] for a in c for b in c if (a, b) in found)
            for c in cycles(table)]


def test_the_layout_map_names_every_entry_of_the_package():
    """docs/contributing.md's map names each top-level entry of hpcdl/ once, each entry of every folder, and each entry
    of a folder inside one where it names any."""
    rows = layout_map(LAYOUT.read_text())
    named, tree = [e for entries, _ in rows for e in entries], tree_entries(PACKAGE) | {"__init__.py"}
    assert sorted(named) == sorted(tree), (f"in the tree, not the map: {sorted(tree - set(named))}; in the map, not "
                                           f"the tree: {sorted(set(named) - tree)}; twice: "
                                           f"{sorted({e for e in named if named.count(e) > 1})}")
    for entries, children in rows:
        for folder in (e for e in entries if e.endswith("/")):
            firsts = {c if "/" not in c[:-1] else c.split("/")[0] + "/" for c in children}
            inner = {c.split("/")[0] + "/" for c in children if "/" in c[:-1]}
            for where, named_here, actual in [(folder, firsts, tree_entries(PACKAGE / folder))] + [
                    (folder + s, {c.removeprefix(s) for c in children if c.startswith(s) and c != s},
                     tree_entries(PACKAGE / folder / s)) for s in sorted(inner)]:
                assert named_here == actual, (f"hpcdl/{where}: in the tree, not the map: {sorted(actual - named_here)};"
                                              f" in the map, not the tree: {sorted(named_here - actual)}")


def test_imports_point_down_the_layout_map_and_no_folder_imports_one_that_imports_it_back():
    """Between the top-level entries, down the map only; inside a folder, no entries in a cycle of imports."""
    table, files = graph()
    problems = upward(layout_map(LAYOUT.read_text()), arrows(table, files))
    problems += entry_cycles(arrows(table, files)) + entry_cycles(arrows(table, files, depth=2))
    assert not problems, "\n".join(problems)


def test_the_layout_checks_find_what_they_look_for():
    """A planted upward import, a planted pair of folders importing each other and a planted cycle of three entries
    inside a folder are each found."""
    text = ("## Layout\n\n| entry | holds |\n| --- | --- |\n| `hpcdl/cli/` | `main.py`, `inner/a.py` |\n"
            "| `hpcdl/names.py` | |\n\n## Next\n")
    rows = layout_map(text)
    assert rows == [(["cli/"], ["main.py", "inner/a.py"]), (["names.py"], [])]
    assert entry("hpcdl.cli.train") == "cli/" and entry("hpcdl.names") == "names.py" and entry("hpcdl") == "__init__.py"
    assert entry("hpcdl.distributed.group.store", 2) == "distributed/group/"
    assert entry("hpcdl.distributed.backend", 2) == "distributed/backend.py" and entry("hpcdl.distributed", 2) is None
    assert entry("hpcdl.train.__main__") is None and entry("torch") is None
    assert upward(rows, {("cli/", "names.py"): "ok"}) == []
    assert upward(rows, {("names.py", "cli/"): "here"}) == ["names.py -> cli/ points up the map (here)"]
    assert entry_cycles({("cli/", "names.py"): "one", ("names.py", "cli/"): "two"}) == ["cli/ -> names.py: one; two"]
    three = {("d/g/", "d/b.py"): "1", ("d/b.py", "d/c/"): "2", ("d/c/", "d/g/"): "3", ("d/c/", "d/x.py"): "4"}
    assert entry_cycles(three) == ["d/b.py -> d/c/ -> d/g/: 2; 3; 1"]


def test_modules_stay_readable_and_distributed_stays_grouped():
    """No module over 400 lines, the trainer (a conductor) under 300, and hpcdl/distributed/ at most 10 entries at
    its top level (the rest in its folders by concern)."""
    sources = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".cpp")]
    long = {f"{p.relative_to(REPO)}: {n}" for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    assert len((PACKAGE / "train" / "trainer.py").read_text().splitlines()) < 300
    top = tree_entries(PACKAGE / "distributed") | {"__init__.py"}
    assert len(top) <= 10, sorted(top)
