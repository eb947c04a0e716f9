"""Write the Kimi-K2 NxDI contrib folder, self-contained, into DEST (e.g. an NxDI checkout's contrib/models/Kimi-K2).

DEST gets this repository's contrib/models/Kimi-K2 (README, pytest.ini, the entry module src/modeling_kimi_k2.py, the
contrib's own unit and integration tests), the Kimi-K2 config.json files its unit tests read (test/data/configs ->
test/unit/data), and a byte-for-byte copy of every module of the kimi_k2_neuron package the contrib needs
(src/kimi_k2_neuron/): the NxDI shell, kimi_k2_neuron.neuron, and whatever it and the contrib's own files import,
followed transitively, with the documents beside them (the shell's NXDI_CONTRACT.md). The rest of the package (the
CLI, the transformers oracle) stays here, and nothing outside DEST is needed to run it: `cd DEST && pytest test/unit`
(CPU) or `pytest test/integration` (a Neuron instance).

DEST must be absent, empty, or an earlier export (which is replaced). test/unit/test_export_contrib.py exports into
a temporary folder, runs the exported unit tests with only DEST/src on the path and compares every exported module
with the package's, so the folder and the package cannot drift apart unnoticed; `--check DEST` tells whether a copy
made earlier (in an NxDI checkout, say) is still what an export writes.

  python scripts/export_contrib.py ~/neuronx-distributed-inference/contrib/models/Kimi-K2
  python scripts/export_contrib.py --check ~/neuronx-distributed-inference/contrib/models/Kimi-K2   # exit 1: stale
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

from kimi_k2_neuron.arguments import check_out_dir, fail, path
from kimi_k2_neuron.errors import KimiInputError, special_file
from kimi_k2_neuron.interrupts import atomic_folder, run_command
from kimi_k2_neuron.launch import script_parser

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "kimi_k2_neuron"
SRC = REPO / "src"
CONTRIB = REPO / "contrib" / "models" / "Kimi-K2"
CONFIGS = REPO / "test" / "data" / "configs"
ENTRY = Path("src") / "modeling_kimi_k2.py"  # what marks a folder as an earlier export
SKIPPED = {"__pycache__", ".pytest_cache"}


def module_file(name: str) -> Path | None:
    """The source file of package module `name` (a package's __init__.py), or None if it is not one."""
    path = SRC.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_names(file: Path, name: str | None) -> set[str]:
    """Every `kimi_k2_neuron...` name `file` imports anywhere (function bodies included: the package imports lazily),
    relative imports resolved against module `name`; `from M import x` yields both M and M.x, since x may be a
    submodule. `name` None: a file outside the package (relative imports do not occur there)."""
    is_package = file.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_package)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {n for n in found if n == PACKAGE or n.startswith(PACKAGE + ".")}


def _absolute(node: ast.ImportFrom, name: str | None, is_package: bool) -> str:
    if not node.level or name is None:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def needed_modules() -> dict[str, Path]:
    """Module name -> source file: the modules of kimi_k2_neuron.neuron, what the contrib's own Python files import,
    and everything those import in turn, with every enclosing package."""
    shell = SRC / PACKAGE / "neuron"
    todo = [f"{PACKAGE}.neuron"] + [f"{PACKAGE}.neuron.{f.stem}" for f in shell.glob("*.py") if f.stem != "__init__"]
    for file in _contrib_files():
        if file.suffix == ".py":
            todo += imported_names(file, None)
    found: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        file = module_file(name)
        if name in found or file is None:  # M.x of `from M import x` where x is a function, class or constant
            continue
        found[name] = file
        parent = name.rpartition(".")[0]
        todo += ([parent] if parent else []) + sorted(imported_names(file, name))
    return found


def _contrib_files() -> list[Path]:
    return sorted(f for f in CONTRIB.rglob("*") if f.is_file() and not SKIPPED & set(f.relative_to(CONTRIB).parts))


def check_dest(dest: Path) -> None:
    """Refuse a DEST that holds anything but an earlier export, before anything is written."""
    if dest.exists() and not dest.is_dir():
        raise KimiInputError(f"{dest}: is {special_file(dest) or 'a file'}; expected a folder")
    here = dest.resolve()
    if here == REPO or REPO in here.parents or here in REPO.parents:  # replacing it would delete the sources
        raise KimiInputError(f"{dest}: inside this repository ({REPO}) or holding it; give a folder outside it")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / ENTRY).is_file():
        raise KimiInputError(f"{dest}: not empty and not an earlier export (no {ENTRY}); give a new or empty folder")
    check_out_dir(dest.absolute().parent, "DEST's folder (the export is written beside DEST, then renamed)")


def planned_files(modules: dict[str, Path]) -> dict[Path, Path]:
    """Path inside DEST -> the file of this repository it is a copy of: the contrib's own files, the configs, the
    vendored modules and the documents beside them (the shell's NXDI_CONTRACT.md, which its code cites)."""
    files = {f.relative_to(CONTRIB): f for f in _contrib_files()}
    files |= {Path("test", "unit", "data", c.name): c for c in sorted(CONFIGS.glob("kimi-k2*.json"))}
    docs = {doc for f in modules.values() for doc in f.parent.glob("*.md")}
    return files | {Path("src") / f.relative_to(SRC): f for f in (*modules.values(), *sorted(docs))}


def export(dest: Path) -> dict[str, Path]:
    """Write the contrib folder into dest (see the module docstring); returns the vendored modules. Written into a
    hidden folder beside dest and renamed into place, so that an interrupted export leaves the earlier one (or
    none), never a folder that looks like an export and is not one."""
    check_dest(dest)
    modules = needed_modules()
    with atomic_folder(dest) as tmp:
        for rel, src in planned_files(modules).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
    return modules


def differences(dest: Path) -> list[str]:
    """What differs between dest and a fresh export: files missing, extra (caches aside) or with other bytes."""
    want = planned_files(needed_modules())
    files = (f.relative_to(dest) for f in dest.rglob("*") if f.is_file())
    have = {rel for rel in files if not SKIPPED & set(rel.parts)}
    missing, extra = sorted(set(want) - have), sorted(have - set(want))
    changed = sorted(rel for rel in have & set(want) if (dest / rel).read_bytes() != want[rel].read_bytes())
    return [f"missing {r}" for r in missing] + [f"extra {r}" for r in extra] + [f"differs {r}" for r in changed]


def build_parser():
    p = script_parser(__doc__)
    p.add_argument("dest", metavar="DEST", type=path,
                   help="folder to write (absent, empty, or an earlier export, which is replaced)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 and list the files where DEST differs from a fresh export")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dest = Path(args.dest)
    try:
        if args.check:
            return _report(dest)
        modules = export(dest)
    except KimiInputError as e:
        return fail(e)
    lines = sum(len(f.read_text().splitlines()) for f in modules.values())
    print(f"exported {len(modules)} modules of {PACKAGE} ({lines} lines) and the contrib's own files into {dest}")
    return 0


def _report(dest: Path) -> int:
    if not (dest / ENTRY).is_file():
        raise KimiInputError(f"{dest}: not an export (no {ENTRY})")
    diff = differences(dest)
    print("\n".join(diff) if diff else f"{dest} is what an export writes now")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(run_command(main))
