"""Errors a user can cause, and the one an internal failure of a single request becomes.
Their message is one line that names the problem; the CLI and the server print it instead
of a traceback."""


class NanoinferError(Exception):
    """Base class for errors caused by input (a path, a file, a parameter)."""


class ModelLoadError(NanoinferError):
    """A model or tokenizer file is missing, corrupt or of an unsupported kind."""


class SettingError(NanoinferError, ValueError):
    """A setting (an environment variable, a command's option) names something unknown, or
    something this machine cannot run (a kernel path its CPU lacks)."""


class InvalidRequestError(NanoinferError, ValueError):
    """A request cannot be served: bad sampling value, prompt too long, ...

    `param` names the request field at fault where the check knows it (SamplingParams'
    field names; the server maps them onto its own, e.g. max_tokens -> max_completion_tokens)."""

    code: str | None = None  # OpenAI's error.code ("context_length_exceeded", ...), where one applies

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class ConstraintError(InvalidRequestError):
    """A request's structured-output constraint is past a limit (size, rules, nesting, compile
    time, the time its masks take) or failed while generating (its grammar engine hit a limit or
    allows nothing). The request's own doing: a 400 before anything was sent, an error event in
    its stream after; it ends that request alone. `code` names the limit."""

    code = "invalid_constraint"


class RequestFailedError(NanoinferError):
    """An unexpected error inside one request's sampling or output processing ended that
    request alone; the engine and every other request go on (a server answers 500)."""
