"""The typed config tree and its loader."""

from shardforge.config.load import dump_config, load_config, parse_override
from shardforge.config.schema import Config

__all__ = ["Config", "dump_config", "load_config", "parse_override"]
