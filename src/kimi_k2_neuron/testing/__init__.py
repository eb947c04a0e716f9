"""Test fixtures and the independent oracle, not used to serve: tiny checkpoints in Kimi-K2's real storage formats
(tiny_checkpoint, with its tiny_tokenizer) and transformers' DeepseekV3ForCausalLM fed weights dequantized by
other people's code (transformers_oracle, which needs the `test` extra)."""

# make-tiny's --layout names (torch-free, for the argument parser): the releases tiny_checkpoint.LAYOUTS describes.
TINY_LAYOUTS = ("k2", "k2-thinking", "k2.5", "k2.6", "k2.7")
