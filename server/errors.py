"""Error types shared by the engine and the HTTP layer."""


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad sampling values, too long, unknown token ids...).

    The HTTP layer maps it to a 400 with vLLM's JSON error body; the engine keeps serving
    every other request. ``param`` names the request field at fault, when there is one.
    """

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop (or one of its workers) died; in-flight requests fail with this."""


class ServerStoppingError(EngineDeadError):
    """The server is shutting down: requests still in flight fail with this (HTTP 503)."""


class EngineStartupError(RuntimeError):
    """The engine could not start (bad checkpoint, out of memory, ...); the message is one line."""
