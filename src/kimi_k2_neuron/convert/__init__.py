"""Convert a Kimi-K2 checkpoint (FP8 blockwise, compressed-tensors INT4 or BF16) once into the layout NxDI loads
directly (kimi_k2_neuron.formats): fused FP8 expert tensors with NxD scales, everything else BF16.
schedule.py decides every output file before any tensor data is read, converter.py streams and resumes,
writer.py writes each file atomically; once.py converts a raw checkpoint once where a converted one is needed."""

from .converter import Result, convert
from .once import converted_dir_for, ensure_converted

__all__ = ["Result", "convert", "converted_dir_for", "ensure_converted"]
