"""Moved to :mod:`rlhforge.net.server` (the shared HTTP layer); this path keeps working."""

from rlhforge.net.server import ServerHandle, key_matches, start_server_thread

__all__ = ["key_matches", "ServerHandle", "start_server_thread"]
