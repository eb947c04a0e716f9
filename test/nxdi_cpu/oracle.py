"""The transformers oracle for the nxdi-cpu tier, run as a subprocess by a Python with transformers >= 5.

    python oracle.py MODEL_DIR ROWS_JSON PREFILL_LEN OUT.safetensors [--bf16-non-experts]

Writes `row{i}`: float32 [len(row i), V] logits of DeepseekV3ForCausalLM fed the raw checkpoint as
kimi_k2_neuron.tiny.transformers_oracle dequantizes it with transformers' / compressed-tensors' code (each row
alone, its first min(PREFILL_LEN, len) tokens in one call, then one token at a time through HF's KV cache).
--bf16-non-experts rounds every weight but the routed experts and the router to bfloat16 first: what a converted
checkpoint stores.
"""

import json
import sys

import torch
from safetensors.torch import save_file

from kimi_k2_neuron.tiny.transformers_oracle import hf_logits, hf_model


def main(model_dir, rows_json, prefill_len, out, *flags):
    model = hf_model(model_dir)
    if "--bf16-non-experts" in flags:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp.experts." not in name and ".mlp.gate." not in name:
                    p.copy_(p.to(torch.bfloat16))
    rows, k = json.loads(rows_json), int(prefill_len)
    save_file({f"row{i}": hf_logits(model, [r], min(k, len(r)))[0].contiguous() for i, r in enumerate(rows)}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
