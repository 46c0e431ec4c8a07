"""Every test here: Polygraphy quiet, torch single-threaded (fixtures tiny_ck/tiny_out* are in tests/conftest.py)."""

import pytest

from tests.check.exports import quiet_single_threaded

_quiet_and_single_threaded = pytest.fixture(autouse=True)(quiet_single_threaded)
