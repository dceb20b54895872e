"""The server's refusals in OpenAI's error shape.

Every refusal is an `APIError` carrying its HTTP status; the app turns it into

    {"error": {"message": "...", "type": "...", "param": "<body field or null>", "code": "..."}}

as OpenAI's API does (`type` "invalid_request_error" for a 400), so the official client raises
`BadRequestError` (400), `NotFoundError` (404), `RateLimitError` (429), ... with the message.
"""

from __future__ import annotations


class APIError(Exception):
    """A refusal: HTTP status, one-line message, and OpenAI's `type`, `param` and `code`."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """400: the request body is wrong; `param` names the field."""
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def unknown_model(name: str, served: str) -> APIError:
    """404: the body names a model this server does not serve."""
    return APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                    type="invalid_request_error", param="model", code="model_not_found")


def queue_full(waiting: int) -> APIError:
    """429: the engine's queue holds its maximum of waiting requests."""
    return APIError(429, f"the server's queue is full ({waiting} requests waiting); retry later",
                    type="rate_limit_error", code="queue_full")


def engine_dead(cause: BaseException) -> APIError:
    """503: the engine loop has died; nothing will run until the server restarts."""
    return APIError(503, f"the engine has stopped: {type(cause).__name__}: {cause}",
                    type="service_unavailable", code="engine_dead")


def run_failed(error: BaseException) -> APIError:
    """The error a request's run ended with: 422 when every particle died (the request's own
    outcome, not the server's fault), 400 when the backend cannot hold what the request needs
    (rows of different lengths), 500 for anything else (a bug, reported with its type)."""
    from smc_sd.settings import one_line
    from smc_sd.engine.batch import RowsOfOneLengthError
    from smc_sd.engine.result import AllParticlesDiedError

    if isinstance(error, AllParticlesDiedError):
        return APIError(422, one_line(error), type="all_particles_died", code="all_particles_died")
    if isinstance(error, RowsOfOneLengthError):
        return bad_request(one_line(error))
    return APIError(500, f"{type(error).__name__}: {one_line(error)}", type="internal_error", code="internal_error")
