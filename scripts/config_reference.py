"""docs/config.md, the config reference, from the config schema: each section of
angelgpt/config/schema.py (SECTIONS), each field with its type (in words: schema.type_text), its
default and the docstring under it.

    python scripts/config_reference.py > docs/config.md
    python scripts/config_reference.py --write      # the same, into docs/config.md

tests/unit/test_config_reference.py fails when docs/config.md is not what this writes.
"""

import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the angelgpt package of this checkout

from angelgpt.config import schema  # noqa: E402
from angelgpt.config.loader import ALIASES  # noqa: E402

OUTPUT = ROOT / "docs" / "config.md"
COMMAND = "python scripts/config_reference.py --write"


def field_docs(cls) -> dict:
    """The docstring under each field of a dataclass, by field name, read from its source."""
    (node,) = ast.parse(inspect.getsource(cls)).body
    docs = {}
    for field, after in zip(node.body, node.body[1:] + [None]):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def default(field: dataclasses.Field) -> str:
    """A field's default as Python writes it (the docstrings' own terms: None, True, 'auto')."""
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "required"




def reference() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the docstrings of `angelgpt/config/schema.py` by",
        f"`{COMMAND}`; edit them there, not here. Set a field as",
        "`section.field=VALUE` on the command line (or the bare field name where it is unique), or under its",
        "section in a `--config` YAML file; precedence and presets are in",
        "[training.md](training.md#config-precedence). A default of 'auto' is settled once at launch for the",
        "machine, and the launcher's `resolved:` line prints the value chosen.",
        "",
        "Sections: " + ", ".join(f"[{name}](#{name})" for name in schema.SECTIONS) + ".",
    ]
    for name, cls in schema.SECTIONS.items():
        docs, types = field_docs(cls), typing.get_type_hints(cls, include_extras=True)
        lines += ["", f"## {name}", ""]
        for field in dataclasses.fields(cls):
            lines.append(f"- **`{name}.{field.name}`** (`{schema.type_text(types[field.name])}`, "
                         f"default `{default(field)}`):")
            lines += [f"  {line}".rstrip() for line in docs.get(field.name, "").splitlines()]
    if ALIASES:
        lines += ["", "## Renamed keys", "", "Still accepted where they are written, as the key they became:", ""]
        lines += [f"- `{old[0]}.{old[1]}`: `{new[0]}.{new[1]}`" for old, new in sorted(ALIASES.items())]
    return "\n".join(lines) + "\n"


def main(argv) -> int:
    text = reference()
    if argv == ["--write"]:
        OUTPUT.write_text(text)
        print(f"wrote {OUTPUT.relative_to(ROOT)}", file=sys.stderr)
    elif not argv:
        sys.stdout.write(text)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
