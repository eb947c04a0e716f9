"""The package's layout: its import graph follows the data flow (no module imports from a later stage, anywhere in its
body, lazy imports included; a stage may import from itself and from any earlier one), docs/code_layout.md names
exactly the modules of the tree, and every page of docs/ is linked from the README, and every link resolves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "kimi_k2_neuron"
# Earliest first: the config and the formats' math, the converted format, reading checkpoints, the model, the
# converter, running it, the built-in tiny checkpoints (make-tiny, demo), the Neuron shell (what runs on trn2, its fit
# planner beside the rules it applies), its CPU verification harness, the commands; last the test fixtures no
# command imports.
STAGES = (
    ("errors", "cache", "interrupts", "progress", "config", "placement"),
    ("quant",),
    ("formats",),
    ("checkpoint",),
    ("model", "parallel", "weights"),
    ("convert",),
    ("runtime",),
    ("tiny",),
    ("neuron",),
    ("nxdi_cpu",),
    ("arguments", "launch", "plan_command", "cli"),
    ("testing",),
)
STAGE = {top: i for i, tops in enumerate(STAGES) for top in tops}


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(path: Path) -> set[str]:
    """The first component under kimi_k2_neuron of everything `path` imports."""
    here, is_package = _module(path), path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if node.level == 0 else \
                (here if is_package else here[:-1])[: len(here) - node.level + is_package] + \
                ((node.module or "").split(".") if node.module else [])
            names = [base + [alias.name] for alias in node.names] if len(base) == 1 else [base]
        else:
            continue
        found |= {n[1] for n in names if n[0] == "kimi_k2_neuron" and len(n) > 1}
    return found


def test_every_module_belongs_to_a_stage():
    tops = {_module(p)[1] for p in PACKAGE.rglob("*.py") if len(_module(p)) > 1}
    assert tops - set(STAGE) == set()


def test_no_module_imports_from_a_later_stage():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        if len(module) == 1:  # kimi_k2_neuron/__init__.py: the version only
            assert _imported(path) == set()
            continue
        own = STAGE[module[1]]
        upward += [f"{'.'.join(module)} -> {top}" for top in _imported(path) if STAGE.get(top, -1) > own]
    assert upward == []


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules (dotted) `path` imports, anywhere in its body: a name imported from a package is its
    module where one of that name exists."""
    here, is_package = _module(path), path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or "" if node.level == 0 else ".".join(
                (here if is_package else here[:-1])[: len(here) - node.level + is_package]
                + ([node.module] if node.module else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {m for m in found if m in modules and m != ".".join(here)}


def test_no_import_cycle_anywhere():
    """Not between stages (above), nor inside one: module by module, lazy imports included, a package's __init__
    counted as importing nothing it merely re-exports lazily."""
    paths = {".".join(_module(p)): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _imported_modules(p, set(paths)) for m, p in paths.items()}
    cycles, state = [], {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(trail[trail.index(n):] + [n]))
            elif n not in state:
                visit(n, trail + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def _substantial(path: Path) -> bool:
    """A module docs/code_layout.md must name: any but a package __init__ that only documents or re-exports (it
    may)."""
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text()).body
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) or (isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id != "__all__" for t in n.targets)) for n in body)


def test_the_code_layout_page_names_every_module_of_the_tree():
    block = (REPO / "docs/code_layout.md").read_text().split("```")[1]
    listed = re.findall(r"^  (\S+\.(?:py|md|c)) ", block, re.MULTILINE)
    files = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".md", ".c") and "__pycache__" not in p.parts]
    every = {str(p.relative_to(PACKAGE)) for p in files}
    must = {str(p.relative_to(PACKAGE)) for p in files if p.suffix in (".md", ".c") or _substantial(p)}
    assert must - set(listed) == set(), "modules docs/code_layout.md does not name"
    assert set(listed) - every == set(), "named in docs/code_layout.md, not in the tree"
    assert len(listed) == len(set(listed))


def test_no_two_modules_share_a_name():
    """A module's name says what it holds, once: in the package (package __init__ files aside), and among the test
    modules, which `pytest test` imports by their file name in one run."""
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    tests = [p.name for p in (REPO / "test").rglob("*.py") if p.name != "conftest.py"]
    for found in (names, tests):
        assert sorted({n for n in found if found.count(n) > 1}) == []


def test_the_readme_links_every_docs_page_and_every_link_resolves():
    """The README is the guide: each page of docs/ is one link away, and no link of the README or docs/ is dead."""
    readme = (REPO / "README.md").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [p for p in pages if f"](docs/{p})" not in readme] == []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_modules_and_functions_stay_small():
    """A room holds one job: no module over 500 lines (the planner included), the shell's
    NxDI settings (contract.py) in at most 300; no function takes more than 7 parameters (self and cls aside): what
    travels together is a dataclass (a RunSpec, a Decoding, a Layout)."""
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 500}
    assert big == {}
    assert len((PACKAGE / "neuron" / "contract.py").read_text().splitlines()) <= 300
    wide = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                named = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                if len(named) + bool(a.vararg) + bool(a.kwarg) > 7:
                    wide.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert wide == []


def test_the_position_map_lives_in_one_place():
    """The sequence-sharded cache's owner (p % G) and slot (p // G) are parallel.py's; nothing restates them."""
    restated = re.compile(r"// (g|group|self\.num_cores_per_group)\b|\* (g|group) \+ r")
    rooms = [PACKAGE / "model", PACKAGE / "runtime", PACKAGE / "neuron"]
    said = [f"{p.relative_to(PACKAGE)}:{i}" for room in rooms for p in sorted(room.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if restated.search(line)]
    assert said == []


def _tracked_text_files() -> list[Path]:
    import subprocess

    names = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout
    files = [REPO / n for n in names.splitlines() if (REPO / n).suffix in (".py", ".md", ".sh", ".cfg", ".toml", ".txt",
                                                                             ".json", "")]
    return [f for f in files if f.is_file() and f.stat().st_size < 2_000_000]


def test_no_file_names_a_path_of_a_developer_s_machine():
    """A fresh clone elsewhere has no /work, /root or /home/<someone>: a file that names one points nowhere."""
    pattern = re.compile(r"(?<![\w.~])/(?:work|root|home/\w+)/")
    found = [f"{f.relative_to(REPO)}: {m.group(0)}" for f in _tracked_text_files()
             for m in [pattern.search(f.read_text(errors="replace"))] if m]
    assert not found


def test_no_unit_test_depends_on_a_developer_s_cache_folder():
    """The suite's counts are the README's on a fresh clone: no test passes or skips by what a developer's home
    folder holds (tests that need a cache give the commands their own, through KIMI_K2_NEURON_CACHE)."""
    found = [p.name for p in (REPO / "test" / "unit").glob("*.py")
             if re.search(r"Path\.home\(\)|expanduser\(|[\"']~/\.cache", p.read_text())]
    assert not found
