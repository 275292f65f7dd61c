"""Code sandbox over HTTP. ``rlhforge serve-sandbox`` or ``python -m rlhforge.cli.serve_sandbox``.

Binds 127.0.0.1 by default; ``--host 0.0.0.0`` exposes it, ideally with ``--api_key`` (or
``RLHFORGE_SANDBOX_API_KEY``). Trainers reach it with ``RLHFORGE_SANDBOX_URL=http://HOST:PORT`` or
``RLHFORGE_SANDBOX_URL=endpoints:FILE`` (docs/sandbox.md).
"""

from __future__ import annotations

import sys

from rlhforge.config.parsing import parse_args
from rlhforge.config.serve_sandbox import ServeSandboxConfig

CONFIG_CLASS = ServeSandboxConfig


def build_app(cfg: ServeSandboxConfig):
    """The FastAPI app of ``cfg`` (a sandbox with ``cfg``'s limits as per-call maxima)."""
    from rlhforge.agents.sandbox import Sandbox, SandboxConfig
    from rlhforge.agents.sandbox.server import create_app

    sandbox = Sandbox(SandboxConfig(**cfg.sandbox_kwargs()))
    return create_app(sandbox, api_key=cfg.resolved_api_key, concurrency=cfg.resolved_concurrency,
                      max_queue=cfg.resolved_max_queue, retry_after_s=cfg.retry_after_s,
                      body_timeout_s=cfg.body_timeout_s)


def serve(cfg: ServeSandboxConfig) -> None:
    from rlhforge.net.server import ServerLimits, run_server

    app = build_app(cfg)
    print(f"[rlhforge] serve-sandbox: POST http://{cfg.host}:{cfg.port}/run; {cfg.resolved_concurrency} calls at once, "
          f"{cfg.resolved_max_queue} queued; at most {cfg.timeout_s:g} s and {cfg.memory_mb} MiB per call"
          f"{' (API key required)' if cfg.resolved_api_key else ''}", flush=True)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.resolved_api_key:
        print(f"[rlhforge] serve-sandbox: warning: listening on {cfg.host} without an API key; anyone who can reach "
              "this port can run code here", flush=True)
    run_server(app, cfg.host, cfg.port, log_level=cfg.log_level, limits=ServerLimits(header_timeout_s=cfg.header_timeout_s))


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.serve_sandbox") -> int:
    from rlhforge.cli.errors import user_errors

    with user_errors(prog):
        cfg = parse_args(ServeSandboxConfig, argv, prog=prog, description=ServeSandboxConfig.__doc__)
        serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
