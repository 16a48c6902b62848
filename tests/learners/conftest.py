"""Fixtures for the learner tests."""

import os

import pytest


@pytest.fixture(scope="session")
def ds_ext(tmp_path_factory):
    """One torch-extensions dir for the session: DeepSpeed's CPU comm op is built once per session."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch-ext"))
    return os.environ["TORCH_EXTENSIONS_DIR"]
