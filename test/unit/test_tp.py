"""CPU tensor parallelism (runtime/tp.py): the same decoder code sharded over 2 CPU ranks (gloo) gives the single-rank
logits; a TP that does not divide the model is refused."""

from safetensors.torch import load_file

from kimi_k2_neuron.cli import main
from kimi_k2_neuron.runtime.runner import CpuRunner

ROWS = [[5, 17, 300, 42, 256, 9], [400, 3, 3, 260, 100, 2]]


def test_cli_logits_tp2_equals_tp1(tiny_dirs, tmp_path):
    out = tmp_path / "tp2.safetensors"
    assert main(["logits", "--model", str(tiny_dirs["int4"]), "--input-ids", "5,17,300,42,256,9;400,3,3,260,100,2",
                 "--prefill-len", "3", "--tp", "2", "--out", str(out)]) == 0
    tp2 = load_file(out)["logits"]
    tp1 = CpuRunner(tiny_dirs["int4"]).logits(ROWS, 3)
    assert tp2.shape == tp1.shape
    assert (tp2 - tp1).abs().max() / tp1.abs().max() < 1e-5


def test_tp_that_does_not_divide_is_refused(tiny_dirs, tmp_path, capsys):
    rc = main(["logits", "--model", str(tiny_dirs["fp8"]), "--input-ids", "1,2", "--tp", "3",
               "--out", str(tmp_path / "x.safetensors")])
    assert rc == 2 and "num_attention_heads=4 is not divisible by 3" in capsys.readouterr().err
