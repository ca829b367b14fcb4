"""The YAML config: `schema.py` is the `Config` type, composed of each component's own settings
type, with `load_config` (YAML + `--set` overrides → a validated `Config`). Only the assembly
layer and the command line read it."""

from axrl.config.schema import AlgoSection, Config, apply_overrides, config_to_dict, load_config
from axrl.core.errors import ConfigError

__all__ = ["AlgoSection", "Config", "ConfigError", "apply_overrides", "config_to_dict", "load_config"]
