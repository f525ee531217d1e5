"""The one exception family of mlx-streaming.

Every message names the file, tensor or option at fault, so that a user can act on it without a debugger.
"""


class StreamingError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointError(StreamingError):
    """A checkpoint file is missing, truncated or malformed."""


class ConfigMismatchError(CheckpointError):
    """config.json does not describe the tensors that the shards hold."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is in no shard."""


class ConfigError(StreamingError, ValueError):
    """An engine option has a value that cannot work."""


class PoolTooSmallError(ConfigError):
    """The resident expert pool cannot hold what a step needs."""


class ExpertIOError(StreamingError, OSError):
    """Reading expert bytes from disk failed."""

    #: Which of the ranges handed to ``ExpertReader.read`` failed.
    range_index = 0


class OutputError(StreamingError):
    """A command was asked to write where it must not: over a file or folder the project did not write."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture has no expert layers the engine can stream."""
