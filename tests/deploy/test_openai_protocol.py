"""Request validation into OpenAI's error shape, and the bodies the server sends back.

The expected shapes are OpenAI's published ones: the error object has message/type/param/code,
a type mismatch is a 400 invalid_request_error, and the official `openai` client's own models
parse the response bodies.
"""

from __future__ import annotations

import json

import pytest

from deploy.openai_protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    chat_choice,
    chat_logprobs,
    check_context,
    completion_body,
    completion_logprobs,
    parse_request,
    text_choice,
    usage,
)


def _parse(data, kind="completion"):
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    return parse_request(body, kind)


def _error(data, kind="completion") -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        _parse(data, kind)
    err = info.value
    body = err.body()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "\n" not in body["error"]["message"]
    return err


def test_valid_requests_parse():
    req = _parse({"model": "m", "prompt": "hi", "max_tokens": 5, "stop": "x", "vendor_extra": 1})
    assert isinstance(req, CompletionRequest)
    assert req.prompts() == ["hi"] and req.stop == ["x"] and req.max_tokens == 5
    assert _parse({"model": "m", "prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert _parse({"model": "m", "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    chat = _parse(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}],
                },
            ],
            "max_completion_tokens": 7,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "chat",
    )
    assert isinstance(chat, ChatCompletionRequest)
    assert chat.budget() == 7 and chat.include_usage
    assert chat.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": 7, "prompt": "x"}, "model"),
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
        (  # a string used to count as true
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": "no"}},
            "stream_options.include_usage",
        ),
        # past int64 the step's wire format failed, and with it every request on the replica
        ({"model": "m", "prompt": "x", "top_k": 2**63}, "top_k"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_param(data, param):
    err = _error(data)
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param
    assert param in err.message


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": "hello"}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 2},
            "logprobs",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
            "top_logprobs",
        ),
    ],
)
def test_bad_chat_fields_are_400(data, param):
    err = _error(data, "chat")
    assert (err.status, err.param) == (400, param)


def test_logprob_options_parse():
    msgs = [{"role": "user", "content": "x"}]
    assert _parse({"model": "m", "prompt": "x", "logprobs": 5}).logprobs == 5
    assert _parse({"model": "m", "prompt": "x", "logprobs": 0}).logprobs == 0
    chat = _parse({"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 3}, "chat")
    assert chat.logprobs_asked() == 3
    assert _parse({"model": "m", "messages": msgs, "logprobs": True}, "chat").logprobs_asked() == 0
    assert _parse({"model": "m", "messages": msgs}, "chat").logprobs_asked() is None
    # OpenAI refuses top_logprobs without logprobs: true.
    err = _error({"model": "m", "messages": msgs, "top_logprobs": 2}, "chat")
    assert err.status == 400 and "logprobs" in err.message


def test_logprob_bodies_parse_with_the_official_openai_models():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    tokens = [
        {
            "token": " a",
            "bytes": [32, 97],
            "logprob": -0.5,
            "top": [{"token": " a", "bytes": [32, 97], "logprob": -0.5}],
        },
        {
            "token": "bc",
            "bytes": [98, 99],
            "logprob": -1.5,
            "top": [{"token": "x", "bytes": [120], "logprob": -0.25}],
        },
    ]
    lp = completion_logprobs(tokens, offset=3)
    assert lp["text_offset"] == [3, 5]  # 3, then 3 + len(" a")
    comp = Completion.model_validate(
        completion_body(
            request_id="cmpl-1",
            model="m",
            choices=[text_choice(0, " abc", "length", lp)],
            usage_=usage(1, 2, 0),
            chat=False,
        )
    )
    got = comp.choices[0].logprobs
    assert got.tokens == [" a", "bc"] and got.token_logprobs == [-0.5, -1.5]
    assert got.top_logprobs == [{" a": -0.5}, {"x": -0.25}]
    chat = ChatCompletion.model_validate(
        completion_body(
            request_id="chatcmpl-1",
            model="m",
            choices=[chat_choice(0, " abc", "stop", delta=False, logprobs=chat_logprobs(tokens))],
            usage_=usage(1, 2, 0),
            chat=True,
        )
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [" a", "bc"] and content[1].bytes == [98, 99]
    assert content[1].top_logprobs[0].token == "x" and content[1].top_logprobs[0].logprob == -0.25


def test_malformed_bodies():
    assert _error(b"{not json").status == 400
    assert "not valid JSON" in _error(b"{not json").message
    assert _error(b"[1, 2]").status == 400
    assert _error(b"\xff\xfe").status == 400
    nested = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested too deeply" in _error(nested).message  # was a RecursionError: a 500


def test_error_messages_echo_at_most_a_short_piece_of_the_input():
    err = _error({"model": "m", "prompt": "x", "stop": ["a" * 100_000, ""]})
    assert err.param == "stop" and len(err.message) < 400
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]}
    err = _error({**chat, "top_logprobs": 1}, "chat")  # a check across fields: no 'None'
    assert len(err.message) < 400 and "None" not in err.message and "top_logprobs" in err.message
    big = json.dumps({"model": "m", "prompt": "a" * MAX_BODY_BYTES}).encode()
    err = _error(big)
    assert (err.status, err.code) == (413, "request_too_large")


def test_context_limit():
    check_context(1000, 24, 1024, "prompt")
    with pytest.raises(ProtocolError) as info:
        check_context(1000, 25, 1024, "max_tokens")
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    assert "1024" in err.message and "1000" in err.message


def test_error_types_by_status():
    assert ProtocolError(401, "x").type == "authentication_error"
    assert ProtocolError(404, "x", code="model_not_found").type == "invalid_request_error"
    assert ProtocolError(503, "x").type == "server_error"


def test_bodies_parse_with_the_official_openai_models():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    u = usage(10, 4, 8)
    assert u["total_tokens"] == 14
    comp = Completion.model_validate(
        completion_body(
            request_id="cmpl-1",
            model="m",
            choices=[text_choice(0, "abc", "length")],
            usage_=u,
            chat=False,
        )
    )
    assert comp.choices[0].text == "abc" and comp.usage.prompt_tokens_details.cached_tokens == 8
    chat = ChatCompletion.model_validate(
        completion_body(
            request_id="chatcmpl-1",
            model="m",
            choices=[chat_choice(0, "hi", "stop", delta=False)],
            usage_=u,
            chat=True,
        )
    )
    assert chat.choices[0].message.content == "hi" and chat.object == "chat.completion"
    chunk = ChatCompletionChunk.model_validate(
        completion_body(
            request_id="chatcmpl-1",
            model="m",
            choices=[chat_choice(0, "h", None, delta=True)],
            usage_=None,
            chat=True,
            chunk=True,
        )
    )
    assert chunk.choices[0].delta.content == "h" and chunk.usage is None
