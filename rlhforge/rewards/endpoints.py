"""Moved to :mod:`rlhforge.net.endpoints` (the shared HTTP layer); this path keeps working."""

from rlhforge.net.endpoints import EndpointsFile, EndpointsFileError, EndpointSelector, StaticEndpoints, parse_endpoints

__all__ = ["EndpointsFile", "EndpointsFileError", "EndpointSelector", "StaticEndpoints", "parse_endpoints"]
