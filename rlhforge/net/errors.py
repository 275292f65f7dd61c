"""Exceptions of :mod:`rlhforge.net`: each request-side one carries the HTTP status it is answered with."""

from __future__ import annotations

__all__ = ["HTTPError", "BadRequest", "BodyTooLarge", "BodyTimeout", "ClientGone", "ServiceError"]


class HTTPError(Exception):
    """A request answered with ``status`` and ``str(self)`` as the reason (``headers`` added to the answer)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, dict(headers or {})


class BadRequest(HTTPError):
    """400: the body cannot be read as what the route takes (the message says why)."""

    def __init__(self, message: str):
        super().__init__(400, message)


class BodyTooLarge(HTTPError):
    """413: the body (or what it decompresses to) is over the service's limit; the connection is closed
    when the rest of the body would have to be read to keep it."""

    def __init__(self, message: str, *, close: bool = True):
        super().__init__(413, message, {"Connection": "close"} if close else None)


class BodyTimeout(HTTPError):
    """408: the body did not arrive within the service's body deadline (a slow or stalled client)."""

    def __init__(self, message: str):
        super().__init__(408, message, {"Connection": "close"})


class ClientGone(Exception):
    """The client closed the connection before its body was complete: nobody to answer, not a server error."""


class ServiceError(RuntimeError):
    """A service could not be used (:func:`rlhforge.net.client.post_with_failover`). ``url``: the (first)
    server that failed; ``causes``: URL -> why it failed, for every server tried."""

    def __init__(self, message: str, url: str, causes: dict[str, str] | None = None):
        super().__init__(message)
        self.url = url
        self.causes = dict(causes) if causes else {url: message}
