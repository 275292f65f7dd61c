"""The HTTP plumbing every rlhforge service shares (floor 1: imports nothing of rlhforge).

- :mod:`~rlhforge.net.server`: the one way to run a service with uvicorn (loopback by default, slow
  clients bounded, a background-thread variant for tests and in-process use) and the one API-key check;
- :mod:`~rlhforge.net.guard`: what every request goes through before a route parses it: the body limit
  counted while it streams, the body read deadline, a client that leaves mid-body logged as one line;
- :mod:`~rlhforge.net.payload`: request bodies turned into values, every failure a 400 with its reason
  (JSON of any kind of brokenness, zstd bounded in its output);
- :mod:`~rlhforge.net.errors`: the exceptions those raise (an HTTP status each);
- :mod:`~rlhforge.net.client`: calling services: retry policy, backoff, failover across URLs;
- :mod:`~rlhforge.net.endpoints`: service address lists (static, or a file re-read while it changes).

docs/security.md says what each service exposes and every limit's flag.
"""

from rlhforge.net.errors import BadRequest, BodyTimeout, BodyTooLarge, ClientGone, HTTPError, ServiceError
from rlhforge.net.guard import BodyLimits, RequestGuard
from rlhforge.net.payload import decompress_zstd, parse_json
from rlhforge.net.server import ServerHandle, ServerLimits, key_matches, match_key, run_server, start_server_thread

__all__ = ["BadRequest", "BodyTimeout", "BodyTooLarge", "ClientGone", "HTTPError", "ServiceError", "BodyLimits",
           "RequestGuard", "decompress_zstd", "parse_json", "ServerHandle", "ServerLimits", "key_matches", "match_key",
           "run_server", "start_server_thread"]
