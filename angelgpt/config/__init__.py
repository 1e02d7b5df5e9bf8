"""Configuration: dataclass sections, presets, and their parsing (overrides > YAML > preset > defaults)."""

from angelgpt.config.loader import PRESET_DIR, preset_names, parse, to_dict
from angelgpt.config.schema import Config, ConfigError

__all__ = ["Config", "ConfigError", "PRESET_DIR", "preset_names", "parse", "to_dict"]
