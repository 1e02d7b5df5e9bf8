"""Parse a Config: KEY=VALUE overrides > user YAML > preset > dataclass defaults (the first step: the
planner's resolve_config then makes every 'auto' concrete, and plans).

    from angelgpt.config import parse
    cfg = parse(size="tiny", overrides=["model.num_layers=4", "train_iters=10"])

Keys are ``section.field`` or, when the field name is unique across sections, the bare field name.
A YAML section written as a scalar (``data: mock``) sets that section's first field.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import yaml

from angelgpt.config.schema import SECTIONS, Config, ConfigError


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


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp) -> Any:
    """Checks value against a field annotation; ints are accepted where floats are asked for."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
        allowed = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise ConfigError(f"{key}: expected {allowed}, got {value!r}")
    if origin in (list, List):
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, inner) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _build(layers: Dict[str, Dict[str, Any]], name: str) -> Config:
    sections = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        kwargs = {k: _coerce(f"{section}.{k}", v, hints[k]) for k, v in layers.get(section, {}).items()}
        sections[section] = cls(**kwargs)
    return Config(name=name, **sections)


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


def parse(size: Optional[str] = None, config_file: Optional[str] = None,
          overrides: Optional[List[str]] = None) -> Config:
    """Builds and validates the Config ('auto' left as given); raises ConfigError with one line on bad input."""
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
    for item in overrides or []:
        section, key, value = parse_override(item)
        layers.setdefault(section, {})[key] = value
    try:
        return _build(layers, name)
    except TypeError as exc:  # a dataclass rejecting an argument: report it as config
        raise ConfigError(str(exc)) from None


def to_dict(cfg: Config) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)
