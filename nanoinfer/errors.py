"""Errors a user can cause. Their message is one line that names the problem;
the CLI and the server print it instead of a traceback."""


class NanoinferError(Exception):
    """Base class for errors caused by input (a path, a file, a parameter)."""


class ModelLoadError(NanoinferError):
    """A model or tokenizer file is missing, corrupt or of an unsupported kind."""


class InvalidRequestError(NanoinferError, ValueError):
    """A request cannot be served: bad sampling value, prompt too long, ..."""
