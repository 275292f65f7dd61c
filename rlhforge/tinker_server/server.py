"""Start-up of ``rlhforge serve-tinker``: the SDK check, the API keys, uvicorn."""

from __future__ import annotations

import secrets
import sys

__all__ = ["serve", "check_sdk", "resolve_keys"]


def check_sdk() -> None:
    """The protobuf schema comes from the SDK itself; say how to get it if it is missing."""
    from rlhforge.config.parsing import ConfigError

    try:
        from tinker.proto import tinker_public_pb2  # noqa: F401
        import zstandard  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"serve-tinker needs the tinker SDK's wire schema: pip install tinker==0.38.0 ({err})") from None


def resolve_keys(cfg) -> tuple[tuple[str, ...], bool]:
    """The keys of the default tenant, and whether one was generated (no --api_key / environment key / keys
    file)."""
    keys = cfg.resolved_api_keys
    if keys or cfg.api_keys_file:
        return keys, False
    return (f"tml-{secrets.token_urlsafe(24)}",), True


def serve(cfg) -> None:
    from rlhforge.net.server import ServerLimits, run_server
    from rlhforge.tinker_server.app import create_app

    from rlhforge.config.serve_tinker import read_keys_file

    check_sdk()
    keys, generated = resolve_keys(cfg)
    tenants = read_keys_file(cfg.api_keys_file) if cfg.api_keys_file else {}
    app = create_app(cfg, keys, tenants)
    base = f"http://{cfg.host}:{cfg.port}"
    print(f"rlhforge serve-tinker on {base} (checkpoints in {cfg.checkpoint_dir})"
          + (f"; {len(tenants)} tenant keys from {cfg.api_keys_file}" if tenants else ""), flush=True)
    if generated:
        print(f"  no --api_key given: generated one for this run\n  export TINKER_BASE_URL={base} "
              f"TINKER_API_KEY={keys[0]}", flush=True)
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"  listening on {cfg.host}: anyone who can reach it and holds the key can train here", file=sys.stderr)
    run_server(app, cfg.host, cfg.port, log_level=cfg.log_level, limits=ServerLimits(header_timeout_s=cfg.header_timeout_s))
