"""Grammar-constrained decoding (mlxd.constraints) on a tiny random model at temperature 1.

The oracles: every finished output parses and validates against its schema (``jsonschema``), a tool call names a
known tool with arguments valid for that tool, generation ends on EOS (the tiny model damps EOS, so the grammar must
force it), ids past the tokenizer never come out, and llguidance's refusals reach the client as ``RequestError``.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlxd.constraints import (
    ConstraintError,
    GrammarCompiler,
    make_constraint_factory,
    make_grammar_processor,
)
from mlxd.constraints.schema import close_objects
from mlxd.engine.step.row import logits_width
from mlxd.errors import RequestError

SEEDS = range(20)
MAX_TOKENS = 400

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "color", "count", "owner", "tags"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 8}, "limit": {"type": "integer", "minimum": 1,
                                                                          "maximum": 5}},
    "required": ["query", "limit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]
PARAMETERS = {"weather": WEATHER, "search": SEARCH}
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    """The tiny llama model and its mlx-lm tokenizer wrapper."""
    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def compiler(tiny) -> GrammarCompiler:
    model, tokenizer = tiny
    return GrammarCompiler(tokenizer, n_vocab=logits_width(model))


@pytest.fixture(scope="module")
def eos_ids(tiny) -> list[int]:
    return sorted(tiny[1].eos_token_ids)


def generate(tiny, processor, seed: int, prompt: str = "Answer in JSON:") -> tuple[str, bool]:
    """Sample at temperature 1 under the processor; the decoded text and whether it ended on EOS."""
    model, tokenizer = tiny
    mx.random.seed(seed)
    ids = mx.array(tokenizer.encode(prompt), dtype=mx.uint32)
    out: list[int] = []
    for token, _ in generate_step(ids, model, sampler=make_sampler(temp=1.0), logits_processors=[processor],
                                  max_tokens=MAX_TOKENS):
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(out), True
        out.append(token)
    return tokenizer.decode(out), False


def accepts(compiled, ids: list[int]) -> bool:
    """Whether the grammar takes exactly these tokens and is then complete."""
    matcher = compiled.matcher.deep_copy()
    return matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_outputs_validate_and_end_on_eos(tiny, compiler, eos_ids, seed):
    compiled = compiler.json_schema(SCHEMA, strict=True)
    text, ended = generate(tiny, make_grammar_processor(compiled, compiler, eos_ids), seed)
    assert ended, f"no EOS within {MAX_TOKENS} tokens: {text!r}"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_required_tool_call_names_a_tool_with_valid_arguments(tiny, compiler, eos_ids):
    compiled = compiler.tool_call(TOOLS, "required", parallel=False)
    called = set()
    for seed in SEEDS:
        text, ended = generate(tiny, make_grammar_processor(compiled, compiler, eos_ids), seed, "What's the weather?")
        assert ended, f"seed {seed}: no EOS within {MAX_TOKENS} tokens: {text!r}"
        match = TOOL_CALL.fullmatch(text)
        assert match, f"seed {seed}: {text!r}"
        call = json.loads(match.group(1))
        assert list(call) == ["name", "arguments"]
        jsonschema.validate(call["arguments"], PARAMETERS[call["name"]])
        called.add(call["name"])
    assert called == set(PARAMETERS)  # both tools' schemas were exercised


@pytest.mark.parametrize("seed", range(10))
def test_named_tool_choice_always_calls_that_tool(tiny, compiler, eos_ids, seed):
    choice = {"type": "function", "function": {"name": "search"}}
    compiled = compiler.tool_call(TOOLS, choice, parallel=False)
    text, ended = generate(tiny, make_grammar_processor(compiled, compiler, eos_ids), seed)
    assert ended, f"no EOS within {MAX_TOKENS} tokens: {text!r}"
    match = TOOL_CALL.fullmatch(text)
    assert match, text
    call = json.loads(match.group(1))
    assert call["name"] == "search"
    jsonschema.validate(call["arguments"], SEARCH)


def test_tool_call_markers_are_accepted_as_added_tokens_or_spelled_out(tiny, compiler, eos_ids):
    hf = tiny[1]._tokenizer
    compiled = compiler.tool_call(TOOLS, "required", parallel=True)
    call = '\n{"name": "search", "arguments": {"query": "mlx", "limit": 2}}\n'
    single = hf.encode(f"<tool_call>{call}</tool_call>")  # the markers as their added tokens
    assert hf.convert_tokens_to_ids("<tool_call>") in single
    pieces = [t for piece in ["<", "tool", "_call", ">"] for t in hf.encode(piece)]
    spelled = pieces + hf.encode(call) + [t for piece in ["</", "tool", "_call>"] for t in hf.encode(piece)]
    assert hf.decode(spelled) == hf.decode(single)
    first = make_grammar_processor(compiled, compiler, eos_ids)(mx.array(hf.encode("Hi"), dtype=mx.uint32),
                                                                mx.zeros((1, compiler.n_vocab)))
    allowed = mx.isfinite(first[0]).tolist()
    assert allowed[single[0]] and allowed[pieces[0]]
    assert accepts(compiled, single)
    assert accepts(compiled, spelled)
    assert accepts(compiled, single + hf.encode("\n") + spelled)  # parallel: calls one per line
    assert not accepts(compiler.tool_call(TOOLS, "required", parallel=False),
                       single + hf.encode("\n") + single)
    assert not accepts(compiled, hf.encode('<tool_call>\n{"name": "nope", "arguments": {}}\n'
                                                     "</tool_call>"))


def test_json_object_outputs_are_objects(tiny, compiler, eos_ids):
    compiled = compiler.json_object()
    finished = []
    for seed in range(8):
        text, ended = generate(tiny, make_grammar_processor(compiled, compiler, eos_ids), seed)
        assert text.startswith("{")
        if ended:  # an unbounded object may not close within MAX_TOKENS on a random model
            finished.append(json.loads(text))
    assert len(finished) >= 3 and all(isinstance(obj, dict) for obj in finished)
    hf = tiny[1]._tokenizer
    assert accepts(compiled, hf.encode('{"a": [1, {"b": null}]}'))
    assert not accepts(compiled, hf.encode("[1, 2]"))


def test_strict_closes_objects_that_do_not_say(tiny, compiler):
    hf = tiny[1]._tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = hf.encode('{"a": 1, "b": 2}')
    assert accepts(compiler.json_schema(schema, strict=False), extra)
    assert not accepts(compiler.json_schema(schema, strict=True), extra)
    assert accepts(compiler.json_schema(schema, strict=True), hf.encode('{"a": 1}'))


def test_close_objects_reaches_nested_schemas_and_keeps_explicit_choices():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object"}, "b": {"type": "array", "items": {"properties": {"x": {}}}}},
        "$defs": {"d": {"type": ["object", "null"]}},
        "anyOf": [{"type": "object"}],
        "allOf": [{"type": "object", "properties": {"y": {}}}],
        "additionalProperties": {"type": "integer"},
    }
    original = json.dumps(schema)
    closed = close_objects(schema)
    assert json.dumps(schema) == original
    assert closed["additionalProperties"] == {"type": "integer"}
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]  # would forbid the other branches' properties


@pytest.mark.parametrize(("schema", "named"), [
    ({"not": {"type": "string"}}, '"not"'),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, '"if"'),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),  # overlapping branches
    ({"type": "string", "format": "zip-code"}, "zip-code"),
    ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"not": {"type": "string"}, "x-guidance": {"lenient": True}}, '"not"'),  # never silently ignored
])
def test_unsupported_schema_feature_is_a_request_error_naming_it(compiler, schema, named):
    with pytest.raises(RequestError) as caught:
        compiler.json_schema(schema, strict=False)
    assert caught.value.param == "response_format.json_schema.schema"
    assert named in caught.value.message, caught.value.message


def test_bad_tools_are_request_errors(compiler):
    bad_tool = {"type": "function", "function": {"name": "odd", "parameters": {"not": {"type": "string"}}}}
    with pytest.raises(RequestError, match="tool 'odd'.*not") as caught:
        compiler.tool_call([*TOOLS, bad_tool], "required")
    assert caught.value.param == f"tools[{len(TOOLS)}].function.parameters"
    with pytest.raises(RequestError, match="'missing'") as caught:
        compiler.tool_call(TOOLS, {"type": "function", "function": {"name": "missing"}})
    assert caught.value.param == "tool_choice"
    with pytest.raises(RequestError, match="duplicate"):
        compiler.tool_call([TOOLS[0], TOOLS[0]], "required")


def test_ids_past_the_tokenizer_are_always_masked(tiny, eos_ids):
    """Logits wider than the tokenizer (padded embeddings): the extra ids get a large bonus and never come out."""
    tokenizer = tiny[1]
    width = len(tokenizer._tokenizer) + 37
    compiler = GrammarCompiler(tokenizer, n_vocab=width)
    processor = make_grammar_processor(compiler.json_schema(SCHEMA), compiler, eos_ids)
    bonus = mx.concatenate([mx.zeros((1, width - 37)), mx.full((1, 37), 50.0)], axis=1)
    tokens = mx.array(tokenizer.encode("JSON:"), dtype=mx.uint32)
    mx.random.seed(0)
    for _ in range(MAX_TOKENS):
        logits = processor(tokens, mx.random.normal((1, width)) + bonus)
        assert mx.all(mx.isneginf(logits[0, width - 37:])).item()
        token = mx.random.categorical(logits).astype(mx.uint32)
        tokens = mx.concatenate([tokens, token])
        if token.item() in eos_ids:
            break
    else:
        pytest.fail("no EOS")
    jsonschema.validate(json.loads(tokenizer.decode(tokens[len(tokenizer.encode("JSON:")):-1].tolist())), SCHEMA)


def test_complete_grammar_allows_only_eos_and_breaking_it_raises(tiny, compiler, eos_ids):
    hf = tiny[1]._tokenizer
    compiled = compiler.json_schema({"enum": ["red"]})
    prompt = hf.encode("Colour:")
    processor = make_grammar_processor(compiled, compiler, eos_ids)
    logits = mx.zeros((1, compiler.n_vocab))
    processor(mx.array(prompt, dtype=mx.uint32), logits)
    allowed = processor(mx.array(prompt + hf.encode('"red"'), dtype=mx.uint32), logits)
    assert mx.isfinite(allowed[0]).tolist() == [i in eos_ids for i in range(compiler.n_vocab)]

    fresh = make_grammar_processor(compiled, compiler, eos_ids)
    fresh(mx.array(prompt, dtype=mx.uint32), logits)
    with pytest.raises(ConstraintError, match="breaks the grammar"):
        fresh(mx.array(prompt + hf.encode("blue"), dtype=mx.uint32), logits)
    early = make_grammar_processor(compiled, compiler, eos_ids)
    early(mx.array(prompt, dtype=mx.uint32), logits)
    with pytest.raises(ConstraintError, match="before the grammar is complete"):
        early(mx.array([*prompt, eos_ids[0]], dtype=mx.uint32), logits)


def test_factory_gives_each_row_its_own_state(tiny, compiler, eos_ids):
    hf = tiny[1]._tokenizer
    factory = make_constraint_factory(compiler.json_schema({"enum": ["red", "blue"]}), compiler, eos_ids)
    (first,), (second,) = factory(), factory()
    assert first is not second
    prompt = hf.encode("Colour:")
    logits = mx.zeros((1, compiler.n_vocab))
    for processor in (first, second):
        processor(mx.array(prompt, dtype=mx.uint32), logits)
    first(mx.array(prompt + hf.encode('"red"'), dtype=mx.uint32), logits)
    allowed = second(mx.array(prompt + hf.encode('"blue"'), dtype=mx.uint32), logits)
    assert mx.isfinite(allowed[0]).tolist() == [i in eos_ids for i in range(compiler.n_vocab)]


def test_llguidance_tokenizer_is_built_once_across_threads(tiny):
    compiler = GrammarCompiler(tiny[1])
    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(lambda _: compiler.llg_tokenizer(), range(16)))
    assert all(b is built[0] for b in built)
    assert compiler.n_vocab == compiler.vocab_size == len(tiny[1]._tokenizer)


def test_logits_narrower_than_the_tokenizer(tiny, eos_ids):
    """Some checkpoints' embeddings stop short of the tokenizer's added tokens: the mask is cut to the logits."""
    tokenizer = tiny[1]
    width = len(tokenizer._tokenizer) - 4  # drops the <tool_call> ... </think> added ids
    compiler = GrammarCompiler(tokenizer, n_vocab=width)
    processor = make_grammar_processor(compiler.tool_call(TOOLS), compiler, eos_ids)
    out = processor(mx.array(tokenizer.encode("Hi"), dtype=mx.uint32), mx.zeros((1, width)))
    assert out.shape == (1, width) and mx.isfinite(out[0, tokenizer.encode("<")[0]]).item()
    with pytest.raises(ConstraintError, match="wide"):
        processor(mx.array(tokenizer.encode("Hi"), dtype=mx.uint32), mx.zeros((1, width + 1)))


def test_equal_requests_reuse_the_compiled_grammar(tiny, compiler):
    assert compiler.json_schema(json.loads(json.dumps(SCHEMA)), strict=True) is compiler.json_schema(SCHEMA, True)
    assert compiler.json_schema(SCHEMA, strict=False) is not compiler.json_schema(SCHEMA, strict=True)
    # Properties come out in the schema's order, so a reordered schema is another grammar, not a cache hit.
    pair = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}
    flipped = {**pair, "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    text = tiny[1]._tokenizer.encode('{"b": 2, "a": 1}')
    assert not accepts(compiler.json_schema(pair), text)
    assert accepts(compiler.json_schema(flipped), text)
    assert compiler.tool_call(TOOLS) is compiler.tool_call(json.loads(json.dumps(TOOLS)))
    assert compiler.tool_call(TOOLS, parallel=True) is not compiler.tool_call(TOOLS)


@pytest.mark.parametrize(("schema", "cycle"), [
    ({"$ref": "#"}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}}, "#/properties/x"),
    ({"allOf": [{"$ref": "#"}]}, "allOf[0] -> #"),
    ({"anyOf": [{"$ref": "#"}, {"type": "integer"}]}, None),  # an alternative ends it
    ({"type": "array", "items": {"$ref": "#"}}, None),  # each level writes a bracket
    ({"$defs": {"a/b": {"type": "string"}}, "$ref": "#/$defs/a~1b"}, None),
])
def test_ref_chains_that_come_back_are_found(schema, cycle):
    from mlxd.constraints.schema import find_ref_cycle

    assert find_ref_cycle(schema) == cycle


def test_schemas_without_a_finite_instance_are_request_errors_naming_the_field(compiler):
    with pytest.raises(RequestError, match=r"\$ref") as caught:
        compiler.json_schema({"$ref": "#"})
    assert caught.value.param == "response_format.json_schema.schema"
    looped = {"type": "function", "function": {"name": "f", "parameters": {"allOf": [{"$ref": "#"}]}}}
    with pytest.raises(RequestError, match=r"\$ref") as caught:
        compiler.tool_call([*TOOLS, looped], "required")
    assert caught.value.param == f"tools[{len(TOOLS)}].function.parameters"


@pytest.mark.parametrize("name", ["</tool_call>", "a<tool_call>", 'a"b', "a b", "a\nb", "x" * 129, "<|call|>",
                                  "[TOOL_CALLS]", "<｜tool▁sep｜>", "f(x)"])
def test_names_that_could_hold_tool_call_markup_are_refused(compiler, name):
    from mlxd.constraints.tools import check_tool_names

    tools = [*TOOLS, {"type": "function", "function": {"name": name}}]
    with pytest.raises(RequestError) as caught:
        check_tool_names(tools)
    assert caught.value.param == f"tools[{len(TOOLS)}].function.name"
    with pytest.raises(RequestError) as caught:
        compiler.tool_call(tools, "required")
    assert caught.value.param == f"tools[{len(TOOLS)}].function.name"
    check_tool_names([{"type": "function", "function": {"name": "mcp__fs__read-file.v2:x"}}])
