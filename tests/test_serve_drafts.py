"""`smc-sd serve` and its drafts: `draft` per request, `--draft free` at launch, a draft the
server did not load, and concurrent free-draft requests under a JSON schema (marker `model`).

Servers run as subprocesses on a free loopback port (`tests/serve_process.py`), each stopped by
its own process handle; the tests talk to them with the official `openai` client. The free draft
needs no model, so every server serves it: a server started with `--draft free` loads the target
alone and serves sd, smc-sd and mask-at-verify with it. Refusals of a generate command line are
tested in-process (`smc_sd.cli.main`), before any model loads.
"""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from smc_sd.cli import main
from smc_sd.serve.parsing import ServedModel, parse
from tests.serve_process import MODEL, ServerProcess

model = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
EXTRACT = [{"role": "user", "content": "Extract the person as JSON: Ada Lovelace was 36 years old."}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def smc(choice) -> dict:
    """The choice's smc object (an extra field of the client's pydantic model)."""
    return choice.model_extra["smc"]


@pytest.fixture(scope="module")
def free_server():
    process = ServerProcess("--draft", "free", "--max-running", "16")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def default_server():
    process = ServerProcess("--max-running", "8")
    yield process
    process.stop()


@model
@pytest.mark.parametrize("method", ["sd", "smc-sd"])
def test_a_server_started_with_draft_free_serves_the_drafting_methods_with_it(free_server, method):
    client = free_server.client()
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, seed=5, extra_body={"method": method, "particles": 1 if method == "sd" else 3})
    (choice,) = answer.choices
    info = smc(choice)
    assert info["method"] == method and info["draft"] == "free" and info["draft_passes"] == 0
    assert choice.message.content and info["target_passes"] >= 1
    # the same seed again: the same answer (the free draft's state is the request's own)
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, seed=5, extra_body={"method": method, "particles": 1 if method == "sd" else 3, "draft": "free"})
    assert again.choices[0].message.content == choice.message.content


@model
def test_a_server_started_with_draft_free_serves_mask_at_verify_under_a_schema(free_server):
    answer = free_server.client().chat.completions.create(
        model=MODEL, messages=EXTRACT, max_tokens=40, seed=1, response_format=schema_format(PERSON), extra_body={"method": "mask-at-verify"}
    )
    (choice,) = answer.choices
    info = smc(choice)
    assert info["method"] == "mask-at-verify" and info["draft"] == "free" and info["complete"]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    # the schema forces keys and punctuation: the free draft proposed, and the target accepted some
    assert info["acceptance"] is not None and info["acceptance"] > 0
    assert info["tokens_per_pass"] > 1


@model
def test_a_draft_the_server_did_not_load_is_a_400_naming_the_loaded_ones(free_server, default_server):
    for server, asked, served in ((free_server, "self", "free"), (default_server, "distilled", "free, self")):
        with pytest.raises(openai.BadRequestError) as refused:
            server.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"method": "sd", "draft": asked})
        error = refused.value.body
        assert refused.value.status_code == 400 and error["param"] == "draft" and error["code"] == "draft_not_loaded"
        assert error["message"] == f'draft "{asked}" is not loaded on this server; it serves {served}'
    with pytest.raises(openai.BadRequestError, match="method ar drafts nothing; drop draft"):
        free_server.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"method": "ar", "draft": "free"})


@model
def test_draft_per_request_on_a_server_with_a_draft_model(default_server):
    client = default_server.client()
    loaded = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, seed=2, extra_body={"method": "sd", "particles": 1})
    assert smc(loaded.choices[0])["draft"] == "self" and smc(loaded.choices[0])["draft_passes"] > 0
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, seed=2, extra_body={"method": "sd", "particles": 1, "draft": "free"})
    assert smc(free.choices[0])["draft"] == "free" and smc(free.choices[0])["draft_passes"] == 0
    # a structured output takes the free draft unless the request names another
    structured = client.chat.completions.create(model=MODEL, messages=EXTRACT, max_tokens=40, seed=2, response_format=schema_format(PERSON), extra_body={"method": "smc-sd", "particles": 2})
    assert smc(structured.choices[0])["draft"] == "free"
    jsonschema.validate(json.loads(structured.choices[0].message.content), PERSON)
    named = client.chat.completions.create(model=MODEL, messages=EXTRACT, max_tokens=40, seed=2, response_format=schema_format(PERSON), extra_body={"method": "smc-sd", "particles": 2, "draft": "self"})
    assert smc(named.choices[0])["draft"] == "self" and smc(named.choices[0])["draft_passes"] > 0
    # the free draft where it proposes, the loaded draft elsewhere (every drafting method)
    for method in ("mask-at-verify", "smc-sd"):
        both = client.chat.completions.create(model=MODEL, messages=EXTRACT, max_tokens=40, seed=2, response_format=schema_format(PERSON), extra_body={"method": method, "draft": "free+self"})
        assert smc(both.choices[0])["draft"] == "free+self" and smc(both.choices[0])["complete"]
        jsonschema.validate(json.loads(both.choices[0].message.content), PERSON)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, seed=2, extra_body={"method": "smc-sd", "draft": "free+self"})
    # without forced tokens the free draft seldom proposes in a chat answer: the draft model drafts
    assert smc(plain.choices[0])["draft_passes"] > 0


@model
def test_concurrent_free_draft_json_schema_requests_all_validate(free_server):
    client = free_server.client()
    settings = [{"method": "mask-at-verify"}, {"method": "smc-sd", "particles": 3}, {"method": "mask-at-verify", "temperature": 0.5},
                {"method": "smc-sd", "particles": 2, "ess_threshold": 1.0}]
    before = free_server.metrics()

    def ask(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=EXTRACT, max_tokens=40, seed=i, response_format=schema_format(PERSON), extra_body=settings[i % len(settings)]
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, answer in enumerate(answers):
        (choice,) = answer.choices
        assert smc(choice)["draft"] == "free" and smc(choice)["complete"], (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    after = free_server.metrics()
    # the requests shared target passes: fewer passes than their cycles together
    cycles = sum(smc(a.choices[0])["target_passes"] for a in answers)
    assert after["smc_sd_target_passes_total"] - before["smc_sd_target_passes_total"] < cycles


@model
@pytest.mark.parametrize("method", ["mask-at-verify", "smc-sd"])
def test_a_stop_string_under_a_schema_stays_in_the_constrained_text(free_server, method):
    # the stop string "}" is part of the constrained text: a string that ends at it counts only
    # complete (a "}" inside a name ends the string incomplete), and the text keeps it
    client = free_server.client()
    answer = client.chat.completions.create(model=MODEL, messages=EXTRACT, max_tokens=40, seed=0, n=6, stop=["}"],
                                            response_format=schema_format(PERSON), extra_body={"method": method})
    complete = 0
    for choice in answer.choices:
        if smc(choice)["complete"]:
            complete += 1
            assert choice.finish_reason == "stop" and choice.message.content.endswith("}")
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        else:
            assert choice.finish_reason == "length"
    assert complete >= 1


@model
def test_a_server_serves_several_drafts_each_request_its_own():
    server = ServerProcess("--draft", "distilled,self", "--max-running", "8")
    try:
        client = server.client()

        def ask(draft):
            extra = {"method": "smc-sd", "particles": 2, "draft_len": 2} | ({} if draft is None else {"draft": draft})
            return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, seed=4, extra_body=extra)

        before = server.metrics()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = dict(zip(["distilled", "self", "free", None], pool.map(ask, ["distilled", "self", "free", None])))
        # the first --draft is the default
        assert {name: smc(a.choices[0])["draft"] for name, a in answers.items()} == {"distilled": "distilled", "self": "self", "free": "free", None: "distilled"}
        assert all(smc(answers[name].choices[0])["draft_passes"] > 0 for name in ("distilled", "self"))
        assert server.metrics()["smc_sd_target_passes_total"] > before["smc_sd_target_passes_total"]
        with pytest.raises(openai.BadRequestError, match='draft "feature" is not loaded on this server; it serves free, distilled, self'):
            ask("feature")
    finally:
        server.stop()


@pytest.mark.parametrize("flags, message", [
    (["--draft", "self,self"], "--draft self,self: a draft is named twice"),
    (["--draft", "self,,distilled"], "an empty draft name"),
    (["--draft", "self,distilled", "--backend", "vllm"], "several draft models run on --backend hf only"),
])
def test_bad_lists_of_drafts_are_refused_in_one_line(capsys, flags, message):
    status = main(["serve", "--port", "0", *flags])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err


def test_a_server_with_a_free_draft_beside_a_draft_model_is_refused_in_one_line(capsys):
    status = main(["serve", "--draft", "free+self", "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and 'serve --draft self and send "draft": "free+self" with sd, smc-sd or mask-at-verify' in err


def test_a_structured_request_defaults_to_the_free_draft():
    body = {"model": "m", "prompt": [1, 2], "response_format": schema_format(PERSON)}
    for method in ("smc-sd", "mask-at-verify"):
        model = ServedModel("m", None, 10, drafts=("self",))
        assert parse({**body, "method": method}, "completion", model).draft == "free"
        # without a structured output, the loaded draft
        plain = {key: value for key, value in body.items() if key != "response_format"}
        assert parse({**plain, "method": method}, "completion", model).draft == "self"
