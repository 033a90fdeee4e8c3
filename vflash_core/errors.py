"""Error types that cross the engine's boundaries.

Every error a user can cause (a bad file, a mismatched profile, a bad request) is a `VflashError`: the CLI prints its
message on one line and exits non-zero without a traceback. Anything else is a bug and keeps its traceback.
"""


class VflashError(Exception):
    """A user-facing failure with a message that names the offending values."""


class WeightFileError(VflashError):
    """A safetensors file is missing, truncated, corrupt, or holds tensors of the wrong name, shape or dtype."""


class IdentityMismatchError(VflashError):
    """Two things that must agree do not: receipt vs files, profile vs artifact, bundle vs model layout."""


class BundleError(VflashError):
    """A conditioning bundle is malformed, tampered with, or already consumed."""


class SessionClosedError(VflashError):
    """A closed or failed session was called."""


class RequestError(VflashError):
    """A request is invalid (canvas, duration, mode, inputs) and was rejected before any heavy work ran."""
