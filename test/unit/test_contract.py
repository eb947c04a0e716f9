"""kimi_k2_neuron.neuron.contract, what Kimi-K2 requires of NxDI, and its evidence, NXDI_CONTRACT.md."""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# -- the contract document ---------------------------------------------------------------------------------------------

CONTRACT_DOC = REPO / "src/kimi_k2_neuron/neuron/NXDI_CONTRACT.md"
CITING = [*(REPO / "src/kimi_k2_neuron/neuron").glob("*.py"), *(REPO / "src/kimi_k2_neuron/formats").glob("*.py")]


def _cited_names(text: str) -> set[str]:
    """Entry names cited as `NXDI_CONTRACT.md: a, b`, also across a line break of a comment or docstring."""
    flat = re.sub(r"\s*\n\s*(#\s*)?", " ", text)
    return {name for group in re.findall(r"NXDI_CONTRACT\.md: ([a-z0-9-]+(?:, [a-z0-9-]+)*)", flat)
            for name in group.split(", ")}


def _prose(path: Path) -> list[str]:
    """The comments and docstrings of a module."""
    tree = ast.parse(path.read_text())
    docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    with open(path, "rb") as f:
        comments = [t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
    return docs + comments


def test_every_cited_contract_entry_exists_and_every_entry_is_cited():
    entries = set(re.findall(r"^### ([a-z0-9-]+)$", CONTRACT_DOC.read_text(), re.MULTILINE))
    cited = set().union(*(_cited_names(p.read_text()) for p in CITING))
    assert cited - entries == set(), "cited but not in NXDI_CONTRACT.md"
    assert entries - cited == set(), "in NXDI_CONTRACT.md but cited nowhere"


def test_the_code_cites_nxdi_lines_only_through_the_contract_document():
    """file:line evidence lives in NXDI_CONTRACT.md; comments and docstrings name its entries. (Error messages may
    still name a line for the user.)"""
    pinned = re.compile(r"\w\.py:\s?\d|\bl\.\d")
    for path in CITING:
        assert [text for text in _prose(path) if pinned.search(text)] == [], path.name
