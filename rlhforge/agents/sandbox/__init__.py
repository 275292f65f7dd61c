"""Run model-written Python in a separate, confined process (the tool of tool-integrated reasoning).

::

    sandbox = Sandbox(SandboxConfig(timeout_s=5, memory_bytes=512 << 20, concurrency=8))
    result = await sandbox.run("print(2 ** 10)")
    result.stdout                    # '1024\\n'
    format_feedback(result)          # text to append to the conversation for the model

``run()`` never raises for anything the code does (crash, hang, memory hog, fork bomb, output
flood, network or file access): every outcome is a :class:`SandboxResult`. It only raises for
mistakes of the caller (``code`` not a ``str``; an isolation mode that was explicitly asked for
but cannot be set up on this machine).

Isolation, strongest mode first (``SandboxConfig.isolation="auto"`` picks the first that works
and says which in :attr:`Sandbox.isolation` / :attr:`SandboxResult.isolation`; details and the
exact guarantees are in ``docs/sandbox.md``):

``namespaces`` (Linux, run as root)
    Fresh PID, network, mount, IPC and UTS namespaces. The process sees a new read-only root
    built from bind mounts of the system directories (``/usr``, ``/etc``, ``/lib*``...) and of
    the interpreter's prefixes only; ``/tmp`` is a size-limited tmpfs that is also the working
    directory and, with a small private ``/dev/shm``, the only writable place; both disappear
    with the call. The code runs as an otherwise unused uid (one per concurrent call) with
    ``no_new_privs``, all capabilities dropped and resource limits (``RLIMIT_AS``/``RLIMIT_DATA``
    memory, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC`` - which the
    kernel enforces for a non-root uid). The network namespace has no interface but a down loopback, so every
    connection fails. When the call ends or times out the PID namespace is torn down, which
    kills every process the code started, daemonised or not.
``userns`` (Linux, not root, unprivileged user namespaces allowed)
    The same, inside a new user namespace (the code is "root" of that namespace with every
    capability dropped); ``RLIMIT_NPROC`` is counted per user namespace, so it bounds this
    call's processes only.
``basic`` (anything else, or on request)
    Resource limits plus in-process interposition (Python audit hooks and wrappers installed
    before the code runs) that refuse sockets, writes outside the scratch directory, running
    other programs, ``ctypes`` calls and signals to processes outside the call, with a budget
    of forks. Interposition is best effort: it stops ordinary model-written code, not a
    determined attacker with a C extension.

Remote use: ``rlhforge serve-sandbox`` serves a sandbox over HTTP (:mod:`.server`);
:class:`SandboxClient` runs code there with the same ``run()`` call, failing over between servers
listed in a live endpoints file (:mod:`.client`).

Helpers: :func:`format_feedback` (result -> concise text for the model) and
:func:`extract_code_blocks` (```` ```python ```` fenced blocks of a completion).
"""

from __future__ import annotations


from .client import SandboxClient
from .config import PER_CALL_LIMITS, SandboxConfig, SandboxResult, SandboxUnavailableError
from .feedback import extract_code_blocks, format_feedback
from .runner import Sandbox

__all__ = ["Sandbox", "SandboxClient", "SandboxConfig", "SandboxResult", "SandboxUnavailableError", "PER_CALL_LIMITS",
           "format_feedback", "extract_code_blocks"]
