"""The built-in tiny checkpoints: Kimi-K2's real storage formats, configs, tokenizer files and chat templates at toy
sizes, per release (checkpoint, with its tokenizer), a tiny EAGLE3 draft for one (draft), and transformers'
DeepseekV3ForCausalLM fed weights dequantized by other people's code (transformers_oracle, which needs the `test`
extra). `make-tiny` writes them and `demo` runs one against the oracle, so a fresh machine can try every command
without downloading a terabyte; the tests use them as fixtures."""

# make-tiny's --layout names (torch-free, for the argument parser): the releases checkpoint.LAYOUTS describes.
TINY_LAYOUTS = ("k2", "k2-thinking", "k2.5", "k2.6", "k2.7")
# make-tiny --draft-for's --draft-layout names: the public EAGLE3 draft layouts tiny/draft_checkpoint.py writes.
DRAFT_LAYOUTS = ("eagle3", "eagle3-d2t", "eagle3.1-mla")
