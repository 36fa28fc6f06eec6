"""The OpenAI-compatible API's mapping (specdec.openai_api), without Ray: request bodies to
GenerateRequests, refusals naming the field, and answers the official client's types accept."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from specdec import openai_api
from specdec.decoding.round_loop import Completion
from specdec.decoding.stats import SpeculationStats
from specdec.decoding.stopping import Delta
from specdec.errors import InvalidRequestError
from specdec.openai_api import CHAT, COMPLETIONS, OpenAIError, Responder, parse

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT_BODY = {"prompt": "def add(a, b):"}


def _body(endpoint, **fields):
    return {**(CHAT_BODY if endpoint == CHAT else PROMPT_BODY), **fields}


def _fields(request):
    return json_format.MessageToDict(request, preserving_proto_field_name=True)


def test_completion_fields_map_to_the_grpc_request():
    parsed = parse(
        COMPLETIONS,
        _body(
            COMPLETIONS,
            model="m",
            max_tokens=12,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            stop="\n\n",
            top_k=40,
            num_speculative_tokens=3,
            proposer="ngram",
            stop_token_ids=[2],
            user="someone",
        ),
    )
    assert _fields(parsed.request) == {
        "prompt": "def add(a, b):",
        "max_new_tokens": 12,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": "7",
        "stop": ["\n\n"],
        "top_k": 40,
        "num_speculative_tokens": 3,
        "proposer": "ngram",
        "stop_token_ids": [2],
    }
    assert parsed.model == "m" and not parsed.stream and not parsed.logprobs


def test_unset_fields_stay_unset_and_null_means_unset():
    parsed = parse(
        COMPLETIONS,
        _body(
            COMPLETIONS,
            temperature=None,
            num_speculative_tokens="auto",
            proposer=None,
            suffix=None,
            foo=None,
        ),
    )
    assert _fields(parsed.request) == {"prompt": "def add(a, b):"}
    assert not parsed.request.HasField("num_speculative_tokens")
    assert not parsed.request.HasField("proposer")  # the service's speculation.proposer


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_proposer_is_accepted_on_both_endpoints_and_checked_by_the_router(endpoint):
    for proposer in ("auto", "draft", "ngram", "none", "medusa"):
        request = parse(endpoint, _body(endpoint, proposer=proposer)).request
        assert request.HasField("proposer") and request.proposer == proposer


def test_chat_messages_text_parts_and_the_developer_role():
    parsed = parse(
        CHAT,
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": []},
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 0,
        },
    )
    assert [(m.role, m.content) for m in parsed.request.messages] == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", "ok"),
    ]
    assert parsed.request.max_new_tokens == 5 and parsed.max_tokens_param == "max_completion_tokens"
    assert parsed.logprobs and parsed.request.logprobs


def test_a_prompt_list_of_one_string_is_that_prompt():
    assert parse(COMPLETIONS, {"prompt": ["x"]}).request.prompt == "x"


def test_stream_options_include_usage():
    parsed = parse(CHAT, _body(CHAT, stream=True, stream_options={"include_usage": True}))
    assert parsed.stream and parsed.include_usage


NEUTRAL = [
    (COMPLETIONS, {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logprobs": 0}),
    (COMPLETIONS, {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}),
    (CHAT, {"n": 1, "tools": [], "tool_choice": "none", "functions": [], "logit_bias": {}}),
    (CHAT, {"function_call": "none", "response_format": {"type": "text"}, "top_logprobs": 0}),
]


@pytest.mark.parametrize("endpoint, fields", NEUTRAL)
def test_unsupported_fields_with_the_value_that_asks_for_nothing_are_accepted(endpoint, fields):
    """Accepted and ignored: the body parses to the request it parses to without them.
    (Completions' ``logprobs`` 0 asks for the chosen tokens' logprobs, so both bodies keep it.)"""
    kept = {name: value for name, value in fields.items() if name == "logprobs"}
    assert parse(endpoint, _body(endpoint, **fields)) == parse(endpoint, _body(endpoint, **kept))


BAD = [
    (COMPLETIONS, {"n": 2}, "n"),
    (CHAT, {"n": 3}, "n"),
    (COMPLETIONS, {"best_of": 2}, "best_of"),
    (COMPLETIONS, {"echo": True}, "echo"),
    (COMPLETIONS, {"suffix": "x"}, "suffix"),
    (COMPLETIONS, {"logprobs": 2}, "logprobs"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (CHAT, {"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -1}, "frequency_penalty"),
    (CHAT, {"logit_bias": {"1": 5}}, "logit_bias"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"parallel_tool_calls": True}, "parallel_tool_calls"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"echo": False}, "echo"),  # a completions field
    (COMPLETIONS, {"messages": []}, "messages"),
    (COMPLETIONS, {"foo": 1}, "foo"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    (CHAT, {"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    (CHAT, {"stream": "yes"}, "stream"),
    (COMPLETIONS, {"seed": -1}, "seed"),
    (COMPLETIONS, {"seed": 2**70}, "seed"),
    (COMPLETIONS, {"max_tokens": "ten"}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 2**40}, "max_tokens"),
    (CHAT, {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    (COMPLETIONS, {"temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"top_k": 1.5}, "top_k"),
    (COMPLETIONS, {"num_speculative_tokens": "fast"}, "num_speculative_tokens"),
    (COMPLETIONS, {"proposer": 1}, "proposer"),
    (CHAT, {"proposer": ["ngram"]}, "proposer"),
    (CHAT, {"proposer": True}, "proposer"),
    (COMPLETIONS, {"stop": [1]}, "stop"),
    (COMPLETIONS, {"stop_token_ids": "2"}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"model": 5}, "model"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name"),
    (CHAT, {"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
]


@pytest.mark.parametrize("endpoint, fields, param", BAD, ids=[p for _, _, p in BAD])
def test_bad_or_unsupported_fields_are_400_naming_the_field(endpoint, fields, param):
    with pytest.raises(OpenAIError) as err:
        parse(endpoint, _body(endpoint, **fields))
    error = err.value
    assert error.status == 400 and error.param == param
    body = error.body()["error"]
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert body["message"].startswith(param + ":") and body["code"]


def test_a_body_that_is_not_an_object_is_400():
    with pytest.raises(OpenAIError) as err:
        parse(CHAT, [1, 2])
    assert err.value.status == 400 and err.value.param is None


@pytest.mark.parametrize(
    "endpoint, fields, grpc_field, param",
    [
        (COMPLETIONS, {}, "max_new_tokens", "max_tokens"),
        (CHAT, {"max_completion_tokens": 0}, "max_new_tokens", "max_completion_tokens"),
        (CHAT, {}, "prompt", "messages"),
        (CHAT, {}, "messages[0].role", "messages[0].role"),
        (COMPLETIONS, {}, "temperature", "temperature"),
        (CHAT, {"proposer": "medusa"}, "proposer", "proposer"),
    ],
)
def test_router_validation_errors_name_the_openai_field(endpoint, fields, grpc_field, param):
    parsed = parse(endpoint, _body(endpoint, **fields))
    error = parsed.invalid(InvalidRequestError(grpc_field, "is wrong"))
    assert (error.status, error.param, error.message) == (400, param, f"{param}: is wrong")


def test_another_model_is_404_model_not_found():
    parsed = parse(CHAT, _body(CHAT, model="gpt-4"))
    with pytest.raises(OpenAIError) as err:
        parsed.check_model("tiny/target")
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")
    parse(CHAT, _body(CHAT, model="tiny/target")).check_model("tiny/target")
    parse(CHAT, CHAT_BODY).check_model("tiny/target")


def test_server_errors_have_type_server_error():
    assert OpenAIError(503, "no replica").body()["error"]["type"] == "server_error"


# --- answers -------------------------------------------------------------------------------


def _stats() -> SpeculationStats:
    return SpeculationStats(
        rounds=3,
        draft_tokens=4,
        accepted_tokens=3,
        accepted_per_position=[2, 1],
        drafted_per_position=[2, 2],
        ttft_s=0.1,
        completion_tokens=6,
        wall_time_s=0.5,
        ngram_rounds=1,
        ngram_draft_tokens=2,
        ngram_accepted_tokens=1,
    )


def _completion() -> Completion:
    return Completion(
        token_ids=[10, 11, 12, 13, 14, 2],
        text="abcde",
        finish_reason="stop",
        logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5, -0.6],
        prompt_tokens=4,
        stats=_stats(),
    )


def _token_text(token_id: int) -> str:
    return "</s>" if token_id == 2 else chr(ord("a") + token_id - 10)


def _responder(endpoint, **fields) -> Responder:
    return Responder(parse(endpoint, _body(endpoint, **fields)), "tiny/target", _token_text)


def test_completion_response_with_usage_logprobs_and_stats():
    answer = _responder(COMPLETIONS, logprobs=0).response(_completion())
    parsed = OpenAICompletion.model_validate(answer)  # the official client's own type
    assert parsed.object == "text_completion" and parsed.model == "tiny/target"
    assert parsed.id.startswith("cmpl-") and parsed.created > 0
    choice = parsed.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == ("abcde", "stop", 0)
    assert choice.logprobs.tokens == ["a", "b", "c", "d", "e", "</s>"]
    assert choice.logprobs.token_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    assert choice.logprobs.text_offset == [0, 1, 2, 3, 4, 5]
    assert choice.logprobs.top_logprobs is None
    assert parsed.usage.model_dump() == {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        "completion_tokens_details": None,
        "prompt_tokens_details": None,
    }
    stats = answer[openai_api.STATS_FIELD]
    assert stats == json_format.MessageToDict(
        _stats().to_proto(),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    assert stats["acceptance_rate"] == 0.75 and stats["mean_accepted_tokens"] == 2.5
    ngram = [stats[f"ngram_{name}"] for name in ("rounds", "draft_tokens", "accepted_tokens")]
    assert ngram == [1, 2, 1]
    json.dumps(answer)


def test_chat_response_with_logprobs():
    answer = _responder(CHAT, logprobs=True).response(_completion())
    parsed = ChatCompletion.model_validate(answer)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    choice = parsed.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", "abcde")
    first = choice.logprobs.content[0]
    assert (first.token, first.logprob, first.bytes, first.top_logprobs) == ("a", -0.1, [97], [])
    assert len(choice.logprobs.content) == 6
    assert _responder(CHAT).response(_completion())["choices"][0]["logprobs"] is None


def _delta(ids, text, finish=None):
    return Delta(ids, [-1.0] * len(ids), text, finish)


def test_chat_stream_chunks_role_content_finish_and_usage():
    responder = _responder(CHAT, stream=True, stream_options={"include_usage": True})
    chunks = [
        *responder.first_chunks(),
        *responder.delta_chunks(_delta([10, 11], "ab")),
        *responder.delta_chunks(_delta([12], "")),  # text held back: nothing to send
        *responder.delta_chunks(_delta([13, 14, 2], "cde", "stop")),
        *responder.final_chunks(_completion()),
    ]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert [c.choices[0].delta.role for c in parsed[:1]] == ["assistant"]
    assert "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) == "abcde"
    assert [c.choices[0].finish_reason for c in parsed[:-1]] == [None, None, None, "stop"]
    assert all(c.usage is None for c in parsed[:-1])
    assert parsed[-1].choices == [] and parsed[-1].usage.total_tokens == 10
    assert openai_api.STATS_FIELD in chunks[-2] and chunks[-2]["specdec_stats"]["rounds"] == 3
    assert len({c.id for c in parsed}) == 1


def test_completion_stream_chunks_carry_logprobs_and_running_offsets():
    responder = _responder(COMPLETIONS, stream=True, logprobs=0)
    chunks = [
        *responder.delta_chunks(_delta([10, 11], "ab")),
        *responder.delta_chunks(_delta([12], "")),  # held back, but its logprobs go out
        *responder.delta_chunks(_delta([13], "cd", "length")),
        *responder.final_chunks(_completion()),
    ]
    # The client's Completion type requires a finish_reason, which OpenAI's own stream chunks
    # leave null until the last one (the client builds stream chunks without validating).
    OpenAICompletion.model_validate(chunks[-1])
    choices = [c["choices"][0] for c in chunks]
    assert [c["logprobs"]["text_offset"] for c in choices[:3]] == [[0, 1], [2], [3]]
    assert [c["text"] for c in choices] == ["ab", "", "cd", ""]
    assert [c["finish_reason"] for c in choices] == [None, None, None, "stop"]
    assert all(c["object"] == "text_completion" for c in chunks) and "usage" not in chunks[-1]


def test_sse_events():
    assert openai_api.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert openai_api.DONE == b"data: [DONE]\n\n"


def test_the_shipped_local_config_serves_the_api_on_port_8000():
    pytest.importorskip("ray")
    from specdec.deployments.deploy import ServeConfig
    from specdec.tools.args import config_path

    assert ServeConfig.load(config_path("local.yaml")).http_base_url == "http://127.0.0.1:8000/v1"


def test_models_answers_while_no_draft_replica_has_answered():
    """A fresh router that has heard only from the target lists the model with draft_model
    null (it answered 500: the draft's info was None)."""
    import asyncio
    from types import SimpleNamespace

    from specdec.api_keys import ApiKeys
    from specdec.config import SpecdecConfig
    from specdec.deployments.http_api import OpenAIRoutes
    from specdec.v1 import worker_pb2

    target = worker_pb2.ReplicaInfo(name="/models/target", vocab_size=32, context_limit=256)

    async def model_info():
        return None, target

    router = SimpleNamespace(_model_info=model_info, config=SpecdecConfig(), api_keys=ApiKeys())
    response = asyncio.run(OpenAIRoutes.list_models(router, SimpleNamespace(headers={})))
    (model,) = json.loads(response.body)["data"]
    assert response.status_code == 200
    assert (model["id"], model["draft_model"], model["max_model_len"]) == (
        "/models/target",
        None,
        256,
    )


def _applied(defaults: openai_api.RequestDefaults, body: dict, context_limit: int = 256):
    request = parse(COMPLETIONS, {"prompt": "hi", **body}).request
    defaults.apply(request, context_limit)
    return request.temperature, request.top_p, request.top_k, request.max_new_tokens


def test_unset_http_fields_take_openais_defaults_and_run_to_the_context():
    """No generation_config values: temperature 1, top_p 1, no top-k (OpenAI's), and tokens up
    to the context limit (the router caps it to what the prompt leaves)."""
    defaults = openai_api.RequestDefaults.of({})
    assert _applied(defaults, {}) == (1.0, 1.0, 0, 256)
    assert _applied(defaults, {"temperature": 0, "max_tokens": 5}) == (0.0, 1.0, 0, 5)


def test_unset_http_fields_take_the_targets_generation_config_first():
    generation = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    defaults = openai_api.RequestDefaults.of(generation, default_max_tokens=100)
    assert _applied(defaults, {}) == (0.7, 0.8, 20, 100)
    # A request's own value wins, field by field.
    assert _applied(defaults, {"top_k": 0, "top_p": 1, "max_tokens": 9}) == (0.7, 1.0, 0, 9)
    # default_max_tokens never exceeds the context limit (it would be refused as the client's).
    assert _applied(defaults, {}, context_limit=64)[3] == 64
    # The model's own max_new_tokens comes before the service's default_max_tokens.
    with_limit = openai_api.RequestDefaults.of({"max_new_tokens": 30}, default_max_tokens=100)
    assert _applied(with_limit, {})[3] == 30


def test_generation_defaults_reads_the_sampling_fields_a_model_sets(tmp_path, caplog):
    from transformers import GenerationConfig

    from specdec.models.loading import generation_defaults

    assert generation_defaults(tmp_path) == {}  # no generation_config.json
    GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05
    ).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="specdec.models.loading"):
        assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert "repetition_penalty" in caplog.text  # not applied, and said so


def test_the_served_model_name_is_the_id_the_api_lists():
    import asyncio
    from types import SimpleNamespace

    from specdec.api_keys import ApiKeys
    from specdec.config import SpecdecConfig
    from specdec.deployments.http_api import OpenAIRoutes
    from specdec.v1 import worker_pb2

    target = worker_pb2.ReplicaInfo(name="/hub/snapshots/abc", vocab_size=32, context_limit=256)

    async def model_info():
        return None, target

    config = SpecdecConfig().with_settings(served_model_name="acme/coder")
    router = SimpleNamespace(_model_info=model_info, config=config, api_keys=ApiKeys())
    response = asyncio.run(OpenAIRoutes.list_models(router, SimpleNamespace(headers={})))
    assert json.loads(response.body)["data"][0]["id"] == "acme/coder"


def test_a_chat_template_setting_is_a_template_or_a_file(tmp_path):
    from specdec.errors import ModelLoadError
    from specdec.models.loading import read_chat_template

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert read_chat_template(inline) == inline
    (tmp_path / "t.jinja").write_text(inline)
    assert read_chat_template(str(tmp_path / "t.jinja")) == inline
    with pytest.raises(ModelLoadError, match="chat_template: neither a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
