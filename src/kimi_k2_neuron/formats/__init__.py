"""The converted checkpoint's format: what `kimi-k2-neuron convert` writes and everything downstream reads.

- this file (torch-free, so argument parsers read it before torch is imported): the expert formats' names;
- scheme.py: ExpertScheme, one FP8 expert quantization (its scale block) and the NxD settings it loads under;
- layout.py: every tensor's name, dtype and shape, in the HF checkpoint (logical weights) and in the converted one
  (fused experts with their scales), and the key map onto the Neuron model's state dict;
- record.py: ConversionRecord, the typed record of a conversion in the converted config.json.
"""

from ..errors import KimiInputError

# The converter's expert schemes. DEFAULT_SCHEME is the one recommended, and the default wherever a scheme is not
# given (compile_and_save.py, plan, ServeOptions, the CPU mode): exact from FP8 and INT4 sources, where
# fp8-per-channel re-rounds every expert weight (README, "Which expert format").
SCHEMES = ("fp8-blockwise", "fp8-per-channel")
DEFAULT_SCHEME = "fp8-blockwise"
# Routed-expert storage on device: a converter scheme, or unquantized bf16 (planned and configured; never written).
EXPERT_FORMATS = (*SCHEMES, "bf16")


def check_expert_format(name) -> None:
    """Refuse an expert format that is none of EXPERT_FORMATS, naming the flag."""
    if name not in EXPERT_FORMATS:
        raise KimiInputError(f"--experts {name!r}: expected one of {', '.join(EXPERT_FORMATS)}")
