"""`smc-sd serve`: the server runs as a subprocess on a free loopback port (`--port 0`) over the
default model (marker `model`), and the tests talk to it with the official `openai` client (raw
HTTP with urllib where the client cannot send the request). Each server is stopped by its own
process handle. The app's answers when the engine has died and the stream's text deltas are
tested in-process, without a model.

The same seed alone on the engine gives the same output, so a streamed answer and a whole one
for one seed can be compared exactly; every test here runs its requests one at a time except
the concurrency test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time
import types

import jsonschema
import openai
import pytest

from smc_sd.constraints.json_depth import MAX_JSON_DEPTH
from smc_sd.serve.metrics import METRICS
from tests.serve_process import MODEL, ServerProcess, http
from tests.test_json_depth import nested_objects, nested_objects_text

model = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--max-running", "16")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def smc(choice) -> dict:
    """The choice's smc object (an extra field of the client's pydantic model)."""
    return choice.model_extra["smc"]


@model
def test_models_health_and_metrics(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert server.get("/health") == (200, "")
    values = server.metrics()
    assert {f"smc_sd_{key}" for key, _, _ in METRICS} <= set(values)
    assert values["smc_sd_requests_running"] == 0 and values["smc_sd_requests_waiting"] == 0


@model
def test_chat_and_completion_answer_with_their_smc_diagnostics(server, client):
    before = server.metrics()
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=3,
                                            extra_body={"particles": 3, "draft_len": 2, "return_particles": True})
    (choice,) = answer.choices
    assert answer.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert 1 <= answer.usage.completion_tokens <= 12 and answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    info = smc(choice)
    assert info["method"] == "smc-sd" and info["seed"] == 3 and info["n_particles"] == 3 and info["complete"]
    assert len(info["ess"]) == info["target_passes"] >= 1 and all(1 <= e <= 3 + 1e-9 for e in info["ess"])
    assert info["log_z"] is not None and 0 < info["acceptance"] <= 1
    weights = [p["weight"] for p in info["particles"]]
    assert len(weights) == 3 and abs(sum(weights) - 1) < 1e-9
    assert choice.message.content in {p["text"] for p in info["particles"] if p["weight"] > 0}
    after = server.metrics()
    assert after["smc_sd_target_passes_total"] - before["smc_sd_target_passes_total"] >= info["target_passes"]
    # the same seed again: the same answer
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=3,
                                           extra_body={"particles": 3, "draft_len": 2})
    assert again.choices[0].message.content == choice.message.content

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, seed=1,
                                           extra_body={"method": "ar"})
    assert completion.object == "text_completion" and completion.choices[0].text
    assert smc(completion.choices[0])["method"] == "ar" and smc(completion.choices[0])["acceptance"] is None


@model
def test_n_choices_run_with_seeds_seed_plus_i(client):
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, seed=10, n=3,
                                            extra_body={"method": "sd", "draft_len": 2})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [smc(c)["seed"] for c in answer.choices] == [10, 11, 12]
    assert all(0 <= smc(c)["acceptance"] <= 1 for c in answer.choices)


@model
@pytest.mark.parametrize("endpoint, extra, min_chunks", [
    # one particle: its tokens are final as they come, so the text flows cycle by cycle
    ("chat", {"particles": 1, "draft_len": 3}, 3),
    ("completion", {"method": "sd", "draft_len": 2}, 3),
    # four particles: only the prefix they all share is final; a stop string cuts the text
    ("chat", {"particles": 4, "draft_len": 2, "stop": [" is", "."]}, 1),
])
def test_stream_joins_to_the_non_streamed_text(endpoint, extra, min_chunks, client):
    settings = dict(model=MODEL, max_tokens=24, seed=5, extra_body=extra)
    if endpoint == "chat":
        create, settings["messages"] = client.chat.completions.create, QUESTION
        text_of = lambda chunk: chunk.choices[0].delta.content or ""
        whole_text = lambda answer: answer.choices[0].message.content
    else:
        create, settings["prompt"] = client.completions.create, "Paris is a city in"
        text_of = lambda chunk: chunk.choices[0].text
        whole_text = lambda answer: answer.choices[0].text
    whole = create(**settings)
    chunks = list(create(**settings, stream=True, stream_options={"include_usage": True}))
    with_choice = [c for c in chunks if c.choices]
    assert "".join(text_of(c) for c in with_choice) == whole_text(whole)
    assert sum(bool(text_of(c)) for c in with_choice) >= min_chunks
    for stop in extra.get("stop", ()):
        assert stop not in whole_text(whole)
    last = with_choice[-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert smc(last.choices[0])["log_z"] == smc(whole.choices[0])["log_z"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in with_choice)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}


def assert_structured(answer, valid) -> int:
    """What the server guarantees for a constrained answer, on any processor: a choice marked
    complete is valid (the token budget may cut a complete text before its EOS: finish_reason
    "length"); a choice that stops is complete; one that is not complete ran out of tokens and says
    so, never claiming a stop. Returns how many choices completed."""
    for choice in answer.choices:
        text = choice.message.content
        if smc(choice)["complete"]:
            assert choice.finish_reason in ("stop", "length") and valid(text), (choice.finish_reason, text)
        else:
            assert choice.finish_reason == "length", (choice.finish_reason, text)
    return sum(smc(choice)["complete"] for choice in answer.choices)


# Which sample a seed draws follows the processor's float rounding, so a test that needs a
# complete answer asks for CHOICES seeds (n) and needs one of them to complete. The schemas and
# grammars below admit only short texts, which complete within the budgets whatever the seed (12
# of 12 here); free JSON completes for a seed with probability p about 0.7 at T = 0.5 in 96 tokens
# (measured: 6 of 8 seeds), so all CHOICES fail with probability (1 - p)^12 = 5e-7, and below
# 2.5e-4 even if p were only 0.5.
CHOICES = 12


@model
@pytest.mark.parametrize("ask, budget, temperature, response_format, valid", [
    ("Give the capital of France and its population as JSON.", 48, 1.0,
     {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    # free JSON: at T = 1 the model rambles inside strings (5 of 8 seeds completed in 96 tokens)
    ("What is the capital of France? Reply with a JSON object with one key, capital.", 96, 0.5,
     {"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
])
def test_response_format_outputs_validate(ask, budget, temperature, response_format, valid, client):
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=budget,
                                            seed=0, temperature=temperature, n=CHOICES, response_format=response_format)
    assert assert_structured(answer, valid) >= 1


@model
@pytest.mark.parametrize("extra, valid", [
    ({"structured_outputs": {"regex": "(Yes|No)[.!]"}}, lambda text: re.fullmatch(r"(Yes|No)[.!]", text)),
    ({"structured_outputs": {"grammar": 'start: NUMBER " + " NUMBER\nNUMBER: /[1-9][0-9]?/'}},
     lambda text: re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", text)),
    ({"structured_outputs": {"choice": ["red", "green (dark)", "blue?"]}}, lambda text: text in ("red", "green (dark)", "blue?")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"structured_outputs": {"json": SCHEMA}, "json_layout": "flexible"},
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
])
def test_structured_outputs_through_extra_body(extra, valid, client):
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, seed=2, n=CHOICES, extra_body=extra)
    assert assert_structured(answer, valid) >= 1


LONG_PROMPT = [1] * 9000
# (body fields besides model and messages, the param the error names or None, a phrase of its message)
BAD_INPUT = [
    ({"temperature": -1}, None, "target temperature must be >= 0"),
    ({"temperature": 0}, None, "smc-sd needs a target temperature > 0"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"max_tokens": 0}, None, "max tokens must be >= 1"),
    ({"max_tokens": 8, "max_completion_tokens": 9}, "max_tokens", "max_tokens and max_completion_tokens differ"),
    ({"n": 0}, "n", "n must be >= 1"),
    ({"n": 129}, "n", "must be at most 128"),
    ({"seed": -1}, None, "seed must lie in 0 .. 2^64 - 1"),
    ({"stop": [""]}, "stop", "stop must be a non-empty string"),
    ({"method": "bogus"}, None, "unknown method 'bogus'"),
    ({"particles": 0}, None, "particles must be >= 1"),
    ({"particles": 2.5}, "particles", "particles must be an integer"),
    ({"particles": True}, "particles", "particles must be an integer"),
    ({"draft_len": 0}, None, "draft length K must be >= 1"),
    ({"ess_threshold": 2}, None, "ESS threshold must lie in [0, 1]"),
    ({"alpha": 0}, None, "alpha must be > 0"),
    ({"method": "ar", "alpha": 2}, None, "method ar samples p_T (alpha = 1)"),
    ({"method": "ar", "draft_len": 2}, None, "method ar drafts nothing; drop draft_len"),
    ({"method": "sd", "particles": 4}, None, "set particles to 1"),
    ({"method": "sd", "response_format": {"type": "json_object"}}, None, "method sd takes no constraints"),
    ({"resampling": "bogus"}, None, "unknown resampling scheme 'bogus'"),
    ({"top_p": 0.5}, "top_p", "top_p 0.5 is not supported"),
    ({"logprobs": True}, "logprobs", "logprobs true is not supported"),
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"messages": []}, "messages", "messages must be a non-empty array"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of system"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content", "text only"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream true"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be text, json_object or json_schema"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "invalid regex '('"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar", "invalid Lark grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "is not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty array of strings"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "not both"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages", "context window"),
    ({"json_layout": "flexible"}, "json_layout", "applies to a JSON schema"),
    ({"json_layout": "pretty", "response_format": {"type": "json_object"}}, "json_layout", "must be one of compact, flexible"),
]


@model
@pytest.mark.parametrize("fields, param, phrase", BAD_INPUT, ids=lambda case: json.dumps(case)[:60] if isinstance(case, dict) else None)
def test_bad_chat_input_is_a_400_in_openai_shape(fields, param, phrase, client):
    body = {"messages": QUESTION, "max_tokens": 4} | fields
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, extra_body=body)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert phrase in error["message"] and "\n" not in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param


@model
@pytest.mark.parametrize("prompt, phrase", [
    (LONG_PROMPT, "context window"),
    ([1, 2, 99999999], "token id outside 0 .. 49151"),
    ("", "prompt[0] is empty"),
    ([], "prompt must be a string"),
])
def test_bad_completion_prompt_is_a_400(prompt, phrase, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert phrase in caught.value.body["message"] and caught.value.body["param"] == "prompt"


@model
def test_other_refusals(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert caught.value.body["code"] == "model_not_found"
    status, text = http(server.url + "/chat/completions", b"{not json")
    assert status == 400 and "not JSON" in json.loads(text)["error"]["message"]
    status, text = http(server.url + "/chat/completions", b"[1, 2]")
    assert status == 400 and "must be a JSON object" in json.loads(text)["error"]["message"]


@model
def test_json_nested_past_the_limit_is_a_400_and_the_server_keeps_serving(server, client):
    deep = nested_objects_text(500)
    shallow = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 4})
    body = shallow[:-1] + ', "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + deep + "}}}"
    status, text = http(server.url + "/chat/completions", body.encode())
    error = json.loads(text)["error"]
    assert status == 400 and error["code"] == "json_too_deep" and error["type"] == "invalid_request_error"
    assert error["message"] == f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (the limit is {MAX_JSON_DEPTH})"
    # a schema as JSON text in a shallow body: refused, naming its field
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"structured_outputs": {"json": deep}})
    assert caught.value.body["param"] == "structured_outputs.json" and caught.value.body["code"] == "json_too_deep"
    assert f"more than {MAX_JSON_DEPTH} levels deep" in caught.value.body["message"]
    # within the limit (a body 123 levels deep), a schema of 60 nested objects is served
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": nested_objects(60)}})
    # four tokens of the one compact layout the schema allows, however the text is tokenised
    content = answer.choices[0].message.content
    assert len(content) >= 4 and ('{"a":' * 60).startswith(content)


def test_a_body_nested_past_the_limit_is_a_400_before_any_model_runs():
    from smc_sd.serve.app import Server, build_app

    target = types.SimpleNamespace(tokenizer=None, vocabulary=types.SimpleNamespace(size=8), max_length=64)
    app = build_app(Server(types.SimpleNamespace(dead=None), target, None, "tiny"))
    schema_body = '{"model": "tiny", "messages": [], "response_format": {"type": "json_schema", "json_schema": {"schema": ' + nested_objects_text(500) + "}}}"
    for body in (schema_body, "[" * 100_000 + "]" * 100_000):
        status, answer = asgi_request(app, "POST", "/v1/chat/completions", body.encode())
        assert status == 400 and answer["error"]["code"] == "json_too_deep", answer
        assert f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep" in answer["error"]["message"]


@model
def test_16_concurrent_requests_complete_and_are_valid(server, client):
    # a mix of methods, particle counts, draft lengths and constraints in one batch
    def ask(i: int):
        extra = [{"particles": 1 + i % 4, "draft_len": 1 + i % 3}, {"method": "ar"}, {"method": "sd", "draft_len": 2},
                 {"particles": 2, "structured_outputs": {"regex": "(Yes|No)"}}][i % 4]
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Is {i} an even number?"}],
                                              max_tokens=10, seed=100 + i, extra_body=extra)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    for i, answer in enumerate(answers):
        choice = answer.choices[0]
        assert smc(choice)["seed"] == 100 + i and choice.finish_reason in ("stop", "length")
        assert 1 <= answer.usage.completion_tokens <= 10
        if i % 4 == 3:
            assert choice.message.content in ("Yes", "No") and smc(choice)["complete"]
        else:
            assert choice.message.content
    values = server.metrics()
    assert values["smc_sd_requests_running"] == 0 and values["smc_sd_requests_waiting"] == 0


# An answer the regex holds open for at least REPEATS + 1 tokens ("Paris" is at least one token
# each time), so a request that ends with fewer tokens generated was cut short, on any processor.
REPEATS = 150


@model
def test_a_cancelled_stream_returns_its_kv_blocks(server, client):
    before = server.metrics()
    baseline = before["smc_sd_kv_blocks_in_use"]
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=400, seed=7, stream=True,
                                            extra_body={"particles": 4, "draft_len": 2,
                                                        "structured_outputs": {"regex": f"(Paris, ){{{REPEATS}}}Paris[.]"}})
    next(iter(stream))  # the role chunk: the request is admitted
    deadline = time.monotonic() + 120
    while server.metrics()["smc_sd_kv_blocks_in_use"] == baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()["smc_sd_kv_blocks_in_use"] > baseline, "the request never held KV blocks"
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        values = server.metrics()
        if values["smc_sd_requests_running"] == 0 and values["smc_sd_kv_blocks_in_use"] == baseline:
            break
        time.sleep(0.25)
    assert values["smc_sd_requests_running"] == 0
    assert values["smc_sd_kv_blocks_in_use"] == baseline
    assert values["smc_sd_tokens_total"] - before["smc_sd_tokens_total"] < REPEATS + 1, "the request ran to its end"


@model
def test_a_full_queue_is_a_429():
    process = ServerProcess("--max-running", "1", "--max-waiting", "1")
    try:
        client = process.client()
        long_stream = dict(model=MODEL, messages=QUESTION, max_tokens=300, stream=True, extra_body={"method": "ar"})
        running = client.chat.completions.create(**long_stream, seed=0)
        # once its text flows it runs, and the next request waits
        next(chunk for chunk in running if chunk.choices[0].delta.content)
        waiting = client.chat.completions.create(**long_stream, seed=1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        assert caught.value.body["code"] == "queue_full"
        running.close()
        waiting.close()
    finally:
        process.stop()


def test_stream_deltas_hold_back_partial_characters_and_stop_strings():
    from smc_sd.serve.text import TextDeltas, cut_at_stop

    pieces = ["he", "llo", " wo", "r", "ld", "caf", "\ufffd", "é"]
    decode = lambda ids: "".join(pieces[i] for i in ids)
    deltas = TextDeltas(decode, stop=("wor",))
    # " wo" may become the stop string "wor": held back, then dropped when it does
    assert [deltas.delta(list(range(n))) for n in (1, 2, 3, 4, 5)] == ["he", "llo", " ", "", ""]
    assert deltas.rest(cut_at_stop(decode(range(5)), ("wor",))[0]) == "" and deltas.sent == "hello "
    deltas = TextDeltas(lambda ids: "caf\ufffd" if ids == [5, 6] else decode(ids), stop=())
    # an incomplete UTF-8 character (U+FFFD) waits for its last byte
    assert [deltas.delta([5]), deltas.delta([5, 6]), deltas.rest("café")] == ["caf", "", "é"]


def asgi_request(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """(status, JSON body) of one request to an ASGI app, in-process (no lifespan, no socket)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_dead_engine_turns_health_and_requests_into_503s():
    from smc_sd.serve.app import Server, build_app

    target = types.SimpleNamespace(tokenizer=None, vocabulary=types.SimpleNamespace(size=8), max_length=64)
    engine = types.SimpleNamespace(dead=RuntimeError("the target pass failed"))
    app = build_app(Server(engine, target, None, "tiny"))
    status, body = asgi_request(app, "GET", "/health")
    assert status == 503 and body["error"]["code"] == "engine_dead" and "the target pass failed" in body["error"]["message"]
    status, body = asgi_request(app, "POST", "/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode())
    assert status == 503 and body["error"]["type"] == "service_unavailable"
