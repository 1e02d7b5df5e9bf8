"""Configuration: dataclass sections, presets, and their parsing (overrides > YAML > preset > defaults);
the resolved config (no 'auto') and the run config file that holds one."""

from angelgpt.config.loader import PRESET_DIR, load_run_config, parse, preset_names, to_dict
from angelgpt.config.schema import Config, ConfigError, ResolvedConfig

__all__ = ["Config", "ConfigError", "PRESET_DIR", "ResolvedConfig", "load_run_config", "preset_names", "parse",
           "to_dict"]
