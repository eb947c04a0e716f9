"""The plan command's modes as a user runs them (the planner's figures are test_fit.py's and test_timing.py's)."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_k2_neuron import cli

CONFIG = Path(__file__).resolve().parents[2] / "test" / "data" / "configs" / "kimi-k2-instruct-0905.json"


def _best(capsys, *flags):
    rc = cli.main(["plan", "--config", str(CONFIG), "--tp", "64", "--seq-len", "8192", "--batch", "4", "--best",
                   "--json", *flags])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_best_keeps_the_prefill_bucket_given_and_names_the_flags_it_does_not_use(capsys):
    """--best searches the layout, but a --max-context-length is the user's prefill bucket: every candidate keeps it
    (the one-shot prefill at it, or chunks of it); the layout flags given are named on stderr as not used (before:
    both dropped without a word, the best layout prefilling 4096 tokens a call)."""
    rc, free, err = _best(capsys)
    assert rc == 0 and free["context_len"] == 4096 and err == ""
    rc, kept, err = _best(capsys, "--max-context-length", "2048", "--kv-shard", "sequence", "--moe-prefill", "torch")
    assert rc == 0 and kept["context_len"] == 2048, kept["best_flags"]
    assert err == ("note: --best searches the layout and the MoE prefill itself: --kv-shard sequence, --moe-prefill "
                   "torch given, not used (--max-context-length, --seq-len and --batch are kept)\n")
