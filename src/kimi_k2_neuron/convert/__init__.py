"""Convert a Kimi-K2 checkpoint (FP8 blockwise, compressed-tensors INT4 or BF16) into the layout NxDI loads
directly: fused FP8 expert tensors with NxD scales, everything else BF16. See layout.py for the key scheme and
converter.py for streaming/resume. Kept import-light: checkpoint.source imports convert.layout, and the argument
parsers of the trn2 scripts read SCHEMES before torch may be imported."""

# The converter's expert schemes (layout.py: what each stores, the NeuronConfig it matches). DEFAULT_SCHEME is the one
# recommended, and the default wherever a scheme is not given (compile_and_save.py, plan, ServeOptions, the CPU
# mode): exact from FP8 and INT4 sources, where fp8-per-channel re-rounds every expert weight (README, "Which expert
# format").
SCHEMES = ("fp8-blockwise", "fp8-per-channel")
DEFAULT_SCHEME = "fp8-blockwise"


def convert(*args, **kwargs):
    from .converter import convert as _convert

    return _convert(*args, **kwargs)
