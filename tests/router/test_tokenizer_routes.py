"""/tokenize, /detokenize, /version and /v1/models/{id} through the router's real HTTP server
(scripted pool handles, no Ray), in vLLM's shapes; the oracle is the model's own tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.router.test_request_limits import CONTEXT, serve  # noqa: F401  (the fixture)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the lighthouse?"}]


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def test_tokenize_and_detokenize_answer_as_the_model_s_tokenizer_does(serve, tokenizer):  # noqa: F811
    text = "Lighthouses once burned wood and coal; later, oil lamps behind lenses."

    async def scenario(server, request):
        status, _, answer = await request("/tokenize", {"model": "smol", "prompt": text, "return_token_strs": True})
        ids = tokenizer.encode(text)
        assert status == 200 and answer["tokens"] == ids and answer["count"] == len(ids)
        assert answer["max_model_len"] == CONTEXT and answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
        status, _, answer = await request("/tokenize", {"messages": CHAT})  # model may be left out, as in vLLM
        chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert status == 200 and answer["tokens"] == list(chat_ids) and answer["token_strs"] is None
        status, _, answer = await request("/tokenize", {"messages": CHAT, "add_generation_prompt": False})
        plain = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True, return_dict=False)
        assert answer["tokens"] == list(plain) and len(plain) < len(chat_ids)
        status, _, answer = await request("/detokenize", {"model": "smol", "tokens": ids})
        assert status == 200 and answer == {"prompt": tokenizer.decode(ids)} and answer["prompt"] == text

    serve(scenario)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)
def test_a_bad_body_gets_openai_s_error_naming_the_field_and_the_server_serves_on(serve, path, body, status, param):  # noqa: F811
    async def scenario(server, request):
        got, _, error = await request(path, body)
        assert (got, error["error"]["param"]) == (status, param), error
        assert (await request("/tokenize", {"prompt": "still here"}))[0] == 200

    serve(scenario)


def test_the_model_card_carries_max_model_len_and_the_version_is_served(serve):  # noqa: F811
    async def scenario(server, request):
        status, _, card = await request("/v1/models/smol")
        assert status == 200 and (card["id"], card["object"], card["max_model_len"]) == ("smol", "model", CONTEXT)
        status, _, listing = await request("/v1/models")
        assert status == 200 and listing["data"] == [card]
        status, _, error = await request("/v1/models/gpt-9")
        assert status == 404 and error["error"]["code"] == "model_not_found"
        status, _, answer = await request("/version")
        assert status == 200 and isinstance(answer["version"], str) and answer["version"]

    serve(scenario)


def test_the_chat_template_s_options_render_as_transformers_renders_them(serve, tokenizer):  # noqa: F811
    continued = [*CHAT, {"role": "assistant", "content": "It stands on the"}]
    cases = [
        ({"messages": CHAT, "add_generation_prompt": False}, dict(add_generation_prompt=False)),
        (
            {"messages": continued, "add_generation_prompt": False, "continue_final_message": True},
            dict(add_generation_prompt=False, continue_final_message=True),
        ),
        ({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, dict(add_generation_prompt=True)),
    ]

    async def scenario(server, request):
        for body, hf_options in cases:
            status, _, answer = await request("/tokenize", body)
            expected = tokenizer.apply_chat_template(body["messages"], tokenize=True, return_dict=False, **hf_options)
            assert status == 200 and answer["tokens"] == list(expected), body
        # Continued: the assistant's message stays open, as the model is to go on with it.
        continued_ids = tokenizer.apply_chat_template(
            continued, tokenize=True, return_dict=False, add_generation_prompt=False, continue_final_message=True
        )
        assert tokenizer.decode(continued_ids).endswith("It stands on the")
        status, _, error = await request("/tokenize", {"messages": continued, "continue_final_message": True})
        assert status == 400 and error["error"]["param"] == "continue_final_message"  # with the generation prompt
        status, _, error = await request("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}})
        assert status == 400 and error["error"]["param"] == "chat_template_kwargs"

    serve(scenario)


def test_a_template_that_cannot_render_the_messages_is_the_client_s_400_not_a_500(serve):  # noqa: F811
    import jinja2

    async def scenario(server, request):
        real = server.tokenizer.apply_chat_template

        def refusing(messages, **options):
            if messages[-1]["content"] == "break":
                raise jinja2.exceptions.TemplateError("this template refuses it")
            return real(messages, **options)

        server.tokenizer.apply_chat_template = refusing
        body = {"model": "smol", "messages": [{"role": "user", "content": "break"}], "max_tokens": 2}
        status, _, error = await request("/v1/chat/completions", body)
        assert status == 400 and error["error"]["param"] == "messages" and "template" in error["error"]["message"]
        status, _, error = await request("/tokenize", {"messages": body["messages"]})
        assert status == 400 and error["error"]["param"] == "messages"
        assert (await request("/tokenize", {"messages": CHAT}))[0] == 200  # and it serves on

    serve(scenario)
