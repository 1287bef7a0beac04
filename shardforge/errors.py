"""Errors a user can act on. The CLI prints these as one message, without a traceback."""


class ShardforgeError(Exception):
    """Base class for every error caused by user input or environment, not by a bug."""


class ConfigError(ShardforgeError):
    """The config (YAML or overrides) is invalid: names the key, the value and what is allowed."""


class DataError(ShardforgeError):
    """A dataset is missing, malformed or yields nothing to train on: names the file and line."""


class ModelError(ShardforgeError):
    """A model folder or preset cannot be loaded or saved."""


class TrainingError(ShardforgeError):
    """The run cannot go on (e.g. it diverged): says what happened and what to change."""


class CheckpointError(ShardforgeError):
    """A checkpoint cannot be used (incomplete, damaged, or from an incompatible model)."""
