"""Fixtures for the llama.cpp backend tests: the shipped GGUF loaded once per session.

These tests need the llama extra (README, "llama.cpp backend"); the main test run deselects
them through the `llama` marker. One thread: the CI machines are small and shared.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def llama_lm():
    """The default target (the shipped Q4_1 file), one thread, room for 16 rows at once."""
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    return LlamaCppLanguageModel.default(n_seq_max=16, n_threads=1)


@pytest.fixture(scope="session")
def q8_gguf(tmp_path_factory, llama_lm):
    """A Q8_0 copy of the default target's file, written by llama.cpp's own quantizer."""
    from smc_sd.backends.llama_formats import requantize

    return requantize(llama_lm.path, tmp_path_factory.mktemp("gguf") / "smollm2-q8_0.gguf", "q8_0")
