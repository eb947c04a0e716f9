"""Replies held to a schema: the cases test_grammar.py (xgrammar alone) and test_vllm_structured*.py (through vLLM's
server) share, and their checks. Test infrastructure.

SCHEMAS: 50 JSON Schemas of the kinds Kimi-Vendor-Verifier's tool_call_json_schema cases hold (object, array, anyOf,
enum, nested, required fields). A random model writes whatever its mask allows, so every leaf is bounded (a pattern,
an enum, a range, a count of items), and a request's max_tokens is its schema's longest JSON text in bytes
(`longest`, with vLLM's one-line separators), so every reply ends within it whatever the model samples: then a reply
that parses and validates shows the mask, not the model. (xgrammar 0.1.29 lets a minLength/maxLength string hold
raw control characters, which a strict JSON parser refuses: its length-bounded string rule excludes only the quote,
the backslash, CR and LF; patterns have no such hole, so the bounded strings here are patterns. Its `date` format is
YYYY-MM-DD with any day 01-31 of any month, year 0000 too: `2023-02-30` passes it and no calendar, so a `date` is
checked for that shape, what the mask can hold a reply to; the calendar is the model's.)
"""

from __future__ import annotations

import json
import re

import jsonschema

BUDGET = 160  # max_tokens of a reply whose length no schema bounds (json_object greedy, a thinking reply)
TOOL_BUDGET = 280  # several forced calls': tool arguments take any whitespace (runtime/tool_grammar.py)

WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}
CODE = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}
PATTERN_LONGEST = {WORD["pattern"]: 6, CODE["pattern"]: 5}  # characters a match has at most
COLOR = {"enum": ["red", "green", "blue"]}
SIZE = {"type": "string", "enum": ["S", "M", "L", "XL"]}
COUNT = {"type": "integer", "minimum": 0, "maximum": 99}
DELTA = {"type": "integer", "minimum": -50, "maximum": 50}
FLAG = {"type": "boolean"}
NOTHING = {"type": "null"}
DAY = {"type": "string", "format": "date"}
LEAVES = [WORD, CODE, COLOR, SIZE, COUNT, DELTA, FLAG, NOTHING, DAY]
# jsonschema's format checks, `date` as xgrammar 0.1.29 masks it (above)
FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date")(lambda text: not isinstance(text, str)
                       or re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", text) is not None)


def obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def array(items: dict, most: int = 3, least: int = 1) -> dict:
    return {"type": "array", "items": items, "minItems": least, "maxItems": most}


def _schemas() -> list[tuple[str, dict]]:
    out = []
    # object: flat, every property required
    for i in range(9):
        props = {f"k{j}": LEAVES[(i + j) % len(LEAVES)] for j in range(1 + i % 4)}
        out.append(("object", obj(props)))
    # required fields: some properties optional
    for i in range(8):
        props = {"id": CODE, "name": WORD, "size": SIZE, "count": COUNT, "ok": FLAG}
        keep = list(props)[: 2 + i % 4]
        out.append(("required", obj({k: props[k] for k in keep}, required=keep[: 1 + i % 3])))
    # array: of leaves, of objects, inside an object
    for i in range(9):
        leaf = LEAVES[i % len(LEAVES)]
        out.append(("array", array(leaf, most=2 + i % 3) if i % 3 else
                    array(obj({"name": WORD, "n": leaf}), most=2)))
    # anyOf: of leaves, of objects, as a property
    for i in range(8):
        a, b = LEAVES[i % len(LEAVES)], LEAVES[(i + 3) % len(LEAVES)]
        out.append(("anyOf", {"anyOf": [a, b]} if i % 2 else
                    obj({"value": {"anyOf": [a, obj({"alt": b})]}, "tag": WORD})))
    # enum: of strings, of mixed JSON values, as properties
    for i in range(8):
        mixed = [1, "a", True, None, {"k": 2}, [3]][: 2 + i % 5]
        out.append(("enum", {"enum": mixed} if i % 2 else obj({"color": COLOR, "size": SIZE, "n": {"enum": mixed}})))
    # nested: objects in objects, arrays of objects of arrays
    for i in range(8):
        inner = obj({"x": LEAVES[i % len(LEAVES)], "tags": array(WORD, most=2)})
        out.append(("nested", obj({"outer": obj({"inner": inner, "flag": FLAG}), "list": array(inner, most=2)})
                    if i % 2 else obj({"a": obj({"b": obj({"c": LEAVES[(i + 1) % len(LEAVES)]})})})))
    return out


SCHEMAS = _schemas()
assert len(SCHEMAS) == 50

# tools whose parameters are bounded, for tool_choice required and named
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": obj(
    {"city": WORD, "unit": {"enum": ["C", "F"]}}, required=["city"])}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": obj(
    {"query": WORD, "top_k": COUNT}, required=["query"])}}
TOOLS = [WEATHER, SEARCH]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]


def longest(schema: dict) -> int:
    """Bytes of the longest JSON text the schema allows, written as xgrammar writes it without free whitespace
    (", " and ": " separators); every token is at least one byte, so no reply has more tokens."""
    def text(value) -> int:
        return len(json.dumps(value, separators=(", ", ": ")).encode())
    if "enum" in schema or "const" in schema:
        return max(text(v) for v in schema.get("enum", [schema.get("const")]))
    if "anyOf" in schema:
        return max(longest(s) for s in schema["anyOf"])
    kind = schema["type"]
    if kind == "string":
        return 2 + (10 if schema.get("format") == "date" else PATTERN_LONGEST[schema["pattern"]])
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5 if kind == "boolean" else 4
    if kind == "array":
        most = schema["maxItems"]
        return 2 + most * longest(schema["items"]) + 2 * (most - 1)
    props = schema["properties"]
    return 2 + sum(text(k) + 2 + longest(v) for k, v in props.items()) + 2 * (len(props) - 1)


def check(text: str, schema: dict):
    """The reply's text parsed (strictly: no raw control characters) and validated; its value."""
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=FORMATS)
    return value


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def schema_request(schema: dict, **fields) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "strict": True,
                                                                       "schema": schema}},
            "max_tokens": longest(schema) + 2, **fields}  # the end token too, and one more: a reply whose last
    # token is the max_tokens-th is "length", stop token or not (vllm-neuron checks the length first)
