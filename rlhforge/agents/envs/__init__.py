"""Environments from other ecosystems (``--env.kind``): the adapter table (:mod:`.adapters`), verifiers
(:mod:`.verifiers`, its chat harness :mod:`.verifiers_harness`) and OpenEnv (:mod:`.openenv`); docs/env_adapters.md."""
