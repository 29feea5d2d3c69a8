"""Errors a user can cause, and the one an internal failure of a single request becomes.
Their message is one line that names the problem; the CLI and the server print it instead
of a traceback."""


class NanoinferError(Exception):
    """Base class for errors caused by input (a path, a file, a parameter)."""


class ModelLoadError(NanoinferError):
    """A model or tokenizer file is missing, corrupt or of an unsupported kind."""


class InvalidRequestError(NanoinferError, ValueError):
    """A request cannot be served: bad sampling value, prompt too long, ...

    `param` names the request field at fault where the check knows it (SamplingParams'
    field names; the server maps them onto its own, e.g. max_tokens -> max_completion_tokens)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailedError(NanoinferError):
    """An unexpected error inside one request's sampling or output processing ended that
    request alone; the engine and every other request go on (a server answers 500)."""
