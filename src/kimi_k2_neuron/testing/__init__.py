"""Test fixtures no command uses: checkpoints with one TP rank's real tensor shapes (rank_slice) and tool-call golden
streams of the tiny tokenizer (tool_call_streams). Last in the import order: nothing in the product imports it."""
