"""Random values and malformed YAML thrown at the config loader: a Config or a one-line ConfigError, never
another exception, and nothing written."""

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from angelgpt.config import ConfigError, parse
from angelgpt.config.schema import SECTIONS

pytestmark = pytest.mark.slow  # hundreds of generated configs a test (tests/unit/test_config.py is quick)

KEYS = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20), st.lists(st.integers(-5, 5), max_size=3))


def _accepts_or_refuses(fn):
    try:
        fn()
    except ConfigError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg
    # any other exception propagates and fails the test


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS) | st.text(max_size=15), value=st.one_of(st.text(max_size=20), scalars.map(repr)))
def test_random_overrides(key, value):
    _accepts_or_refuses(lambda: parse("tiny", overrides=[f"{key}={value}"]).data_parallel_size(1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("model:train: \n-[]{}'\"!&*#%@,0123456789.abc")), max_size=80))
def test_malformed_yaml(tmp_path_factory, text):
    d = tmp_path_factory.mktemp("y")
    path = d / "c.yaml"
    path.write_text(text)
    before = sorted(os.listdir(d))
    _accepts_or_refuses(lambda: parse("tiny", str(path)))
    assert sorted(os.listdir(d)) == before


@settings(max_examples=200, deadline=None)
@given(section=st.sampled_from(list(SECTIONS)), body=st.dictionaries(st.sampled_from(
    sorted({f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)})), scalars, max_size=4))
def test_random_sections(tmp_path_factory, section, body):
    import yaml

    path = tmp_path_factory.mktemp("s") / "c.yaml"
    path.write_text(yaml.safe_dump({section: body}))
    _accepts_or_refuses(lambda: parse(None, str(path)))
