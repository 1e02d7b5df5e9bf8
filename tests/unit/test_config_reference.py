"""docs/config.md is the config reference scripts/config_reference.py generates from the schema's field
docstrings now: a field added, changed or documented anew in angelgpt/config/schema.py without
regenerating it fails here."""

import dataclasses
import importlib.util

from angelgpt.config import schema
from tests.helpers import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_what_the_script_generates():
    script = _script()
    assert (ROOT / "docs" / "config.md").read_text() == script.reference(), \
        f"docs/config.md differs from the config schema: run {script.COMMAND}"


def test_every_field_of_every_section_has_a_docstring():
    script = _script()
    for name, cls in schema.SECTIONS.items():
        docs = script.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"fields of {name} without a docstring under them in angelgpt/config/schema.py: {missing}"
