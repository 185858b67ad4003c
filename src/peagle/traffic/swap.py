"""The draft swap endpoint inside vLLM's API server (issue #41): ``/peagle/v1/draft``, behind a bearer token.

Served by :class:`peagle.traffic.middleware.CaptureMiddleware` (the project's ``--middleware``) when the
server's environment holds :data:`TOKEN_ENV` (a Kubernetes Secret's value); without it the path is not
answered (404, as any unknown path), so the swap is off by default. Not vLLM's development routes
(``VLLM_SERVER_DEV_MODE``), which expose far more than a swap.

* ``GET /peagle/v1/draft`` -> ``{"fingerprint": FP}``: the draft every worker serves (each asked).
* ``POST /peagle/v1/draft`` with ``{"uri": URI, "fingerprint": FP}`` (FP optional: the draft it must be)
  swaps the draft through the worker's ``start_draft_weight_update`` -> ``update_weights`` ->
  ``finish_weight_update``, run in one call to every worker (the ``peagle-draft`` weight-transfer engine,
  :mod:`peagle.swap.engine`: the server must start with ``--weight-transfer-config '{"backend":
  "peagle-draft"}'`` and ``--worker-extension-cls peagle.swap.engine.DraftSwapWorker``), each answering which
  draft it served before and serves now. 200 ``{"fingerprint", "previous", "seconds", "phases", "served_model_names"}``; a draft the engine refuses
  or fails to load: 409 ``{"error", "fingerprint"}`` with the draft that still serves; 400 a bad request;
  401 without the token; 409 while another swap runs.

After a swap the served model name that carries the draft (``<name>:draft-<FP>``, the chart's second
name) names the new draft, and the capture labels records of requests that arrive from then on with it.
Prometheus: ``peagle_draft_swaps_total{outcome="swapped|refused|unauthorized"}``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("peagle.traffic")
SWAP_PATH = "/peagle/v1/draft"
TOKEN_ENV = "PEAGLE_SWAP_TOKEN"
MAX_BODY = 64 * 1024
DRAFT_NAME_MARK = ":draft-"
# the worker extension peagle.swap.engine.DraftSwapWorker (--worker-extension-cls) and its method
WORKER_EXTENSION = "peagle.swap.engine.DraftSwapWorker"
FINGERPRINT_RPC = "peagle_draft_fingerprint"
SWAP_RPC = "peagle_swap_draft"  # the draft update session in one call


class ServedDraft:
    """Which draft this server's workers serve since the last swap (None: the one it started with)."""

    fingerprint: str | None = None


def _counter():
    global _SWAPS
    if _SWAPS is None:
        try:
            from prometheus_client import Counter
        except ImportError:
            return None
        _SWAPS = Counter("peagle_draft_swaps", "Draft swaps asked of this server, by outcome", ["outcome"])
    return _SWAPS


_SWAPS: Any = None


def _count(outcome: str) -> None:
    counter = _counter()
    if counter is not None:
        counter.labels(outcome=outcome).inc()


async def _reply(send, status: int, doc: Mapping[str, Any], headers: tuple = ()) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def served_fingerprint(engine_client) -> str | None:
    """The draft every worker serves (one answer), else None; raises when workers disagree."""
    answers = set(await engine_client.collective_rpc(FINGERPRINT_RPC))
    if len(answers) > 1:
        raise RuntimeError(f"the workers serve different drafts: {sorted(map(str, answers))}")
    return next(iter(answers), None)


def rename_served_draft(app_state, previous: str | None, now: str) -> list[str]:
    """Point the served model names ``<name>:draft-<previous>`` at ``now``; returns the names now served."""
    from dataclasses import replace

    models = getattr(app_state, "openai_serving_models", None)
    if models is None:
        return []
    paths = []
    for p in models.base_model_paths:
        name, mark, fp = p.name.rpartition(DRAFT_NAME_MARK)
        if mark and name and (previous is None or fp == previous):
            p = replace(p, name=f"{name}{DRAFT_NAME_MARK}{now}")
        paths.append(p)
    models.base_model_paths[:] = paths
    return [p.name for p in paths]


class SwapEndpoint:
    """The ASGI handler of :data:`SWAP_PATH` (see the module docstring)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("a swap endpoint needs a token")
        self._token = token.encode()
        self._lock = asyncio.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SwapEndpoint | None":
        token = env.get(TOKEN_ENV, "").strip()
        return cls(token) if token else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if bytes(name).lower() == b"authorization":
                scheme, _, given = bytes(value).partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._token)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if not self._authorized(scope):
            _count("unauthorized")
            await _reply(send, 401, {"error": f"{SWAP_PATH} needs the swap token (Authorization: Bearer ...)"},
                         ((b"www-authenticate", b"Bearer"),))
            return
        client = scope["app"].state.engine_client
        if scope.get("method") == "GET":
            await _reply(send, 200, {"fingerprint": await served_fingerprint(client)})
            return
        if scope.get("method") != "POST":
            await _reply(send, 405, {"error": f"{SWAP_PATH}: GET or POST"}, ((b"allow", b"GET, POST"),))
            return
        body = await _read_body(receive)
        try:
            asked = json.loads(body) if body is not None else None
        except ValueError:
            asked = None
        if (not isinstance(asked, dict) or not isinstance(asked.get("uri"), str) or not asked["uri"]
                or not isinstance(asked.get("fingerprint", ""), str) or set(asked) - {"uri", "fingerprint"}):
            await _reply(send, 400, {"error": 'expected a JSON object {"uri": "<published draft>", "fingerprint": '
                                     '"<optional: the draft it must be>"} of at most 64 KiB'})
            return
        if self._lock.locked():
            await _reply(send, 409, {"error": "another swap is running"})
            return
        async with self._lock:
            await self._swap(scope["app"].state, client, asked["uri"], asked.get("fingerprint", ""), send)

    async def _swap(self, state, client, uri: str, fingerprint: str, send) -> None:
        try:
            answer = await swap_in(state, client, uri, fingerprint)
        except SwapRejected as exc:
            await _reply(send, 409, {"error": str(exc), "fingerprint": exc.serving})
            return
        await _reply(send, 200, answer)


class SwapRejected(RuntimeError):
    """The engine refused the draft or failed to load it; ``serving``: the draft that serves on."""

    def __init__(self, message: str, serving: str | None):
        super().__init__(message)
        self.serving = serving


async def swap_in(state, client, uri: str, fingerprint: str) -> dict[str, Any]:
    """Swap the draft of the server whose app state is ``state`` (engine client ``client``) for the published
    ``uri`` (which must be ``fingerprint``, unless ""): the engine's draft update session in one call to every
    worker (:meth:`peagle.swap.engine.DraftSwapWorker.peagle_swap_draft`), which answers the draft it served
    before and serves now; the served names and the capture's label follow. Returns the endpoint's 200
    answer; :class:`SwapRejected` with the draft still serving otherwise."""
    async def refused(message: str) -> SwapRejected:
        now = await served_fingerprint(client)
        _count("refused")
        log.warning("peagle: draft swap to %s refused (%s); serving %s", uri, message, now)
        return SwapRejected(message, now)

    t0 = time.monotonic()
    try:  # a remote draft is downloaded (and verified) first, here: the engine does not wait for it
        local = await asyncio.to_thread(stage_draft, uri)
    except Exception as exc:  # noqa: BLE001 - unreadable, damaged or unfinished: the old draft serves on
        raise await refused(f"{uri}: {exc}") from None
    t_staged = time.monotonic()
    try:
        answers = await client.collective_rpc(SWAP_RPC, kwargs={"uri": local, "fingerprint": fingerprint})
    except Exception as exc:  # noqa: BLE001 - the engine refused or failed: the old draft serves on
        raise await refused(str(exc)) from None
    t_loaded = time.monotonic()
    served = {a.get("fingerprint") for a in answers}
    previous = next(iter({a.get("previous") for a in answers}), None)
    if len(served) != 1:
        raise SwapRejected(f"the workers serve different drafts after the swap: {sorted(map(str, served))}", None)
    now = served.pop()
    names = rename_served_draft(state, previous, now) if now else []
    ServedDraft.fingerprint = now
    _count("swapped")
    seconds = round(time.monotonic() - t0, 3)
    log.info("peagle: draft %s swapped in for %s in %.2f s (%s)", now, previous, seconds, uri)
    if local != uri:
        forget_staged(keep=local)
    # where the seconds went: downloading a remote draft (the engine serving on meanwhile), the workers' update
    # session (waiting for the engine step in progress, then checking and loading the draft: the engine waits
    # for this part), renaming
    phases = {"stage_s": round(t_staged - t0, 3), "load_s": round(t_loaded - t_staged, 3),
              "rename_s": round(time.monotonic() - t_loaded, 3)}
    return {"fingerprint": now, "previous": previous, "seconds": seconds, "phases": phases,
            "served_model_names": names}


STAGE_DIR = "swap-drafts"  # under PEAGLE_CACHE (else ~/.cache/peagle): remote drafts, downloaded for a swap


def staging_root() -> Path:
    import os

    return Path(os.environ.get("PEAGLE_CACHE") or Path.home() / ".cache" / "peagle") / STAGE_DIR


def stage_draft(uri: str) -> str:
    """A local copy of the published draft ``uri`` (every byte checked against its manifest), or ``uri`` itself
    when it is local. A draft's bytes are read from storage before the engine is asked to load them: the engine
    runs a swap between two steps and serves nothing meanwhile, so it reads a local copy."""
    from ..stage_io import fetched_input, is_remote

    if not is_remote(uri):
        return uri
    return str(fetched_input(uri, staging_root()))


def forget_staged(keep: str) -> None:
    """Delete the downloaded drafts but ``keep`` (the one serving: a failed swap loads it back from memory)."""
    import shutil

    root = staging_root()
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.is_dir() and str(entry) != keep:
            shutil.rmtree(entry, ignore_errors=True)


class StartupSwap:
    """A pod that starts under a draft pointer (:mod:`peagle.swap.pointer`) serves the pointed draft before it
    reports ready. Until the swap has succeeded every request is answered 503 -- ``/health`` too, so the
    readiness probe keeps the pod out of its Service -- and the first request starts it. A pointer of another
    template is ignored (a deploy replaced the promotion). A swap that fails keeps the pod unready, the
    reason in its answers and its log, and is tried again on a request :attr:`RETRY_S` later: a pod never
    serves a draft other than the one it was told to."""

    RETRY_S = 30.0  # a failed swap is tried again on a request this long after it failed

    def __init__(self, pointer_dir: str, template: str):
        self.pointer_dir, self.template = pointer_dir, template
        self.done = False
        self.error: str | None = None
        self._task: asyncio.Task | None = None
        self._failed_at = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "StartupSwap | None":
        from ..swap.pointer import POINTER_ENV, TEMPLATE_ENV

        directory = env.get(POINTER_ENV, "").strip()
        return cls(directory, env.get(TEMPLATE_ENV, "").strip()) if directory else None

    async def hold(self, scope, send) -> bool:
        """Answer ``scope`` with 503 while the pointed draft is not serving yet (True: answered)."""
        if self.done:
            return False
        if scope.get("type") != "http":
            return False
        if self._task is None or (self._task.done() and time.monotonic() - self._failed_at >= self.RETRY_S):
            self.error = None
            self._task = asyncio.ensure_future(self._run(scope["app"].state))
            await asyncio.sleep(0)
        if self.done:
            return False
        await _reply(send, 503, {"error": self.error or "loading the promoted draft this release serves (its draft "
                                 "pointer); not ready yet"})
        return True

    async def _run(self, state) -> None:
        try:
            await self._swap_to_pointer(state)
        finally:  # when it ended (a retry counts from a failure)
            self._failed_at = time.monotonic()

    async def _swap_to_pointer(self, state) -> None:
        from ..swap.pointer import PointerError, read_pointer

        try:
            pointer = read_pointer(self.pointer_dir)
        except (OSError, PointerError) as exc:
            self.error = f"the draft pointer cannot be read: {exc}"
            log.error("peagle: %s", self.error)
            return
        if pointer is None or not pointer.applies_to(self.template):
            if pointer is not None:
                log.warning("peagle: the draft pointer (%s) is for pod template draft %s, this pod's is %s: ignored",
                            pointer.uri, pointer.template, self.template or "unknown")
            self.done = True
            return
        client = state.engine_client
        try:
            if await served_fingerprint(client) == pointer.fingerprint:
                self.done = True
                return
            answer = await swap_in(state, client, pointer.uri, pointer.fingerprint)
        except SwapRejected as exc:
            self.error = (f"the promoted draft {pointer.fingerprint} ({pointer.uri}) did not load: {exc}; "
                          f"serving nothing until it does (draft {exc.serving} loaded)")
            log.error("peagle: %s", self.error)
            return
        except Exception as exc:  # noqa: BLE001 - kept unready, with the reason
            self.error = f"the promoted draft {pointer.fingerprint} ({pointer.uri}) did not load: {exc}"
            log.error("peagle: %s", self.error)
            return
        log.info("peagle: serving the promoted draft %s (%s) in %.2f s", pointer.fingerprint, pointer.uri,
                 answer["seconds"])
        self.done = True


# ---- the client side ---------------------------------------------------------------------------------------


class SwapFailed(RuntimeError):
    """A server did not swap its draft (``serving``: the draft it says it serves, when it answered)."""

    def __init__(self, message: str, serving: str | None = None):
        super().__init__(message)
        self.serving = serving


def swap_draft(url: str, token: str, uri: str, fingerprint: str, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Ask the server at ``url`` (its root) to serve the published draft ``uri`` (which must be ``fingerprint``);
    returns its answer once every worker serves it; :class:`SwapFailed` otherwise."""
    from ..net.json_client import HttpError, InvalidJsonError, JsonHttpClient

    where = url.rstrip("/") + SWAP_PATH
    try:
        answer = JsonHttpClient(timeout_s=timeout_s, token=token).request_json(
            "POST", where, {"uri": uri, "fingerprint": fingerprint})
    except InvalidJsonError as exc:
        raise SwapFailed(f"{where}: {exc}") from None
    except HttpError as exc:
        try:
            doc = json.loads(exc.body or "{}")
        except ValueError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        raise SwapFailed(f"{where} answered {exc.status or exc.reason}: {doc.get('error') or exc.body or exc}",
                         doc.get("fingerprint")) from None
    if not isinstance(answer, dict) or answer.get("fingerprint") != fingerprint:
        raise SwapFailed(f"{where} serves {answer.get('fingerprint') if isinstance(answer, dict) else answer!r} "
                         f"after the swap, not {fingerprint}")
    return answer


def served_draft(url: str, token: str, *, timeout_s: float = 60.0) -> str | None:
    """The draft the server at ``url`` says every worker serves (``GET`` :data:`SWAP_PATH`);
    :class:`SwapFailed` when it does not answer that."""
    from ..net.json_client import HttpError, InvalidJsonError, JsonHttpClient

    where = url.rstrip("/") + SWAP_PATH
    try:
        answer = JsonHttpClient(timeout_s=timeout_s, token=token).request_json("GET", where)
    except (HttpError, InvalidJsonError) as exc:
        raise SwapFailed(f"{where}: {exc}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("fingerprint"), (str, type(None))):
        raise SwapFailed(f"{where} answered {answer!r:.200}, not {{\"fingerprint\": ...}}")
    return answer["fingerprint"]
