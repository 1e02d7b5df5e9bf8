"""pytest fixtures; what the tests share otherwise is in tests/helpers.py."""

import pytest

from tests.helpers import CORPUS


@pytest.fixture
def corpus():
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    return CORPUS
