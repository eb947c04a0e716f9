"""scripts/export_contrib.py: the NxDI contrib folder it writes runs on its own (its unit tests pass with only
DEST/src on the path, and every kimi_k2_neuron module they load comes from DEST), and every module it vendors is
byte-identical to the package's, so this test fails as soon as the contrib and the package drift apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "export_contrib.py"

# Run in DEST: the exported unit tests, then every module of the package that was loaded from a file outside DEST.
_RUN_EXPORTED_TESTS = """
import sys
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider", "test/unit"])
ours, dest = ("kimi_k2_neuron",), sys.argv[1]
outside = sorted(name for name, m in sys.modules.items()
                 if name.split(".")[0] in ours and not (getattr(m, "__file__", None) or dest).startswith(dest))
print("loaded from outside:", outside)
sys.exit(code or (3 if outside else 0))
"""


def _export(dest: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *flags, str(dest)], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def export_run(tmp_path_factory) -> tuple[Path, str]:
    dest = tmp_path_factory.mktemp("nxdi") / "contrib" / "models" / "Kimi-K2"
    r = _export(dest)
    assert r.returncode == 0 and r.stdout.startswith("exported "), r.stdout + r.stderr
    return dest, r.stdout


@pytest.fixture(scope="module")
def exported(export_run) -> Path:
    return export_run[0]


def test_the_docs_counts_are_the_exports(export_run):
    """docs/contrib.md's round figures of what is vendored stay within 10 % of what an export writes."""
    modules, lines = map(int, re.search(r"exported (\d+) modules of \S+ \((\d+) lines\)", export_run[1]).groups())
    text = " ".join((REPO / "docs" / "contrib.md").read_text().split())
    said_modules, said_lines = re.search(r"about (\d+) modules and ([\d,]+) lines", text).groups()
    assert abs(int(said_modules) - modules) <= 0.1 * modules, (said_modules, modules)
    assert abs(int(said_lines.replace(",", "")) - lines) <= 0.1 * lines, (said_lines, lines)


@pytest.mark.slow
def test_the_exported_folder_runs_its_own_unit_tests_on_its_own(exported):
    env = {**os.environ, "PYTHONPATH": str(exported / "src")}
    where = subprocess.run([sys.executable, "-c", "import kimi_k2_neuron; print(kimi_k2_neuron.__file__)"],
                           capture_output=True, text=True, env=env, cwd=exported)
    assert Path(where.stdout.strip()) == exported / "src" / "kimi_k2_neuron" / "__init__.py", where.stderr
    r = subprocess.run([sys.executable, "-c", _RUN_EXPORTED_TESTS, f"{exported}{os.sep}"], capture_output=True,
                       text=True, env=env, cwd=exported)
    assert r.returncode == 0 and "loaded from outside: []" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    # docs/contrib.md says how many tests the folder holds and how many run without NxD/NxDI
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped)", r.stdout.splitlines()[-2])}
    text = " ".join((REPO / "docs" / "contrib.md").read_text().split())
    total, no_sdk, needs = map(int, re.search(r"\((\d+) tests, ~\d+ s: (\d+) need no SDK, the (\d+) ", text).groups())
    assert total == no_sdk + needs == sum(counts.values()) and counts["passed"] >= no_sdk, (counts, total, no_sdk)


def test_every_exported_module_is_the_package_s_own(exported):
    vendored = {p.relative_to(exported / "src") for p in (exported / "src" / "kimi_k2_neuron").rglob("*.py")}
    for rel in vendored:
        assert (exported / "src" / rel).read_bytes() == (REPO / "src" / rel).read_bytes(), rel
    shell = {p.relative_to(REPO / "src") for p in (REPO / "src" / "kimi_k2_neuron" / "neuron").glob("*.py")}
    assert shell <= vendored  # the whole NxDI shell, and what it imports
    doc = Path("kimi_k2_neuron/neuron/NXDI_CONTRACT.md")  # the evidence its code cites by name
    assert (exported / "src" / doc).read_bytes() == (REPO / "src" / doc).read_bytes()
    assert Path("kimi_k2_neuron/cli.py") not in vendored
    assert Path("kimi_k2_neuron/tiny/transformers_oracle.py") not in vendored
    others = {p.name for p in (exported / "src").iterdir()} - {"kimi_k2_neuron"}
    assert others == {"modeling_kimi_k2.py"}


def test_the_contrib_readme_points_only_inside_the_folder(exported):
    targets = re.findall(r"\]\(([^)]+)\)", (exported / "README.md").read_text())
    for target in targets:
        if not target.startswith(("http://", "https://", "#")):
            assert (exported / target).resolve().is_relative_to(exported) and (exported / target).exists(), target
    assert "../" not in (exported / "README.md").read_text()


def test_a_folder_that_is_not_an_export_is_refused_and_an_earlier_export_replaced(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    r = _export(tmp_path / "other")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not an earlier export" in r.stderr, r.stderr
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("")
    assert "file: is a file; expected a folder" in _export(tmp_path / "file").stderr
    assert _export(tmp_path / "again").returncode == 0
    stale = tmp_path / "again" / "src" / "kimi_k2_neuron" / "stale.py"
    stale.write_text("")
    assert _export(tmp_path / "again").returncode == 0 and not stale.exists()


def test_a_folder_inside_this_repository_is_refused_before_anything_is_written():
    # The repository's own contrib folder has the entry module of an export: replacing it would delete the sources.
    # (A folder that does not exist yet stands in for it here, so that a regression cannot delete them.)
    dest = REPO / "contrib" / "models" / "not-yet-there"
    r = _export(dest)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "inside this repository" in r.stderr, r.stderr
    assert not dest.exists()


def test_check_tells_whether_an_earlier_copy_is_still_current(exported, tmp_path):
    r = _export(exported, "--check")
    assert r.returncode == 0 and "is what an export writes now" in r.stdout, r.stdout + r.stderr
    copy = tmp_path / "copy"
    assert _export(copy).returncode == 0
    (copy / "src" / "kimi_k2_neuron" / "neuron" / "fit.py").write_text("# edited in the NxDI checkout\n")
    (copy / "test" / "unit" / "data" / "kimi-k2-thinking.json").unlink()
    (copy / "src" / "kimi_k2_neuron" / "extra.py").write_text("")
    r = _export(copy, "--check")
    assert r.returncode == 1 and r.stdout.splitlines() == [
        "missing test/unit/data/kimi-k2-thinking.json", "extra src/kimi_k2_neuron/extra.py",
        "differs src/kimi_k2_neuron/neuron/fit.py"], r.stdout
    assert _export(tmp_path, "--check").returncode == 2  # not an export at all
