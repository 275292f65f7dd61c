"""Server state: sessions, training models, samplers, futures, and the one worker thread every model
computation runs on (CPU or one GPU: one computation at a time, in submission order).

**Futures.** Every long call answers at once with ``{"request_id": ...}``; ``retrieve_future`` long-polls the
result (``try_again`` after ``--retrieve_wait_s``), a failure comes back as ``{"error", "category"}`` with
category ``user`` (the request was wrong) or ``server``.

**Order.** The requests of one training model carry ``seq_id`` 1, 2, 3, ... (the SDK reserves them in call
order, but sends chunks of one ``forward_backward`` concurrently and the first chunk last). A request is only
handed to the worker once every lower ``seq_id`` of its model has been. A ``seq_id`` seen twice gets the first
request's future back only when the two requests are the same (an SDK retry: same route, same body); another
request with a used ``seq_id`` is a 409. A ``seq_id`` more than ``--seq_window`` - 1 ahead of the next expected
one is refused at once (400), so one wild ``seq_id`` cannot push a model's counter out of reach. A request
refused at submit time (a bad loss, token ids, optimizer parameters) still takes its ``seq_id`` (the next
request runs at once), and sending it again gets the same 400. A gap that outlasts ``--seq_gap_timeout_s`` is
skipped (logged).

**Owners.** Every session, model, sampler and future belongs to one tenant (an API key of ``--api_keys_file``,
or the default tenant of ``--api_key``); another tenant's lookups get the same 404 as an id that does not
exist. A tenant's checkpoints live in its own folder. Within a tenant, a live model is addressed by its model
id, ``SESSION_ID:train:N``, which only the session that created it knows (session ids are random); its
checkpoints are named ``tinker://RUN/...`` with a RUN name of their own, so a checkpoint path says nothing that
drives the live model.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlhforge.tinker_server.codec import PayloadError

log = logging.getLogger("rlhforge.tinker_server")

__all__ = ["ServerState", "FutureRecord", "ModelEntry", "SamplerEntry", "checkpoint_dir_of", "check_name", "base_dir_of",
           "folder_config", "vocab_size", "check_ids"]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+\-]{0,200}$")
KINDS = {"weights": "weights", "sampler_weights": "sampler_weights"}
FUTURE_TTL_S = 3600.0


@dataclass
class FutureRecord:
    request_id: str
    kind: str
    """``json`` (result: a dict), ``fwdbwd`` (outputs, metrics), ``sample`` (sequences, prompt log-probs)."""
    done: asyncio.Event
    result: Any = None
    error: tuple[str, str] | None = None
    finished_at: float | None = None
    tenant: str = ""


@dataclass
class ModelEntry:
    model_id: str
    base_model: str
    base_dir: str
    lora: Any
    trained: Any = None
    next_seq: int = 1
    waiting: dict[int, tuple[FutureRecord | None, Callable[[], Any] | None]] = field(default_factory=dict)
    seen: dict[int, tuple[str, str | None, PayloadError | None]] = field(default_factory=dict)
    """seq_id -> (digest of the request, its future's id, or the refusal it got)."""
    creation: str | None = None
    blocked_since: float | None = None
    tenant: str = ""
    run: str = ""
    """The RUN of this model's ``tinker://RUN/...`` checkpoint names (random; not the model id)."""


@dataclass
class SamplerEntry:
    sampler_id: str
    base_model: str
    base_dir: str
    model_path: str | None = None
    adapter_dir: Path | None = None
    sampler: Any = None
    tenant: str = ""


def checkpoint_dir_of(root: Path, tinker_path: str, field_name: str = "path") -> tuple[Path, str, str]:
    """``root`` is the tenant's folder (:meth:`ServerState.root_of`)."""
    """``tinker://RUN/KIND/NAME`` -> (``root/RUN/KIND/NAME``, RUN, KIND); PayloadError naming ``field_name``."""
    if not isinstance(tinker_path, str) or not tinker_path.startswith("tinker://"):
        raise PayloadError(field_name, f"must be a tinker://RUN/weights/NAME path (got {tinker_path!r})")
    parts = tinker_path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not all(_SEGMENT.match(p) and p not in (".", "..") for p in parts):
        raise PayloadError(field_name, f"must be tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME "
                                       f"(got {tinker_path!r})")
    if parts[0].startswith("tenant-"):  # the folders of the --api_keys_file tenants, beside the default tenant's runs
        raise PayloadError(field_name, f"no checkpoint {tinker_path!r}", status=404)
    return root.joinpath(*parts), parts[0], parts[1]


def check_name(name: str, field_name: str = "path") -> str:
    if not _SEGMENT.match(name or "") or name in (".", ".."):
        raise PayloadError(field_name, f"checkpoint names are letters, digits and ._:@+- (got {name!r})")
    return name


class ServerState:
    def __init__(self, cfg):
        self.cfg = cfg
        self.root = Path(cfg.checkpoint_dir).expanduser().resolve()
        # keyed by key_of(tenant, id): each tenant has its own name space, so another tenant's ids are unknown
        # here in every way (even a session id guessed right is adopted as a new session of one's own)
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, ModelEntry] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self.futures: dict[str, FutureRecord] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-compute")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._device = None

    @staticmethod
    def key_of(tenant: str, ident: str) -> str:
        """The table key of a tenant's session/model/sampler id (the default tenant's: the id itself)."""
        return f"{tenant}/{ident}" if tenant else ident

    def add_model(self, entry: ModelEntry) -> None:
        key = self.key_of(entry.tenant, entry.model_id)
        if key in self.models:
            raise PayloadError("model_seq_id", f"{entry.model_id.rsplit(':', 1)[-1]} is already a model of this "
                                               "session")
        self.models[key] = entry

    def has_sampler(self, tenant: str, sampler_id: str) -> bool:
        return self.key_of(tenant, sampler_id) in self.samplers

    def add_sampler(self, entry: SamplerEntry) -> SamplerEntry:
        self.samplers[self.key_of(entry.tenant, entry.sampler_id)] = entry
        return entry

    def new_session(self, tenant: str, session_id: str) -> dict:
        sess = self.sessions[self.key_of(tenant, session_id)] = {"finished": False, "created": time.time()}
        return sess

    def root_of(self, tenant: str) -> Path:
        """The checkpoint folder of ``tenant`` (the default tenant: ``--checkpoint_dir`` itself)."""
        return self.root / f"tenant-{tenant}" if tenant else self.root

    @property
    def device(self):
        if self._device is None:
            from rlhforge.backend.device import resolve_device

            self._device = resolve_device(self.cfg.device, 0)
        return self._device

    # -- base models ------------------------------------------------------------------------------------
    def resolve_base(self, name: str, field_name: str = "base_model") -> str:
        table = self.cfg.model_table
        if name in table:
            return str(Path(table[name]).expanduser().resolve())
        path = Path(name).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return str(path.resolve())
        known = ", ".join(sorted(table)) or "none"
        raise PayloadError(field_name, f"{name!r} is neither a local model folder nor a --model_map name "
                                       f"(mapped: {known})")

    # -- futures ----------------------------------------------------------------------------------------
    def new_future(self, kind: str, tenant: str = "") -> FutureRecord:
        self._purge()
        rec = FutureRecord(request_id=f"req-{uuid.uuid4().hex}", kind=kind, done=asyncio.Event(), tenant=tenant)
        self.futures[rec.request_id] = rec
        return rec

    def _purge(self) -> None:
        now = time.monotonic()
        old = [k for k, r in self.futures.items() if r.finished_at is not None and now - r.finished_at > FUTURE_TTL_S]
        for k in old:
            del self.futures[k]

    def _finish(self, rec: FutureRecord) -> None:
        rec.finished_at = time.monotonic()
        rec.done.set()

    def run(self, rec: FutureRecord, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the worker thread; its return value (or error) completes ``rec``."""
        loop = self.loop

        def job():
            try:
                rec.result = fn()
            except PayloadError as err:
                rec.error = (str(err), "user")
            except Exception as err:  # noqa: BLE001 - reported to the client as a server error
                log.error("request %s failed:\n%s", rec.request_id, traceback.format_exc())
                rec.error = (f"{type(err).__name__}: {err}", "server")
            loop.call_soon_threadsafe(self._finish, rec)

        self.executor.submit(job)

    def submit(self, kind: str, fn: Callable[[], Any], tenant: str = "") -> FutureRecord:
        rec = self.new_future(kind, tenant)
        self.run(rec, fn)
        return rec

    def submit_ordered(self, entry: ModelEntry, seq_id: int, kind: str, fn: Callable[[], Any], *, digest: str = "",
                       check: Callable[[], None] | None = None) -> FutureRecord:
        """Queue ``fn`` as request ``seq_id`` of ``entry``'s model (module docstring). ``digest`` identifies the
        request (route and body); ``check`` refuses it (PayloadError) before anything is queued, its
        ``seq_id`` then counting as used."""
        if seq_id < 1:
            raise PayloadError("seq_id", f"must be >= 1 (got {seq_id})")
        prior = entry.seen.get(seq_id)
        if prior is not None:
            seen_digest, request_id, refusal = prior
            if seen_digest != digest:
                raise PayloadError("seq_id", f"{seq_id} of this model was already used by a different request "
                                             f"(next: {entry.next_seq})", status=409)
            if refusal is not None:
                raise refusal
            return self.futures.get(request_id) or self._gone(seq_id)
        if seq_id < entry.next_seq:
            raise PayloadError("seq_id", f"{seq_id} of this model already ran (next: {entry.next_seq})")
        window = self.cfg.seq_window
        in_window = seq_id < entry.next_seq + window
        if check is not None:
            try:
                check()
            except PayloadError as err:
                if in_window:  # the seq_id is used up: the next request must not wait for it
                    self._remember(entry, seq_id, (digest, None, err))
                    entry.waiting[seq_id] = (None, None)
                    self._drain(entry)
                raise
        if not in_window:
            raise PayloadError("seq_id", f"{seq_id} is too far ahead of this model's next seq_id {entry.next_seq} "
                                         f"(at most {window - 1} ahead; --seq_window)")
        rec = self.new_future(kind, entry.tenant)
        entry.waiting[seq_id] = (rec, fn)
        self._remember(entry, seq_id, (digest, rec.request_id, None))
        self._drain(entry)
        return rec

    @staticmethod
    def _remember(entry: ModelEntry, seq_id: int, what) -> None:
        entry.seen[seq_id] = what
        if len(entry.seen) > 4096:
            for k in sorted(entry.seen)[:2048]:
                del entry.seen[k]

    def _gone(self, seq_id: int):
        raise PayloadError("seq_id", f"{seq_id} already ran and its result has expired", status=410)

    def _drain(self, entry: ModelEntry) -> None:
        while entry.next_seq in entry.waiting:
            rec, fn = entry.waiting.pop(entry.next_seq)
            entry.next_seq += 1
            if rec is not None:  # None: a request refused at submit time
                self.run(rec, fn)
        if entry.waiting:
            if entry.blocked_since is None:
                entry.blocked_since = time.monotonic()
                self.loop.call_later(self.cfg.seq_gap_timeout_s, self._check_gap, entry)
        else:
            entry.blocked_since = None

    def _check_gap(self, entry: ModelEntry) -> None:
        if entry.blocked_since is None or not entry.waiting:
            return
        if time.monotonic() - entry.blocked_since >= self.cfg.seq_gap_timeout_s - 1e-3:
            first = min(entry.waiting)  # (a refused request's slot counts: it arrived)
            log.warning("model %s: seq_id %d..%d never arrived in %.0f s; running seq_id %d", entry.model_id,
                        entry.next_seq, first - 1, self.cfg.seq_gap_timeout_s, first)
            entry.next_seq = first
            entry.blocked_since = None
            self._drain(entry)

    async def wait(self, request_id: str, timeout: float, tenant: str = "") -> FutureRecord:
        rec = self.futures.get(request_id)
        if rec is None or rec.tenant != tenant:
            raise PayloadError("request_id", f"unknown or expired request {request_id!r}", status=404)
        if not rec.done.is_set():
            try:
                await asyncio.wait_for(rec.done.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return rec

    # -- lookups ------------------------------------------------------------------------------------------
    def model(self, model_id: str | None, tenant: str = "", field_name: str = "model_id") -> ModelEntry:
        entry = self.models.get(self.key_of(tenant, model_id or ""))
        if entry is None:
            raise PayloadError(field_name, f"unknown model {model_id!r} (create it with create_model, or load a "
                                           f"checkpoint with create_training_client_from_state)", status=404)
        return entry

    def sampler(self, sampler_id: str | None, tenant: str = "", field_name: str = "sampler_id") -> SamplerEntry:
        entry = self.samplers.get(self.key_of(tenant, sampler_id or ""))
        if entry is None:
            raise PayloadError(field_name, f"unknown sampler {sampler_id!r}", status=404)
        return entry

    def session(self, session_id: str, tenant: str = "", field_name: str = "session_id", *,
                adopt: bool = True) -> dict:
        sess = self.sessions.get(self.key_of(tenant, session_id))
        if sess is None and adopt:  # e.g. a session from before a server restart: adopt it
            sess = self.new_session(tenant, session_id)
        if sess is None:
            raise PayloadError(field_name, f"unknown session {session_id!r}", status=404)
        if sess["finished"]:
            raise PayloadError(field_name, f"session {session_id} is finished", status=410)
        return sess

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def base_dir_of(state: ServerState, meta: dict) -> str:
    """A checkpoint's base folder: its ``base_model`` name if this server maps or finds it, else the folder
    recorded at save time."""
    try:
        return state.resolve_base(meta["base_model"])
    except PayloadError:
        folder = meta.get("base_dir")
        if folder and Path(folder).is_dir():
            return folder
        raise


def folder_config(folder: str) -> dict:
    import json

    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def vocab_size(folder: str) -> int | None:
    cfg = folder_config(folder)
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")


def check_ids(where: str, ids, vocab: int | None) -> None:
    import numpy as np

    arr = np.asarray(ids)
    if arr.size and (arr.min() < 0 or (vocab is not None and arr.max() >= vocab)):
        raise PayloadError(where, f"token ids must be in 0..{(vocab or 0) - 1} (got {int(arr.min())}..{int(arr.max())})")
