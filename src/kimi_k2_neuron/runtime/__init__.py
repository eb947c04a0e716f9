"""Running a loaded model: tokenizer, chat formatting and generation."""

# The CPU paths' compute dtypes by their --dtype names (runner.DTYPES maps them to torch's): here, torch-free, so that
# building the command line's parser does not import torch.
DTYPE_NAMES = ("bfloat16", "float32")
