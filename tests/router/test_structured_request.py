"""A request's output constraint and tools, as the router parses and checks them: every field that
asks for a constraint, the limits, the refusals naming their field; each tool_choice's constraint,
and the answers read back into OpenAI's tool calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.errors import InvalidRequestError
from common.structured_outputs import MAX_PATTERN_REPEATS, ConstraintKind, StructuredOutput, pattern_repeats
from router.protocol import ApiError, parse_chat_request, parse_completion_request
from router.structured_request import ConstraintLimits, check_tool_constraint, parse_constraint
from router.tool_calling import RequiredCalls, ToolCalling, finish_reason_with_calls
from router.tool_parsers import get_parser
from router.tool_request import parse_tools

MODEL = "m"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


def refused(parse, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT, ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            ConstraintKind.JSON,
            json.dumps(SCHEMA, separators=(",", ":"), sort_keys=True),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            ConstraintKind.JSON,
            json.dumps(SCHEMA, separators=(",", ":"), sort_keys=True),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, ConstraintKind.REGEX, "[0-9]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ConstraintKind.CHOICE, '["a", "b"]'),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, ConstraintKind.GRAMMAR, 'root ::= "x"'),
        ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, ""),
        (
            {"guided_json": json.dumps(SCHEMA)},
            ConstraintKind.JSON,
            json.dumps(SCHEMA, separators=(",", ":"), sort_keys=True),
        ),
        ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, ConstraintKind.REGEX, "a+"),
        ({"guided_choice": ['say "hi"', "bye"]}, ConstraintKind.CHOICE, '["say \\"hi\\"", "bye"]'),
        ({"guided_grammar": 'root ::= "y"'}, ConstraintKind.GRAMMAR, 'root ::= "y"'),
    ],
)
def test_every_field_asking_for_a_constraint_is_honoured_on_both_endpoints(fields, kind, spec):
    for parsed in (chat(**fields), parse_completion_request({"model": MODEL, "prompt": "p", **fields}, MODEL)):
        constraint = parsed.sampling.structured_output
        assert (constraint.kind, constraint.spec, constraint.any_whitespace) == (kind, spec, False)
    assert chat(response_format={"type": "text"}).sampling.structured_output is None
    loose = chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert loose.sampling.structured_output.any_whitespace


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"backend": "outlines", "regex": "a"}}, "structured_outputs.backend"),
        ({"structured_outputs": {"whitespace_pattern": " ", "regex": "a"}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"bogus": 1}}, "structured_outputs.bogus"),
        ({"guided_regex": "a", "guided_decoding_backend": "lm-format-enforcer"}, "guided_decoding_backend"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
        ({"guided_json": {"type": "string", "pattern": "a{50000}"}}, "guided_json"),
        ({"structured_outputs": {"regex": "[a-z]{1,3000}"}}, "structured_outputs.regex"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_sent(fields, param):
    error = refused(chat, **fields)
    assert error.param == param, (error.param, error.message)


def test_size_and_depth_limits_are_the_router_s():
    limits = ConstraintLimits(max_bytes=200, max_depth=4)
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    with pytest.raises(InvalidRequestError, match=r"router\.max_constraint_bytes") as caught:
        parse_constraint({"guided_json": big}, limits)
    assert caught.value.param == "guided_json"
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object"}}}}}
    with pytest.raises(InvalidRequestError, match=r"router\.max_schema_depth"):
        parse_constraint({"guided_json": deep}, limits)
    assert parse_constraint({"guided_json": {"type": "object"}}, limits).kind is ConstraintKind.JSON


def test_pattern_repeats_count_nesting_and_skip_escapes_and_classes():
    assert pattern_repeats(r"\d{3}-\d{4}") == 7
    assert pattern_repeats(r"((x{2}){3}){4}") == 2 * 12 + 3 * 4 + 4
    assert pattern_repeats(r"[a{9}]{3}\{5\}") == 3
    assert pattern_repeats("a{5,}") == 5 and pattern_repeats("(a|b){1,500}") == 500
    over = StructuredOutput(
        ConstraintKind.JSON, json.dumps({"properties": {"x": {"pattern": f"a{{{MAX_PATTERN_REPEATS + 1}}}"}}})
    )
    with pytest.raises(InvalidRequestError, match="repeat"):
        over.grammar()


def test_tools_and_tool_choice_are_checked_as_openai_checks_them():
    use = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}).tools
    assert (use.choice, use.name, use.names) == ("function", "get_time", frozenset({"get_weather", "get_time"}))
    assert use.function("get_time").parameters == {"type": "object", "properties": {}}
    assert chat(tools=[WEATHER]).tools.choice == "auto" and chat(tools=[WEATHER]).tools.parallel
    assert chat(tools=[WEATHER], parallel_tool_calls=False).tools.parallel is False
    assert chat(tools=[], tool_choice="none").tools is None
    for fields in (
        {"tools": [WEATHER, WEATHER]},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tools": [{"type": "retrieval"}]},
        {"tools": "get_weather"},
    ):
        assert refused(chat, **fields).param == "tools"
    for fields in (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"tool_choice": "required"},
    ):
        assert refused(chat, **fields).param == "tool_choice"
    assert refused(chat, tools=[WEATHER], parallel_tool_calls="yes").param == "parallel_tool_calls"
    completion = {"model": MODEL, "prompt": "p", "tools": [WEATHER]}
    assert refused(parse_completion_request, body=completion, served_model=MODEL).param == "tools"


def test_tool_messages_reach_the_template_with_their_calls_and_ids():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    parsed = parse_chat_request({"model": MODEL, "messages": messages}, MODEL).messages
    assert parsed[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ],
    }
    assert parsed[2] == {"role": "tool", "content": "cold", "tool_call_id": "c1"}
    bad_call = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]
    assert (
        refused(parse_chat_request, body={"model": MODEL, "messages": bad_call}, served_model=MODEL).param == "messages"
    )


def _matches(constraint: StructuredOutput, text: str) -> bool:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from engine.model_loader import resolve_model_dir

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(resolve_model_dir(None)))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(constraint.grammar()))
    return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)


def test_each_tool_choice_constrains_the_answer_and_reads_it_back():
    calling = ToolCalling.configure("hermes", True, None)
    use = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    required = calling.constrain(use, None)
    answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    assert _matches(required, answer) and not _matches(required, "[]")
    assert not _matches(required, '[{"name": "get_date", "parameters": {}}]')
    calls = RequiredCalls().parse(answer, use.names).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    single = calling.constrain(
        parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}), None
    )
    assert json.loads(single.spec)["maxItems"] == 1

    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    constraint = calling.constrain(named, None)
    assert json.loads(constraint.spec) == WEATHER["function"]["parameters"]
    reader = calling.reader(named)
    (call,) = reader.parse('{"city": "Oslo"}', named.names).tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    streamer = reader.streamer(named.names)
    pieces = [streamer.feed('{"ci'), streamer.feed('ty": "Oslo"}'), streamer.finish()]
    deltas = [delta for piece in pieces for delta in piece.tool_calls]
    assert deltas[0].id and deltas[0].name == "get_weather" and all(d.id is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"city": "Oslo"}'

    auto = parse_tools({"tools": [WEATHER]})
    tag = calling.constrain(auto, None)
    assert tag.kind is ConstraintKind.STRUCTURAL_TAG
    assert _matches(
        tag, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert calling.constrain(parse_tools({"tools": [WEATHER], "tool_choice": "none"}), None) is None
    with pytest.raises(InvalidRequestError, match="cannot be combined") as caught:
        calling.constrain(use, StructuredOutput(ConstraintKind.JSON_OBJECT))
    assert caught.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="enable-auto-tool-choice"):
        ToolCalling.configure("hermes", False, None).constrain(auto, None)


def test_finish_reason_is_tool_calls_under_auto_and_required_and_stop_under_a_named_function():
    assert finish_reason_with_calls(parse_tools({"tools": [WEATHER]}), 1, "stop") == "tool_calls"
    assert finish_reason_with_calls(parse_tools({"tools": [WEATHER]}), 0, "stop") == "stop"
    assert (
        finish_reason_with_calls(parse_tools({"tools": [WEATHER], "tool_choice": "required"}), 2, "stop")
        == "tool_calls"
    )
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert finish_reason_with_calls(named, 1, "stop") == "stop"


def test_the_parser_follows_the_template_and_special_markers_keep_special_tokens():
    template_ignoring_tools = "{% for m in messages %}{{ m.content }}{% endfor %}"
    hermes = ToolCalling.configure("auto", True, template_ignoring_tools)
    assert hermes.parser.name == "hermes" and hermes.template is not None and not hermes.keep_special_tokens
    mistral = ToolCalling.configure("auto", True, "{{ tools }}[TOOL_CALLS]", frozenset({"[TOOL_CALLS]"}))
    assert mistral.parser.name == "mistral" and mistral.template is None and mistral.keep_special_tokens
    use = parse_tools({"tools": [WEATHER]})
    from common.sampling_params import SamplingParams

    assert mistral.adjust_sampling(use, SamplingParams()).skip_special_tokens is False
    assert hermes.adjust_sampling(use, SamplingParams()).skip_special_tokens is True
    assert get_parser("qwen").name == "hermes"


def test_a_tool_schema_that_does_not_compile_or_is_too_big_is_a_400_naming_tools():
    calling = ToolCalling.configure("hermes", True, None)
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}},
    }
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):
        constraint = calling.constrain(parse_tools({"tools": [bad], "tool_choice": choice}), None)
        with pytest.raises(InvalidRequestError) as caught:
            check_tool_constraint(constraint, ConstraintLimits())
        assert caught.value.param == "tools"
    fine = calling.constrain(parse_tools({"tools": [WEATHER], "tool_choice": "required"}), None)
    check_tool_constraint(fine, ConstraintLimits())
    with pytest.raises(InvalidRequestError, match="max_constraint_bytes"):
        check_tool_constraint(fine, ConstraintLimits(max_bytes=64))
    jsonschema.Draft202012Validator.check_schema(json.loads(fine.spec))
