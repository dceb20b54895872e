"""`smc-sd serve --backend llama-cpp`: the server on the shipped GGUF, with a Q8_0 copy as the
draft LM. Rows of llama.cpp sequences may differ in length, so the batched engine joins
concurrent requests into one decode per pass.

Run with the llama extra installed: `python -m pytest tests/llama -m llama` (docs/backends.md).
"""

import concurrent.futures
import json
import re

import pytest

from tests.serve_process import MODEL, ServerProcess

pytestmark = [pytest.mark.llama, pytest.mark.model]

QUESTION = [{"role": "user", "content": "Is Paris in France?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "in_france": {"type": "boolean"}},
          "required": ["city", "in_france"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(q8_gguf):
    process = ServerProcess("--backend", "llama-cpp", "--draft", str(q8_gguf), dtype=None)
    yield process.client()
    process.stop()


def test_concurrent_requests_of_every_method_complete(client):
    def ask(extra: dict):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=0, extra_body=extra)

    settings = [{"method": "ar"}, {"method": "sd", "draft_len": 2},
                {"particles": 2, "draft_len": 2, "structured_outputs": {"regex": r"(Yes|No)\."}},
                {"method": "ar"}, {"method": "sd", "draft_len": 3}]
    with concurrent.futures.ThreadPoolExecutor(len(settings)) as pool:
        answers = list(pool.map(ask, settings))
    for extra, answer in zip(settings, answers):
        choice = answer.choices[0]
        assert choice.model_extra["smc"]["method"] == extra.get("method", "smc-sd") and choice.message.content
    assert re.fullmatch(r"(Yes|No)\.", answers[2].choices[0].message.content)


def test_structured_output_validates(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, seed=0, temperature=0.3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    )
    record = json.loads(answer.choices[0].message.content)
    assert set(record) == {"city", "in_france"}


def test_a_stream_joins_to_the_whole_answer(client):
    settings = dict(model=MODEL, messages=QUESTION, max_tokens=16, seed=1, extra_body={"particles": 1, "draft_len": 2})
    whole = client.chat.completions.create(**settings).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**settings, stream=True))
    assert streamed == whole
