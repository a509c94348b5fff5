"""Suite-wide settings."""

import os
import sys

import pytest
import torch

# test helper modules (scale_tiny, clip_synthetic, safety_tiny) import by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The tests use tiny models: under ``pytest -n 2`` on 2 cores, several OpenMP threads per
    worker only contend and make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
