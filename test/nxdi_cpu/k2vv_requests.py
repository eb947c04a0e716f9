"""A request set for K2-Vendor-Verifier's tool_calls_eval.py, in its public format (one chat-completions body per
line, standard fields only; role `_input` becomes system; `stream` per request): tools, tool histories with Kimi's
ids and with the malformed and client-style ids K2VV's README names, streamed and not. Thinking on or off goes in
through the harness's --extra-body. Test infrastructure: `python test/nxdi_cpu/k2vv_requests.py > requests.jsonl`.
"""

import json
import sys

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
    "required": ["query"], "additionalProperties": False}}}


def history(call_id: str) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris, then news about it."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "{\"celsius\": 18}"}]


CHATS = [
    ([{"role": "_input", "content": "You are a helpful agent."}, {"role": "user", "content": "Weather in Oslo?"}],
     [WEATHER]),
    ([{"role": "user", "content": "Find the population of Lyon."}], [WEATHER, SEARCH]),
    ([{"role": "user", "content": "Say hello."}], [WEATHER, SEARCH]),
    (history("functions.get_weather:0"), [WEATHER, SEARCH]),
    (history("search:0"), [WEATHER, SEARCH]),  # the malformed history id K2VV's README names
    (history("call_8f3a"), [WEATHER, SEARCH]),  # a client-style id
]

if __name__ == "__main__":
    rows = [{"messages": m, "tools": t, "stream": s, "max_tokens": 16} for m, t in CHATS for s in (False, True)]
    sys.stdout.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
