"""Tool-call parsers: real-format answers parsed whole and streamed in every chunking, their
structural tags compiled by xgrammar against the SmolLM2 tokenizer, the registry and the Hermes
chat template."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import xgrammar
from transformers import AutoTokenizer

from router.tool_parsers import ALIASES, PARSERS, ParsedOutput, ToolCall, ToolParser, detect_parser, get_parser
from router.tool_parsers.hermes import HermesParser
from router.tool_parsers.llama3_json import Llama3JsonParser
from router.tool_parsers.mistral import MistralParser

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = {"city": "Paris"}
ROME = {"city": "Rome", "unit": "celsius"}
HERMES_TEMPLATE = Path(__file__).resolve().parents[2] / "common" / "chat_templates" / "hermes_tools.jinja"


def hermes_block(name: str, arguments: dict, sep: str = "\n") -> str:
    return f'<tool_call>{sep}{{"name": "{name}", "arguments": {json.dumps(arguments)}}}{sep}</tool_call>'


# (parser name, case id, answer, expected content, expected calls as (name, arguments object))
CASES = [
    ("hermes", "single", hermes_block("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    (
        "hermes",
        "parallel",
        hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_weather", ROME),
        None,
        [("get_weather", WEATHER), ("get_weather", ROME)],
    ),
    (
        "hermes",
        "content_then_call",
        "I'll check the weather.\n\n" + hermes_block("get_weather", WEATHER) + "\n",
        "I'll check the weather.",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        "content_around_calls",
        "First.\n" + hermes_block("get_time", {}, sep="") + "\nThen <b>more</b>.\n" + hermes_block("get_weather", ROME),
        "First.\n\nThen <b>more</b>.",
        [("get_time", {}), ("get_weather", ROME)],
    ),
    (
        "hermes",
        "no_call",
        "It is sunny in Paris < 30°C, no <tool> needed.",
        "It is sunny in Paris < 30°C, no <tool> needed.",
        [],
    ),
    (
        "hermes",
        "malformed_json",
        'Try: <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        'Try: <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        [],
    ),
    (
        "hermes",
        "unknown_name",
        hermes_block("launch_rocket", {}) + hermes_block("get_time", {}),
        hermes_block("launch_rocket", {}),
        [("get_time", {})],
    ),
    (
        "hermes",
        "unterminated_complete",
        'Sure.<tool_call>\n  {"name": "get_weather", "arguments": {"city": "Zürich"}}  \n',
        "Sure.",
        [("get_weather", {"city": "Zürich"})],
    ),
    (
        "hermes",
        "unterminated_partial",
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        [],
    ),
    ("hermes", "whitespace_only", "  \n ", None, []),
    ("hermes", "partial_marker_at_end", "Almost a <tool_ca", "Almost a <tool_ca", []),
    (
        "hermes",
        "string_arguments",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        "single",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        "python_tag_parallel",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER), ("get_weather", ROME)],
    ),
    (
        "llama3_json",
        "leading_whitespace_braces_in_strings",
        '\n {"name": "get_time", "parameters": {"zone": "a}b{\\"c"}}',
        None,
        [("get_time", {"zone": 'a}b{"c'})],
    ),
    ("llama3_json", "no_call", "Paris is sunny today.", "Paris is sunny today.", []),
    (
        "llama3_json",
        "call_quoted_in_content",
        'You could call {"name": "get_weather", "parameters": {"city": "Paris"}}',
        'You could call {"name": "get_weather", "parameters": {"city": "Paris"}}',
        [],
    ),
    (
        "llama3_json",
        "malformed_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    (
        "llama3_json",
        "unknown_name",
        '<|python_tag|>{"name": "launch_rocket", "parameters": {}}',
        '<|python_tag|>{"name": "launch_rocket", "parameters": {}}',
        [],
    ),
    (
        "llama3_json",
        "call_then_text",
        '{"name": "get_time", "parameters": {}}\n\nDone.',
        "Done.",
        [("get_time", {})],
    ),
    (
        "llama3_json",
        "valid_then_invalid",
        '{"name": "get_time", "parameters": {}}; {"name": "nope", "parameters": {}}',
        '; {"name": "nope", "parameters": {}}',
        [("get_time", {})],
    ),
    ("llama3_json", "dangling_separator", '{"name": "get_time", "parameters": {}};', None, [("get_time", {})]),
    ("llama3_json", "python_code", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", "partial_tag_at_end", "<|python", "<|python", []),
    (
        "mistral",
        "list_single",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        "list_parallel_with_content",
        'Checking both. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]',
        "Checking both.",
        [("get_weather", WEATHER), ("get_weather", ROME)],
    ),
    (
        "mistral",
        "args_parallel",
        'Sure[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS] {}',
        "Sure",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("mistral", "no_call", "Paris: sunny [TOOL] [ARGS] {}", "Paris: sunny [TOOL] [ARGS] {}", []),
    (
        "mistral",
        "list_malformed",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": ]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": ]',
        [],
    ),
    (
        "mistral",
        "list_unknown_name",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        [],
    ),
    (
        "mistral",
        "args_unknown_name",
        '[TOOL_CALLS]nope[ARGS]{"a": 1}[TOOL_CALLS]get_time[ARGS]{}',
        '[TOOL_CALLS]nope[ARGS]{"a": 1}',
        [("get_time", {})],
    ),
    (
        "mistral",
        "marker_then_prose",
        "[TOOL_CALLS] is how I would call tools. [TOOL_CALLS]get_time[ARGS]{}",
        "[TOOL_CALLS] is how I would call tools.",
        [("get_time", {})],
    ),
    (
        "mistral",
        "unterminated",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        [],
    ),
    ("mistral", "partial_marker_at_end", "Done. [TOOL_CA", "Done. [TOOL_CA", []),
]
CASE_IDS = [f"{parser}-{case}" for parser, case, *_ in CASES]
ID_SHAPES = {"hermes": r"call_[A-Za-z0-9]{24}", "llama3_json": r"call_[A-Za-z0-9]{24}", "mistral": r"[A-Za-z0-9]{9}"}


def expected_calls(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def streamed(parser: ToolParser, chunks: list[str]) -> ParsedOutput:
    """Feeds the chunks to a fresh streamer and assembles its pieces as a client would."""
    streamer = parser.streamer(NAMES)
    pieces = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    for delta in (delta for piece in pieces for delta in piece.tool_calls):
        if delta.index not in calls:
            assert delta.id is not None and delta.name is not None, "a call's first delta carries its id and name"
            assert delta.index == len(calls), "calls are numbered in order"
            calls[delta.index], ids[delta.index], names[delta.index] = [], delta.id, delta.name
        else:
            assert delta.id is None and delta.name is None
        calls[delta.index].append(delta.arguments)
    content = "".join(piece.content for piece in pieces)
    assembled = tuple(ToolCall(ids[i], names[i], "".join(calls[i])) for i in calls)
    return ParsedOutput(content or None, assembled)


def same(left: ParsedOutput, right: ParsedOutput) -> bool:
    return left.content == right.content and [(c.name, c.arguments) for c in left.tool_calls] == [
        (c.name, c.arguments) for c in right.tool_calls
    ]


@pytest.mark.parametrize(("parser_name", "case", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_parse_reads_each_format_s_real_answers(parser_name, case, text, content, calls):
    parsed = get_parser(parser_name).parse(text, NAMES)
    assert parsed.content == content
    assert expected_calls(parsed) == calls
    for call in parsed.tool_calls:
        assert re.fullmatch(ID_SHAPES[parser_name], call.id), call.id
        assert json.loads(call.arguments) is not None and "\\u00fc" not in call.arguments  # ensure_ascii=False
    assert len({call.id for call in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize(("parser_name", "case", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_streaming_matches_parse_at_every_split_and_in_random_chunks(parser_name, case, text, content, calls):
    parser = get_parser(parser_name)
    whole = parser.parse(text, NAMES)
    for split in range(len(text) + 1):
        got = streamed(parser, [text[:split], text[split:]])
        assert same(got, whole), f"split at {split}: {got} != {whole}"
    assert same(streamed(parser, list(text)), whole), "one character at a time"
    rng = random.Random(1234)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert same(streamed(parser, chunks), whole), f"chunks {chunks}"


@pytest.mark.parametrize(
    ("parser", "prefix", "shown_first", "rest"),
    [
        (HermesParser(), "Let me look. <tool_", "Let me look.", "call>"),
        (MistralParser(), "Let me look. [TOOL_C", "Let me look.", "ALLS]"),
        (Llama3JsonParser(), " <|python_", "", "tag|>"),
    ],
)
def test_a_possible_marker_is_held_back_and_text_before_it_is_shown_at_once(parser, prefix, shown_first, rest):
    streamer = parser.streamer(NAMES)
    assert streamer.feed(prefix).content == shown_first
    assert streamer.feed(rest).content == ""  # the marker is whole: a call may follow
    assert streamer.finish().tool_calls == ()


def test_plain_text_streams_as_it_arrives():
    streamer = HermesParser().streamer(NAMES)
    assert streamer.feed("It is ").content == "It is"  # the space waits for what follows
    assert streamer.feed("sunny.").content == " sunny."
    assert streamer.finish().content == ""


# ---- structural tags -------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]

# parser -> (one well-formed call of get_weather, the same call written for get_time's slot)
CALL_TEXT = {
    "hermes": lambda name, args: f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
    "llama3_json": lambda name, args: f'{{"name": "{name}", "parameters": {args}}}',
    "mistral": lambda name, args: f"[TOOL_CALLS]{name}[ARGS]{args}",
}


@pytest.fixture(scope="module")
def compiler(smol_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer))


def accepts(compiled: xgrammar.CompiledGrammar, text: str, *, must_end: bool = True) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled)
    if not matcher.accept_string(text):
        return False
    if not must_end:
        return True
    stop = compiled.tokenizer_info.stop_token_ids[0]
    return matcher.accept_token(stop) and matcher.is_terminated()


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_structural_tag_constrains_calls_to_the_format_and_schema(parser_name, compiler):
    parser = get_parser(parser_name)
    call = CALL_TEXT[parser_name]
    tag = parser.structural_tag(TOOLS, parallel=True)
    assert tag is not None and tag["type"] == "structural_tag"
    xgrammar.Grammar.from_structural_tag(json.dumps(tag))  # a valid structural tag on its own
    compiled = compiler.compile_structural_tag(tag)

    good = call("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert accepts(compiled, good)
    assert expected_calls(parser.parse(good, NAMES)) == [("get_weather", ROME | {"city": "Paris"})]
    assert accepts(compiled, call("get_time", '{"zone": "UTC"}')), "a missing schema allows any object"
    assert not accepts(compiled, call("get_weather", '{"town": "Paris"}'), must_end=False), "schema violated"
    assert not accepts(compiled, call("get_weather", '{"city": "Paris", "unit": "kelvin"}'), must_end=False)
    assert not accepts(compiled, call("launch_rocket", "{}"), must_end=False), "unknown function"
    assert accepts(compiled, "The weather is fine, no call needed.")

    separator = {"hermes": "\n", "llama3_json": "; ", "mistral": ""}[parser_name]
    two = call("get_weather", '{"city": "Paris"}') + separator + call("get_time", "{}")
    assert accepts(compiled, two)
    assert len(parser.parse(two, NAMES).tool_calls) == 2
    single = compiler.compile_structural_tag(parser.structural_tag(TOOLS, parallel=False))
    assert accepts(single, call("get_weather", '{"city": "Paris"}'))
    assert not accepts(single, two, must_end=False), "one call at most"


def test_mistral_structural_tag_also_allows_the_list_layout(compiler):
    compiled = compiler.compile_structural_tag(MistralParser().structural_tag(TOOLS, parallel=True))
    listed = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    )
    assert accepts(compiled, "Let me check. " + listed)
    assert not accepts(compiled, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"town": "P"}}]', must_end=False)


def test_llama_structural_tag_allows_the_python_tag_but_no_text_after_calls(compiler):
    compiled = compiler.compile_structural_tag(Llama3JsonParser().structural_tag(TOOLS, parallel=True))
    assert accepts(compiled, '<|python_tag|>{"name": "get_time", "parameters": {}}')
    assert not accepts(compiled, '{"name": "get_time", "parameters": {}} and more', must_end=False)


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_no_function_tools_means_no_structural_tag(parser_name):
    assert get_parser(parser_name).structural_tag([], parallel=True) is None


# ---- registry, detection, chat template ------------------------------------------------------


def test_registry_names_and_aliases_follow_vllm():
    assert {name: type(get_parser(name)).name for name in PARSERS} == {name: name for name in PARSERS}
    for alias, target in ALIASES.items():
        assert get_parser(alias).name == target
    assert {"qwen", "qwen2_5", "qwen3", "llama", "llama3", "llama4_json"} <= set(ALIASES)
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'pythonic'.*hermes.*llama3_json.*mistral"):
        get_parser("pythonic")


LLAMA31_TEMPLATE_PART = (
    "{%- if builtin_tools is defined or tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- '<|python_tag|>' + tool_call.name }}"
)
LLAMA32_TEMPLATE_PART = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
)
MISTRAL_TEMPLATE_PART = "{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{{- '[TOOL_CALLS]' }}"


def test_detect_parser_reads_the_chat_template(smol_dir):
    assert detect_parser(HERMES_TEMPLATE.read_text()) == "hermes"
    assert detect_parser(MISTRAL_TEMPLATE_PART) == "mistral"
    assert detect_parser(LLAMA31_TEMPLATE_PART) == "llama3_json"
    assert detect_parser(LLAMA32_TEMPLATE_PART.replace("ipython", "")) == "llama3_json"
    assert detect_parser(AutoTokenizer.from_pretrained(smol_dir).chat_template) is None  # SmolLM2: no tools
    assert detect_parser(None) is None and detect_parser("") is None


def test_hermes_template_renders_tools_calls_and_results(smol_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}},
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(ROME)},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24°C"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=HERMES_TEMPLATE.read_text(), tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    tools_block = text[text.index("<tools>\n") + len("<tools>\n") : text.index("\n</tools>")]
    assert [json.loads(line) for line in tools_block.split("\n")] == TOOLS
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>' in text
    assistant = text[
        text.index("<|im_start|>assistant\n") : text.index("<|im_end|>\n<|im_start|>user\n<tool_response>")
    ]
    assert HermesParser().parse(assistant.removeprefix("<|im_start|>assistant\n"), NAMES).tool_calls[1].arguments == (
        json.dumps(ROME)
    )
    assert (
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\n24°C\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(
        messages[:2], chat_template=HERMES_TEMPLATE.read_text(), tokenize=False, add_generation_prompt=False
    )
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
