"""The grammar a forced tool call is held to inside Kimi's markers (runtime/tool_calls.py), as the request's vLLM
`structured_outputs`: a JSON Schema, or an xgrammar structural tag (`{"type": "structural_tag", "format": ...}`,
which vLLM 0.13 hands to xgrammar's compile_structural_tag). SDK-free.

A forced call continues an assistant message that opens it (runtime/chat_api.py's prefill):
- a named function's prompt ends at its argument marker: its grammar is the function's parameters, and the reply
  ends after them (the parser reports a call the end cut off when its arguments are whole JSON);
- `required`'s prompt ends at the tool section's begin marker: its grammar is one or more whole calls,
  `functions.NAME:IDX` with IDX counting the conversation's calls as Kimi writes them, each with its function's
  parameters, then the section's end marker (one call when the request sets parallel_tool_calls false).

Each marker is text to the grammar; the worker has its single token write it (runtime/grammar_mask.py).
"""

from __future__ import annotations

import json

from .tool_calls import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, FUNCTION_PREFIX, SECTION_END, tool_schemas

# Calls a `required` reply may make when parallel calls are allowed: each one more repeats every tool's schema in
# the grammar, which xgrammar compiles per request.
MAX_PARALLEL_CALLS = 4


def parameters_schema(parameters: dict) -> dict:
    """A function's arguments are a JSON object: its parameters, or any object where it declares none."""
    return parameters if parameters else {"type": "object"}


def named_call(tools, name: str) -> dict:
    """structured_outputs for a call of `name`, whose prompt ends at its argument marker."""
    return {"json": parameters_schema(dict(tool_schemas(tools))[name])}


def required_calls(tools, first_index: int, parallel: bool = True) -> dict:
    """structured_outputs for tool_choice required, whose prompt ends at the tool section's begin marker: calls
    first_index, first_index + 1, ... (at most MAX_PARALLEL_CALLS, or one), then the section's end."""
    schemas = tool_schemas(tools)
    end = {"type": "const_string", "value": SECTION_END}

    def calls(k: int, left: int) -> dict:
        tags = [{"type": "tag", "begin": f"{CALL_BEGIN}{FUNCTION_PREFIX}{name}:{first_index + k}{ARGUMENT_BEGIN}",
                 "content": {"type": "json_schema", "json_schema": parameters_schema(parameters)},
                 "end": CALL_END} for name, parameters in schemas]
        tail = end if left == 1 else {"type": "or", "elements": [end, calls(k + 1, left - 1)]}
        return {"type": "sequence", "elements": [tags[0] if len(tags) == 1 else {"type": "or", "elements": tags},
                                                 tail]}

    grammar = {"type": "structural_tag", "format": calls(0, MAX_PARALLEL_CALLS if parallel else 1)}
    return {"structural_tag": json.dumps(grammar)}
