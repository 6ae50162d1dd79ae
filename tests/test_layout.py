"""The layout is the architecture: packages by concern, imports one way, a map that is true.

docs/design.md's table "One owner per concern" names every module of the project and the
project modules it imports; this file reads the code (every import, function-level ones
included, with ``ast``) and checks the table against it, the direction of the imports
between the packages, and the sizes the design keeps.
"""

import ast
import os
import re

from helpers import ROOT

PACKAGES = {"machinery": 1, "pipeline": 2, "reporting": 3, "tasks": 4}  # low imports none above
BUILDING_BLOCKS = {"ops", "layers", "networks", "losses", "dcgan", "ddpm",
                   "pix2pix"}  # top level, below all
SCRIPTS = {"train", "test", "sweep"}  # imported by no module


def modules():
    """Every module of the project: dotted name -> path relative to ROOT."""
    found = {}
    for package in ["", *PACKAGES]:
        folder = os.path.join(ROOT, package)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            if not package:
                found[name[:-3]] = name
            else:
                dotted = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                found[dotted] = f"{package}/{name}"
    return found


MODULES = modules()


def imports(dotted):
    """The project modules that module ``dotted`` imports (anywhere in it)."""
    with open(os.path.join(ROOT, MODULES[dotted]), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # a submodule, or a name of the module
                whole = f"{node.module}.{alias.name}"
                if whole in MODULES or node.module in MODULES:
                    found.add(whole if whole in MODULES else node.module)
    return found - {dotted}


GRAPH = {name: imports(name) for name in MODULES}


def place(dotted):
    return dotted.split(".")[0] if dotted.split(".")[0] in PACKAGES else None


def test_no_import_circle():
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == "open":
                circles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_a_package_imports_nothing_above_it():
    upward = []
    for name, deps in GRAPH.items():
        mine = place(name)
        for dep in deps:
            theirs = place(dep)
            if mine is None:
                if name in BUILDING_BLOCKS and theirs is not None:
                    upward.append((name, dep))  # the styleguide's blocks stand at the bottom
                continue
            if theirs is None and dep not in BUILDING_BLOCKS:
                upward.append((name, dep))  # config, the scripts, export, replay: above all
            elif theirs is not None and PACKAGES[theirs] > PACKAGES[mine]:
                upward.append((name, dep))
    assert upward == []


def test_nothing_imports_the_scripts():
    assert [(n, d) for n, deps in GRAPH.items() for d in deps if d in SCRIPTS] == []


def test_the_top_level_holds_at_most_thirteen_python_files():  # sweep.py the 13th
    top = [name for name in os.listdir(ROOT) if name.endswith(".py")]
    assert len(top) <= 13, sorted(top)


def test_train_py_stays_under_700_lines():
    with open(os.path.join(ROOT, "train.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 700


def test_no_module_is_over_800_lines():
    long = {}
    for path in MODULES.values():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            lines = len(f.read().splitlines())
        if lines > 800:
            long[path] = lines
    assert long == {}


def design_map():
    """docs/design.md's table: path -> the set of project modules it says it imports."""
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## One owner per concern", 1)[1]
    table = next(block for block in section.split("\n\n") if block.startswith("| module"))
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        path = re.fullmatch(r"`([\w/]+\.py)`", cells[0])
        assert path, line
        listed = set() if cells[-1] == "-" else {m.strip() for m in cells[-1].split(",")}
        rows[path[1]] = listed
    return rows


def short(dotted):
    return dotted if dotted in PACKAGES else dotted.split(".")[-1]


def test_the_design_map_names_every_module_and_its_imports():
    rows = design_map()
    assert set(rows) == set(MODULES.values())
    wrong = {}
    for name, path in MODULES.items():
        actual = {short(dep) for dep in GRAPH[name]}
        if rows[path] != actual:
            wrong[path] = (sorted(rows[path]), sorted(actual))
    assert wrong == {}, "docs/design.md (documented, actual): " + repr(wrong)


def test_the_tests_follow_the_codes_layout():
    """tests/ mirrors the packages (tests/<package>/ for each, tests/ for the top level),
    every test file's basename is unique (pytest imports them by basename: there is no
    __init__.py), none is over 800 lines, and the quick half's list names real modules."""
    tests = os.path.join(ROOT, "tests")
    files = {}  # basename -> paths
    for folder, subfolders, names in os.walk(tests):
        subfolders[:] = [d for d in subfolders if d not in ("__pycache__", "fixtures")]
        where = os.path.relpath(folder, tests)
        assert where == "." or where in PACKAGES, f"tests/{where}/ mirrors no package"
        assert "__init__.py" not in names, folder
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                files.setdefault(name[:-3], []).append(os.path.join(folder, name))
    assert {k: v for k, v in files.items() if len(v) > 1} == {}
    for paths in files.values():
        with open(paths[0], encoding="utf-8") as f:
            assert len(f.read().splitlines()) <= 800, paths[0]
    with open(os.path.join(tests, "conftest.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    quick = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "QUICK_MODULES" for t in node.targets))
    assert quick and sorted(quick - set(files)) == []
