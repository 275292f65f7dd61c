"""uvicorn's h11 protocol with a header deadline (imported only when a server starts).

uvicorn bounds the idle time between two requests of a keep-alive connection (``timeout_keep_alive``) but
not the time a client takes to send a request's headers, nor a connection that never sends a byte: 50
clients trickling a header byte every 0.5 s were held forever. :class:`HeaderDeadlineH11` starts a timer
when a connection opens and at the first byte of each further request, and closes the connection with a
408 when the headers are not complete within ``header_timeout_s``. The body's own deadline is the ASGI
guard's (:mod:`rlhforge.net.guard`); the size of the headers is h11's ``h11_max_incomplete_event_size``.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HeaderDeadlineH11"]

log = logging.getLogger("rlhforge.net")

_BODY = b'{"error": "request headers not complete in time (--header_timeout_s)"}'
_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class HeaderDeadlineH11(H11Protocol):
    """:class:`H11Protocol` closing connections whose request headers take over ``config.header_timeout_s``."""

    header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self.header_timer is None:
            seconds = getattr(self.config, "header_timeout_s", None)
            if seconds:
                self.header_timer = self.loop.call_later(seconds, self._headers_late, seconds)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is a slow client too

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm()  # a pipelined next request already started

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self, seconds: float) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        client = self.client or ("?", 0)
        log.warning("closed the connection of %s:%s: no complete request headers within %g s", client[0], client[1],
                 seconds)
        if self.conn.our_state is h11.IDLE:
            self.transport.write(_RESPONSE)
        self.transport.close()
