import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_lm():
    """The default target model, loaded once per test session (converted on first use)."""
    from smc_sd.backends.hf import HFLanguageModel

    return HFLanguageModel.default()


@pytest.fixture(scope="session")
def default_draft():
    """The default draft, loaded once per test session."""
    from smc_sd.backends.hf import HFLanguageModel

    return HFLanguageModel.default_draft()


@pytest.fixture(scope="module")
def fresh_dynamo():
    """A module that compiles starts and ends with no compiled code: dynamo keeps at most 8
    graphs per function and runs it eagerly past that, which `fullgraph=True` refuses."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
