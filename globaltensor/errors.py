"""The one error family users catch.

Every message says what was expected, what was found, and how to fix it.
"""


class GlobalTensorError(ValueError, RuntimeError):
    """Base class of every error globaltensor raises on bad input or a failed distributed step."""


class PlacementError(GlobalTensorError):
    """A placement is malformed or does not fit the world."""


class SbpError(GlobalTensorError):
    """An sbp is malformed or does not fit the tensor or the placement."""


class ShapeMismatchError(GlobalTensorError):
    """Ranks disagree about the pieces of one global tensor."""


class CollectiveTimeoutError(GlobalTensorError):
    """A collective did not complete in time; the message names the operation and the ranks."""


class RankMismatchError(GlobalTensorError):
    """With debug checks on, ranks disagreed about which global operation runs next."""


class LaunchError(GlobalTensorError):
    """The launcher was given options it cannot run, or the job could not start."""

__all__ = ["GlobalTensorError", "PlacementError", "SbpError", "ShapeMismatchError",
           "CollectiveTimeoutError", "RankMismatchError", "LaunchError"]
