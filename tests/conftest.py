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
