"""Parse a Config: KEY=VALUE overrides > user YAML > preset > dataclass defaults (the first step: the
planner's resolve_config then makes every 'auto' concrete, and plans); load a resolved run config.

    from angelgpt.config import parse
    cfg = parse(size="tiny", overrides=["model.num_layers=4", "train_iters=10"])

Keys are ``section.field`` or, when the field name is unique across sections, the bare field name.
A YAML section written as a scalar (``data: mock``) sets that section's first field.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from pydantic import ValidationError

from angelgpt.config.schema import SECTIONS, Config, ConfigError, ResolvedConfig, is_choice, type_text


def _preset_dir() -> Path:
    """The presets' folder: the checkout's top-level configs/, which pyproject's package-dir installs as
    the package angelgpt.configs, so the same lookup finds it in a wheel and in an editable install."""
    try:
        return Path(str(importlib.resources.files("angelgpt.configs")))
    except ModuleNotFoundError:  # a checkout on sys.path but not installed: configs/ beside angelgpt/
        return Path(__file__).resolve().parents[2] / "configs"


PRESET_DIR = _preset_dir()
CUSTOM = "custom"


def preset_names() -> List[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) + [CUSTOM]


def _read_yaml(path: Path, what: str) -> Dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _field_index() -> Dict[str, List[str]]:
    index: Dict[str, List[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            index.setdefault(f.name, []).append(section)
    return index


# keys that moved, still accepted where users write them: old (section, field) -> new
ALIASES = {("zero_cache", "save_large_model_multi_slice"): ("checkpoint", "multi_slice")}


def _canonical_key(key: str) -> typing.Tuple[str, str]:
    for (old_section, old_name), new in ALIASES.items():
        if key in (f"{old_section}.{old_name}", old_name):
            return new
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"unknown key '{key}': section '{section}' is not one of {', '.join(SECTIONS)}")
        if name not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
            raise ConfigError(f"unknown key '{key}': {section} has no field '{name}'")
        return section, name
    if key in SECTIONS:  # `data=mock`: a scalar for a whole section sets its first field
        return key, dataclasses.fields(SECTIONS[key])[0].name
    owners = _field_index().get(key)
    if not owners:
        raise ConfigError(f"unknown key '{key}': use section.field, sections are {', '.join(SECTIONS)}")
    if len(owners) > 1:
        raise ConfigError(f"ambiguous key '{key}': write one of {', '.join(f'{s}.{key}' for s in owners)}")
    return owners[0], key


def _merge(base: Dict[str, Dict[str, Any]], layer: Dict[str, Any], source: str) -> None:
    for section, body in layer.items():
        if section == "name":
            continue
        if section not in SECTIONS:
            raise ConfigError(f"unknown section '{section}' in {source}; sections are {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            body = {dataclasses.fields(SECTIONS[section])[0].name: body}
        for name, value in body.items():
            where, field = _canonical_key(f"{section}.{name}")
            base.setdefault(where, {})[field] = value


def _refusal(cls, section: Optional[str], error: dict) -> str:
    """One line for what pydantic refused in `section` of config class `cls` (None: across sections): a
    check's own message, or the key, what its type allows and the value."""
    if error["type"] == "value_error" and isinstance(error.get("ctx", {}).get("error"), ConfigError):
        return str(error["ctx"]["error"])
    name = error["loc"][0] if error["loc"] else None
    section_cls = typing.get_type_hints(cls).get(section)
    tp = typing.get_type_hints(section_cls, include_extras=True).get(name) if section_cls and name else None
    if tp is None:
        return f"{section or 'config'}: {error['msg']}"
    if is_choice(tp):
        return f"{section}.{name} must be {type_text(tp)}, got {error['input']!r}"
    return f"{section}.{name}: expected {type_text(tp)}, got {error['input']!r}"


def _build(cls, layers: Dict[str, Dict[str, Any]], name: str, source: Optional[str] = None):
    """Config class `cls` from each section's values; ConfigError naming the first key refused, or for a
    ResolvedConfig read from `source` every setting still 'auto'."""
    types = typing.get_type_hints(cls)
    sections, refused = {}, []
    for section in SECTIONS:
        try:
            sections[section] = types[section](**layers.get(section, {}))
        except ValidationError as exc:
            refused += [(section, error) for error in exc.errors()]
    left = list(dict.fromkeys(f"{section}.{error['loc'][0]}" for section, error in refused
                              if error["loc"] and error["input"] == "auto"))
    if cls is ResolvedConfig and left:
        raise ConfigError(f"{source} is not a resolved run config: {', '.join(left)} still 'auto' (`angelgpt "
                          f"train` resolves every 'auto' and writes the run config its workers take)")
    if refused:
        raise ConfigError(_refusal(cls, *refused[0]))
    try:
        return cls(name=name, **sections)
    except ValidationError as exc:  # Config.__post_init__: the checks that span sections
        raise ConfigError(_refusal(cls, None, exc.errors()[0])) from None


def parse_override(item: str) -> typing.Tuple[str, str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must be KEY=VALUE")
    key, raw = item.split("=", 1)
    section, name = _canonical_key(key.strip())
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return section, name, value


def _layers(size: Optional[str], config_file: Optional[str],
            overrides: List[str]) -> typing.Tuple[Dict[str, Dict[str, Any]], str]:
    """Each section's values, preset then YAML then overrides, and the config's name."""
    if size is None and config_file is None:
        size = CUSTOM
    layers: Dict[str, Dict[str, Any]] = {}
    name = size or CUSTOM
    if size is not None and size != CUSTOM:
        path = PRESET_DIR / f"{size}.yaml"
        if not path.is_file():
            raise ConfigError(f"unknown preset '{size}'; presets are {', '.join(preset_names())}")
        _merge(layers, _read_yaml(path, "preset"), f"preset {size}")
    if config_file is not None:
        user = _read_yaml(Path(config_file), "config file")
        if size is None and isinstance(user.get("name"), str):
            name = user["name"]
        _merge(layers, user, str(config_file))
    for item in overrides:
        section, key, value = parse_override(item)
        layers.setdefault(section, {})[key] = value
    return layers, name


def parse(size: Optional[str] = None, config_file: Optional[str] = None,
          overrides: Optional[List[str]] = None) -> Config:
    """Builds and validates the Config ('auto' left as given); raises ConfigError with one line on bad input."""
    layers, name = _layers(size, config_file, overrides or [])
    return _build(Config, layers, name)


def load_run_config(path: str) -> ResolvedConfig:
    """The resolved run config at `path` (the YAML `angelgpt train` writes for its workers); one still
    holding an 'auto', or bad input, is refused (ConfigError, one line)."""
    layers, name = _layers(None, path, [])
    return _build(ResolvedConfig, layers, name, path)


def to_dict(cfg: Config) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)
