"""Constrained decoding: a tiny random model's noise must still come out as valid JSON / grammar text.

The model's weights are random, so whatever it writes is the grammar's doing. Outputs that end with
finish_reason "stop" must parse and validate; "length" cuts are allowed to be incomplete.
"""

from __future__ import annotations

import json
import re

import pytest

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.engine.structured_output import JSON_MAX_WHITESPACE, GrammarCache, StructuredOutput, xgrammar_reason

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "owner": PERSON,
            "meta": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
                "required": ["ok", "note"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner", "meta"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 2,
                "maxItems": 4,
            },
            "pairs": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
                "maxItems": 2,
            },
        },
        "required": ["scores", "pairs"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["color", "size", "level"],
        "additionalProperties": False,
    },
    "required_only": {
        "type": "object",
        "properties": {
            "a": {"type": "boolean"},
            "b": {"type": "string", "maxLength": 4},
            "c": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a", "c"],
        "additionalProperties": False,
    },
}


def validation_errors(value, schema: dict, path: str = "$") -> list[str]:
    """The errors of value against the subset of JSON Schema the tests use (jsonschema is not a
    dependency of the project)."""
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            return errors + [f"{path}: {value!r} is not an integer"]
    elif kind in checks and not isinstance(value, checks[kind]):
        return errors + [f"{path}: {value!r} is not {kind}"]
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} > {schema['maximum']}")
    if kind == "string" and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        errors.append(f"{path}: length {len(value)} outside the schema's bounds")
    if kind == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errors.append(f"{path}: {len(value)} items outside the schema's bounds")
        for i, item in enumerate(value):
            errors += validation_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{path}: missing {name!r}" for name in schema.get("required", []) if name not in value]
        for name, item in value.items():
            if name in properties:
                errors += validation_errors(item, properties[name], f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected property {name!r}")
    return errors


def test_validator_catches_violations():
    schema = SCHEMAS["nested"]
    good = {"id": 3, "owner": {"name": "x", "age": 4}, "meta": {"ok": True, "note": None}}
    assert validation_errors(good, schema) == []
    assert validation_errors({**good, "id": 0}, schema)
    assert validation_errors({**good, "extra": 1}, schema)
    assert validation_errors({"id": 3, "owner": {"name": "", "age": 4}, "meta": good["meta"]}, schema)
    assert validation_errors({"id": 3, "owner": good["owner"]}, schema)
    assert validation_errors({"color": "pink", "size": "S", "level": 1}, SCHEMAS["enums"])
    assert validation_errors({"scores": [1], "pairs": []}, SCHEMAS["arrays"])


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(checkpoint, num_kv_blocks=256, max_model_len=1024)


def constrained(structured: StructuredOutput, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 600, **kwargs}, structured_output=structured)


# -- the request's shape --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "xml"}, "structured_output.kind must be one of"),
        ({"kind": "json_object", "spec": "{}"}, "must be empty for kind 'json_object'"),
        ({"kind": "json_schema", "spec": "  "}, "must not be empty for kind 'json_schema'"),
        ({"kind": "json_schema", "spec": "{nope"}, "the json_schema is not valid JSON"),
        ({"kind": "json_schema", "spec": "[1]"}, "a json_schema must be a JSON object, got list"),
        ({"kind": "structural_tag", "spec": "true"}, "a structural_tag must be a JSON object, got bool"),
        ({"kind": "ebnf", "spec": b'root ::= "a"'}, "spec must be a string"),
    ],
)
def test_structured_output_rejects_malformed_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)


def test_sampling_params_take_only_a_structured_output():
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"type": "json_object"})
    schema = StructuredOutput.json_schema({"b": 1, "a": {"type": "object"}})
    assert schema == StructuredOutput("json_schema", '{"b": 1, "a": {"type": "object"}}')
    assert SamplingParams(structured_output=schema).structured_output is schema


def test_xgrammar_reason_drops_the_source_location():
    error = RuntimeError('[03:05:30] /project/cpp/json_schema_converter.cc:5082: Unsupported type "strin"')
    assert xgrammar_reason(error) == 'Unsupported type "strin"'
    check = RuntimeError("[03:05:30] /p/g.cc:1: Check failed: (x) is false: Structural tag must have a format field")
    assert xgrammar_reason(check) == "Structural tag must have a format field"


# -- outputs --------------------------------------------------------------------------------------


def test_json_object_outputs_parse_as_objects(engine):
    outputs = engine.generate(
        [f"object {i}" for i in range(6)], [constrained(StructuredOutput.json_object(), seed=i) for i in range(6)]
    )
    finished = [out for out in outputs if out.finish_reason == "stop"]
    assert finished, "no output completed its JSON object within max_tokens"
    for out in finished:
        assert isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(engine, name):
    schema = SCHEMAS[name]
    params = [constrained(StructuredOutput.json_schema(schema), seed=i) for i in range(2)]
    params.append(constrained(StructuredOutput.json_schema(schema), temperature=0.0))
    for out in engine.generate([f"{name} {i}" for i in range(3)], params):
        # Every schema here bounds the output's size, so each one completes.
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert validation_errors(value, schema) == [], out.text
        # The grammar's stop token ends it and adds no text.
        assert out.token_ids[-1] in engine.eos_token_ids


def test_each_of_n_choices_has_its_own_matcher(engine):
    [out] = engine.generate("choices", constrained(StructuredOutput.json_schema(SCHEMAS["enums"]), n=3, seed=7))
    values = []
    for choice in out.outputs:
        assert choice.finish_reason == "stop"
        values.append(json.loads(choice.text))
        assert validation_errors(values[-1], SCHEMAS["enums"]) == []
    assert len({choice.text for choice in out.outputs}) > 1  # they were sampled independently


def test_ebnf_grammar(engine):
    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    outputs = engine.generate(["a", "b", "c"], [constrained(StructuredOutput.ebnf(grammar), seed=i) for i in range(3)])
    for out in outputs:
        assert out.finish_reason == "stop"
        word, number = out.text.split(" ")
        assert word in ("yes", "no") and number.isdigit() and len(number) <= 2


def test_structural_tag(engine):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "end": "</answer>",
            "content": {"type": "json_schema", "json_schema": SCHEMAS["required_only"]},
        },
    }
    [out] = engine.generate("tag", constrained(StructuredOutput.structural_tag(tag), seed=3))
    assert out.finish_reason == "stop"
    assert out.text.startswith("<answer>") and out.text.endswith("</answer>")
    value = json.loads(out.text[len("<answer>") : -len("</answer>")])
    assert validation_errors(value, SCHEMAS["required_only"]) == []


def test_max_tokens_cut_ends_with_length(engine):
    [out] = engine.generate("cut", constrained(StructuredOutput.json_schema(SCHEMAS["nested"]), max_tokens=6))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 6
    assert out.text.startswith("{")


def test_logprobs_are_those_of_the_raw_logits(engine):
    params = constrained(StructuredOutput.json_schema(SCHEMAS["enums"]), temperature=0.0, logprobs=3)
    [out] = engine.generate("logprobs", params)
    assert out.finish_reason == "stop"
    logprobs = out.outputs[0].logprobs
    assert [lp.token_id for lp in logprobs] == out.token_ids
    # The grammar forces '{' first; the raw distribution of a random model prefers other tokens.
    first = logprobs[0]
    assert first.top_logprobs[0][0] != first.token_id
    assert first.logprob < first.top_logprobs[0][1]


def test_min_tokens_does_not_fight_the_grammar(engine):
    # The grammar's output is a handful of tokens; banning EOS until 50 would leave no token allowed.
    params = constrained(StructuredOutput.ebnf('root ::= "ok"'), min_tokens=50)
    [out] = engine.generate("min", params)
    assert out.finish_reason == "stop" and out.text == "ok"


# -- mixed batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_leaves_unconstrained_rows_unchanged(checkpoint, async_scheduling):
    engine = LLMEngine(checkpoint, num_kv_blocks=256, max_model_len=1024, async_scheduling=async_scheduling)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = ["free one", "free two"]
    alone = [out.token_ids for out in engine.generate(prompts, free)]
    schema = StructuredOutput.json_schema(SCHEMAS["arrays"])
    mixed = engine.generate(
        [prompts[0], "constrained greedy", prompts[1], "constrained sampled"],
        [free, constrained(schema, temperature=0.0), free, constrained(schema, seed=5)],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    for out in (mixed[1], mixed[3]):
        assert out.finish_reason == "stop"
        assert validation_errors(json.loads(out.text), SCHEMAS["arrays"]) == []
    # Nothing is left behind: finished requests drop their matchers.
    assert len(engine.grammar_matchers) == 0


def test_sync_and_async_scheduling_agree_on_constrained_outputs(checkpoint):
    schema = StructuredOutput.json_schema(SCHEMAS["nested"])
    params = [
        constrained(schema, seed=1),
        constrained(schema, temperature=0.0),
        SamplingParams(temperature=0.0, max_tokens=30),
    ]
    runs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(checkpoint, num_kv_blocks=256, max_model_len=1024, async_scheduling=async_scheduling)
        runs.append([out.token_ids for out in engine.generate(["x", "y", "z"], params)])
    assert runs[0] == runs[1]


def test_preemption_keeps_matchers_in_step_with_outputs(checkpoint):
    """A pool too small for every sequence forces recompute; the grammars must not see a token twice."""
    schema = StructuredOutput.json_schema(SCHEMAS["enums"])
    prompts = [f"preempt {i} " * 4 for i in range(4)]
    # Compact JSON (no runs of blanks) is short: a pool of 10 blocks of 16 holds one sequence but
    # not four prompts of ~40 tokens growing by ~50 each.
    params = [constrained(schema, temperature=0.0, max_tokens=80) for _ in prompts]
    roomy = LLMEngine(checkpoint, num_kv_blocks=256, max_model_len=128, async_scheduling=True)
    expected = [out.token_ids for out in roomy.generate(prompts, params)]
    tight = LLMEngine(checkpoint, num_kv_blocks=10, max_model_len=128, async_scheduling=True)
    outputs = tight.generate(prompts, params)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == expected
    for out in outputs:
        assert out.finish_reason == "stop"
        assert validation_errors(json.loads(out.text), SCHEMAS["enums"]) == []


# -- bad input and the grammar cache --------------------------------------------------------------


@pytest.mark.parametrize(
    "structured, reason",
    [
        (StructuredOutput.json_schema({"type": "strin"}), 'invalid json_schema: Unsupported type "strin"'),
        (StructuredOutput.json_schema({"$ref": "#/definitions/missing"}), "invalid json_schema: .*missing"),
        (StructuredOutput.ebnf("root ::= undefined_rule"), 'invalid ebnf: .*Rule "undefined_rule" is not defined'),
        (StructuredOutput.structural_tag({"type": "structural_tag"}), "invalid structural_tag: .*format"),
    ],
)
def test_bad_grammar_is_refused_at_admission(engine, structured, reason):
    with pytest.raises(ValueError, match=f"structured_output: {reason}"):
        engine.add_request("bad", "prompt", constrained(structured))
    assert not engine.has_unfinished_requests()
    # The engine carries on, and the refused id is free again.
    [out] = engine.generate("after", SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out.token_ids) == 3


def test_grammars_compile_once_per_distinct_spec(checkpoint):
    engine = LLMEngine(checkpoint, num_kv_blocks=256, max_model_len=1024)
    schema = SCHEMAS["enums"]
    engine.generate("first", constrained(StructuredOutput.json_schema(schema), seed=1))
    grammars = engine.grammar_matchers.grammars
    assert (grammars.num_compiles, grammars.num_hits) == (1, 0)
    engine.generate("second", constrained(StructuredOutput.json_schema(dict(schema)), seed=2))
    assert (grammars.num_compiles, grammars.num_hits) == (1, 1)
    # Property order is part of the grammar (the output follows it): another order is another grammar.
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    [out] = engine.generate("third", constrained(StructuredOutput.json_schema(reordered), seed=2))
    assert list(json.loads(out.text)) == ["level", "size", "color"]
    assert (grammars.num_compiles, grammars.num_hits, len(grammars)) == (2, 1, 2)


async def test_the_async_engine_compiles_a_new_schema_off_the_engine_thread(checkpoint):
    """A new schema compiles in a worker thread while the engine loop keeps stepping; the engine
    thread's add_request then finds it cached. A bad schema is refused before it reaches the loop."""
    import threading

    from gpuworker.engine import AsyncLLMEngine

    engine = LLMEngine(checkpoint, num_kv_blocks=256, max_model_len=1024)
    compiled_on: list[str] = []
    grammars = engine._grammar_matchers().grammars
    compile_one = grammars._compile

    def recording(structured):
        compiled_on.append(threading.current_thread().name)
        return compile_one(structured)

    grammars._compile = recording
    async with AsyncLLMEngine(engine=engine) as served:
        outputs = [
            out
            async for out in served.generate(
                "x", constrained(StructuredOutput.json_schema(SCHEMAS["enums"]), seed=4), "a"
            )
        ]
        assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
        assert json.loads(outputs[-1].text)["color"] in SCHEMAS["enums"]["properties"]["color"]["enum"]
        with pytest.raises(ValueError, match="structured_output"):
            async for _ in served.generate("x", constrained(StructuredOutput("ebnf", "root ::= ")), "b"):
                pass
    assert compiled_on and "llm-engine" not in compiled_on
    assert (grammars.num_compiles, grammars.num_hits) == (1, 1)


def test_grammar_cache_evicts_the_least_recently_used(engine):
    cache = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids, max_entries=2)
    a, b, c = (StructuredOutput.ebnf(f'root ::= "{word}"') for word in "abc")
    first_a = cache.get(a)
    cache.get(b)
    assert cache.get(a) is first_a  # a is now the most recently used
    cache.get(c)  # evicts b
    assert len(cache) == 2 and cache.num_compiles == 3
    assert cache.get(a) is first_a
    cache.get(b)
    assert cache.num_compiles == 4


def test_model_vocab_larger_than_the_tokenizer(tmp_path):
    """lm_head rows beyond the tokenizer (padding) are never allowed."""
    from gpuworker.demo_model import write_tokenizer
    from tests.gpuworker.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path, "qwen3", tokenizer=False, vocab_size=512)
    tokenizer_size = 384
    write_tokenizer(path, tokenizer_size, 1024)
    engine = LLMEngine(path, num_kv_blocks=128, max_model_len=1024)
    assert engine.model_config.vocab_size == 512
    outputs = engine.generate(
        ["p", "q"], [constrained(StructuredOutput.json_schema(SCHEMAS["enums"]), seed=i) for i in range(2)]
    )
    for out in outputs:
        assert out.finish_reason == "stop"
        assert max(out.token_ids) < tokenizer_size
        assert validation_errors(json.loads(out.text), SCHEMAS["enums"]) == []


@pytest.mark.parametrize(
    "name, valid", [("ab", True), ("é€", True), ("a\tb", False), ("a\x03", False), ("", False), ("123456789", False)]
)
def test_length_bounded_strings_refuse_control_characters(engine, name, valid):
    """xgrammar's own grammar for a maxLength string admits raw control characters (invalid JSON)."""
    import xgrammar as xgr

    cache = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    matcher = xgr.GrammarMatcher(cache.get(StructuredOutput.json_schema(PERSON)))
    document = '{"name": "%s", "age": 7}' % name
    assert (matcher.accept_string(document) and matcher.is_completed()) is valid


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_mixed_batch_on_cuda(checkpoint):
    """The device path: pinned bitmask copied without blocking, xgrammar's Triton kernel, async steps."""
    engine = LLMEngine(checkpoint, device="cuda", num_kv_blocks=256, max_model_len=1024)
    assert engine.config.use_async_scheduling
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = engine.generate("free", free)[0].token_ids
    schema = StructuredOutput.json_schema(SCHEMAS["nested"])
    mixed = engine.generate(
        ["free", "constrained", "constrained"],
        [free, constrained(schema, temperature=0.0), constrained(schema, seed=1)],
    )
    assert mixed[0].token_ids == alone
    for out in mixed[1:]:
        assert out.finish_reason == "stop"
        assert validation_errors(json.loads(out.text), SCHEMAS["nested"]) == []


# -- whitespace -----------------------------------------------------------------------------------


def _longest_blank_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"\s+", text)), default=0)


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput.json_object(),
        StructuredOutput.json_schema(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                "required": ["a", "b"],
            }
        ),
    ],
    ids=["json_object", "json_schema"],
)
def test_json_grammars_allow_no_runs_of_blanks(engine, structured):
    # A random model fell into blanks: with 32 allowed in a row, most of a 64-token budget went on
    # them and the object was never closed. Schemas without strings: any blank is the grammar's.
    outputs = engine.generate(
        [f"object {i}" for i in range(8)], [constrained(structured, seed=i, max_tokens=64) for i in range(8)]
    )
    for out in outputs:
        assert _longest_blank_run(out.text) <= JSON_MAX_WHITESPACE == 1, out.text
    assert any(out.finish_reason == "stop" for out in outputs), [out.text for out in outputs]
