"""The converted checkpoint's format; this file is torch-free, so argument parsers read it before torch loads."""

from ..errors import KimiInputError

# The default is exact from FP8 and INT4 sources; fp8-per-channel re-rounds every expert weight. bf16 experts are
# planned and configured, never written.
SCHEMES = ("fp8-blockwise", "fp8-per-channel")
DEFAULT_SCHEME = "fp8-blockwise"
EXPERT_FORMATS = (*SCHEMES, "bf16")


def check_expert_format(name) -> None:
    if name not in EXPERT_FORMATS:
        raise KimiInputError(f"--experts {name!r}: expected one of {', '.join(EXPERT_FORMATS)}")
