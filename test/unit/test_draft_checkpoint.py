"""tiny/draft_checkpoint.py: `make-tiny OUT --draft-for TARGET` for a target of every release's layout (the K2.5 ones
keep the embedding under language_model.), apart from TARGET, never for an empty TARGET, with the umask's modes. The
oracle of the embedding is the target's own tensor as stored; --draft reads the result (checkpoint/draft.py)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from kimi_k2_neuron import cli
from kimi_k2_neuron.checkpoint.draft import read_draft
from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.tiny import TINY_LAYOUTS
from kimi_k2_neuron.tiny.checkpoint import make_tiny

STORED_EMBEDDING = {"k2": "model.embed_tokens.weight", "k2-thinking": "model.embed_tokens.weight",
                    "k2.5": "language_model.model.embed_tokens.weight",
                    "k2.6": "language_model.model.embed_tokens.weight",
                    "k2.7": "language_model.model.embed_tokens.weight"}


def run_cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("layout", TINY_LAYOUTS)
def test_a_draft_for_a_target_of_every_layout_carries_its_embedding(layout, tmp_path, capsys):
    """Before, every K2.5-layout target (K2.5, K2.6, K2.7) failed: the writer looked for model.embed_tokens.weight
    only."""
    assert set(STORED_EMBEDDING) == set(TINY_LAYOUTS)
    target = make_tiny(tmp_path / "target", layout=layout, shards=2, config_overrides={"num_hidden_layers": 7})
    rc, out, err = run_cli(["make-tiny", tmp_path / "draft", "--draft-for", target], capsys)
    assert rc == 0 and "EAGLE3 draft" in out, err
    with ShardedCheckpoint(target) as ckpt:
        stored = ckpt.get(STORED_EMBEDDING[layout])
    drafted = load_file(tmp_path / "draft" / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(drafted, stored.to(torch.bfloat16))
    assert read_draft(tmp_path / "draft", KimiK2Config.from_file(target)).has_embedding


def test_a_draft_inside_its_target_or_for_no_target_is_refused(tmp_path, capsys, one_line_error):
    """`make-tiny T/draft --draft-for T` wrote into the checkpoint it read (logits --out and convert refuse that);
    `--draft-for ''` (an unset shell variable) wrote a target checkpoint instead of a draft."""
    target = make_tiny(tmp_path / "t", shards=2, config_overrides={"num_hidden_layers": 7})
    before = sorted(p.name for p in target.iterdir())
    rc, _, err = run_cli(["make-tiny", target / "draft", "--draft-for", target], capsys)
    one_line_error.exit(rc, err, f"OUT {target / 'draft'}: is inside --draft-for {target}")
    assert sorted(p.name for p in target.iterdir()) == before
    rc, _, err = run_cli(["make-tiny", tmp_path / "d", "--draft-for", ""], capsys)
    one_line_error.exit(rc, err, "--draft-for: expected a path, got ''")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_drafts_files_get_the_umasks_mode(umask, tmp_path, capsys):
    """safetensors' save_file makes its file 0600; the draft's weights were 0600 where the umask says 0644."""
    target = make_tiny(tmp_path / "t", shards=2, config_overrides={"num_hidden_layers": 7})
    old = os.umask(umask)
    try:
        assert run_cli(["make-tiny", tmp_path / "d", "--draft-for", target], capsys)[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~umask
    for f in (tmp_path / "d").iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
