"""``peagle replay``: send a prompt set to a served endpoint and print the served acceptance as it goes.

    peagle replay --url http://127.0.0.1:8000 --prompts humaneval [--concurrency 8] [--max-tokens 128] \\
        [--temperature 0] [--limit 40] [--stream] [--out results.jsonl]
    peagle replay --split http://127.0.0.1:8000=90 --split http://127.0.0.1:8001=10 --prompts humaneval ...

Each prompt is one chat request (``/v1/chat/completions``). A vLLM server started with
``--per-request-spec-decode-metrics summary`` (``peagle serve`` always is) returns every request's
acceptance histogram under ``metrics.speculative_decoding``; in a stream it rides on the last chunk,
which carries usage (the replayer asks for it). Every ~10 answers a line shows the acceptance length
and the first-position acceptance so far, with bootstrap intervals over the requests
(:mod:`peagle.stats`)::

    replay: 40/164 AL 1.42 [1.35, 1.49] p0 0.31 [0.27, 0.35] p50 1.9 s

``--split URL=WEIGHT`` (repeatable, instead of ``--url``) sends each request to one of several servers,
picked by :class:`WeightedRouter` (smooth weighted round robin: deterministic, each URL gets its weight's
share; weight 0 gets nothing). It stands in for the cluster's router (an OpenShift Route's
``alternateBackends`` weights, an HTTPRoute's backend weights, KServe's canary split) when a stable and a
canary ``peagle serve`` run side by side on one machine (``peagle rollout local``).

``--out`` writes one JSON row per request (prompt id, the URL that answered, latency, tokens, histogram, text),
replaced atomically; it is checked before the first request (a writable file, not the ``--prompts`` file).
Exit status: 0 every request answered, 3 some failed (counted; the rest are still reported), 2 bad input.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..engine.client import EndpointError, OpenAIClient, safe_url
from ..evaluate.prompts import Prompt, load_prompt_sets
from ..net.sse import StreamedAnswer, speculative_decoding
from ..stage_io import write_errors
from ..stats import bootstrap, figures
from ..storage.base import atomic_path

PROGRESS_EVERY = 10


def api_url_of(url: str) -> str:
    """A server's OpenAI API URL (``.../v1``) from its root or its API URL."""
    return url.rstrip("/").removesuffix("/v1") + "/v1"


class WeightedRouter:
    """Picks a server per request by weight: smooth weighted round robin (nginx's), a stand-in for the
    cluster's router.

    Each pick adds every URL's weight to its running score, takes the highest score (ties: the URL given
    first) and subtracts the total weight from it: over any ``sum(weights)`` picks each URL is picked
    exactly its weight's number of times, interleaved (90/10 gives one canary request in every ten, not
    ten in a row). The sequence depends on the weights only: deterministic. A URL of weight 0 is never
    picked. :meth:`set_weights` may change the split while requests are being sent (thread-safe); the
    scores restart then, so the new split holds from the next pick on.

    :meth:`route` also counts each URL's requests in flight, so :meth:`drain` can wait for a URL that
    lost its weight to finish what it was sent before its server is stopped (a router drains a backend
    before it goes away; the stable endpoint never answers with an error).
    """

    def __init__(self, weights: Mapping[str, int] | Sequence[tuple[str, int]]):
        self._cond = threading.Condition()
        self._weights: dict[str, int] = {}
        self._scores: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self.set_weights(weights)

    def set_weights(self, weights: Mapping[str, int] | Sequence[tuple[str, int]]) -> None:
        """Set the weight of each given URL (a new URL joins; the others keep theirs)."""
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        for url, weight in items:
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
                raise ValueError(f"weight of {url} must be an integer >= 0, got {weight!r}")
        with self._cond:
            for url, weight in items:
                self._weights[url] = weight
                self._in_flight.setdefault(url, 0)
            self._scores = {url: 0 for url in self._weights}

    def weights(self) -> dict[str, int]:
        with self._cond:
            return dict(self._weights)

    def pick(self) -> str:
        """The URL of the next request; a ValueError when every weight is 0."""
        with self._cond:
            live = [url for url, w in self._weights.items() if w > 0]
            if not live:
                raise ValueError(f"no server has weight: {self._weights}")
            for url in live:
                self._scores[url] += self._weights[url]
            best = max(live, key=lambda url: self._scores[url])  # max keeps the first of equals
            self._scores[best] -= sum(self._weights[url] for url in live)
            return best

    @contextmanager
    def route(self) -> Iterator[str]:
        """:meth:`pick` a URL and count the request in flight there until the block ends."""
        url = self.pick()
        with self._cond:
            self._in_flight[url] += 1
        try:
            yield url
        finally:
            with self._cond:
                self._in_flight[url] -= 1
                self._cond.notify_all()

    def in_flight(self, url: str) -> int:
        with self._cond:
            return self._in_flight.get(url, 0)

    def drain(self, url: str, timeout: float) -> bool:
        """Wait until ``url`` has no request in flight (give it weight 0 first); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight.get(url, 0) == 0, timeout)


@dataclass
class ReplayRow:
    """One request: what was sent, how long it took, what came back (``error`` set when it failed)."""

    index: int
    id: str
    latency_s: float
    url: str | None = None  # the API URL that answered (``.../v1``)
    first_byte_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    histogram: list[int] | None = None  # metrics.speculative_decoding.acceptance_histogram
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class ReplayResult:
    """All requests of one replay (in prompt order) and the wall time it took."""

    rows: list[ReplayRow]
    elapsed_s: float
    concurrency: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def answered(self) -> list[ReplayRow]:
        return [r for r in self.rows if r.error is None]

    def histograms(self) -> list[list[int]]:
        return [r.histogram for r in self.answered if r.histogram]

    def figures(self, *, resamples: int = 1000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
        """Acceptance (AL, first position, with bootstrap intervals over requests), latency percentiles
        and throughput of the answered requests."""
        return summarise(self.rows, self.elapsed_s, resamples=resamples, level=level, seed=seed)

    def figures_by_url(self, *, resamples: int = 1000, level: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
        """:meth:`figures` of the requests each URL answered (a failed request counts where it was sent)."""
        urls = sorted({r.url for r in self.rows if r.url})
        return {url: summarise([r for r in self.rows if r.url == url], self.elapsed_s, resamples=resamples,
                               level=level, seed=seed) for url in urls}


def summarise(rows: Sequence[ReplayRow], elapsed_s: float, *, resamples: int = 1000, level: float = 0.95,
              seed: int = 0) -> dict[str, Any]:
    answered = [r for r in rows if r.error is None]
    hists = [r.histogram for r in answered if r.histogram]
    point = figures(np.array(hists)) if hists else None
    ci = bootstrap(hists, resamples=resamples, level=level, seed=seed)
    latencies = np.array([r.latency_s for r in answered]) if answered else None
    tokens = sum(r.completion_tokens or 0 for r in answered)
    p0 = point["per_position_acceptance"][0] if point and point["per_position_acceptance"] else None
    return {
        "requests": len(rows), "answered": len(answered), "failed": len(rows) - len(answered),
        "with_histogram": len(hists),
        "acceptance_length": point["acceptance_length"] if point else None,
        "acceptance_length_ci": ci["acceptance_length"] if ci else None,
        "first_position_acceptance": p0,
        "first_position_acceptance_ci": ci["per_position_acceptance"][0] if ci and ci["per_position_acceptance"]
        else None,
        "per_position_acceptance": point["per_position_acceptance"] if point else None,
        "latency_p50_s": float(np.percentile(latencies, 50)) if latencies is not None else None,
        "latency_p99_s": float(np.percentile(latencies, 99)) if latencies is not None else None,
        "elapsed_s": elapsed_s,
        "requests_per_s": len(answered) / elapsed_s if elapsed_s > 0 else None,
        "tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else None,
        "completion_tokens": tokens,
    }


def _interval(ci: list[float] | None, digits: int) -> str:
    return f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else ""


def progress_line(done: int, total: int, fig: dict[str, Any]) -> str:
    """``replay: 40/164 AL 1.42 [1.35, 1.49] p0 0.31 [0.27, 0.35] p50 1.9 s`` (what is known so far)."""
    line = f"replay: {done}/{total}"
    if fig["acceptance_length"] is not None:
        line += f" AL {fig['acceptance_length']:.2f}{_interval(fig['acceptance_length_ci'], 2)}"
        line += f" p0 {fig['first_position_acceptance']:.2f}{_interval(fig['first_position_acceptance_ci'], 2)}"
    else:
        line += " AL - (no acceptance histograms: is the server speculating with per-request metrics?)"
    if fig["latency_p50_s"] is not None:
        line += f" p50 {fig['latency_p50_s']:.2f} s"
    if fig["failed"]:
        line += f" failed {fig['failed']}"
    return line


def _histogram(spec: dict[str, Any] | None) -> list[int] | None:
    """The ``acceptance_histogram`` of a ``metrics.speculative_decoding`` object, or None."""
    h = (spec or {}).get("acceptance_histogram")
    return [int(x) for x in h] if isinstance(h, list) else None


def _usage(row: ReplayRow, usage: dict[str, Any] | None) -> None:
    if usage:
        row.prompt_tokens = usage.get("prompt_tokens")
        row.completion_tokens = usage.get("completion_tokens")


def stream_chat(client: OpenAIClient, body: dict[str, Any], *, row: ReplayRow, t0: float) -> None:
    """Send a streamed chat request and fill ``row`` from its server-sent events
    (:meth:`~peagle.engine.client.OpenAIClient.stream_events`, added up by :class:`peagle.net.sse.StreamedAnswer`):
    the text of the deltas, the finish reason, and usage and metrics from the last chunk."""
    answer = StreamedAnswer()
    for data in client.stream_events(body):
        if answer.add(data) and row.first_byte_s is None:
            row.first_byte_s = time.perf_counter() - t0
    row.text, row.finish_reason = answer.text, answer.finish_reason
    _usage(row, answer.usage)
    row.histogram = _histogram(answer.speculative_decoding)


class _Servers:
    """One client and served model name per API URL, made on first use (a canary may join mid-replay)."""

    def __init__(self, *, model: str | None, token: str | None, timeout: float, retries: int):
        self.model, self.token, self.timeout, self.retries = model, token, timeout, retries
        self._lock = threading.Lock()
        self._known: dict[str, tuple[OpenAIClient, str]] = {}

    def get(self, url: str) -> tuple[OpenAIClient, str]:
        api_url = api_url_of(url)
        with self._lock:
            if api_url in self._known:
                return self._known[api_url]
        client = OpenAIClient(api_url, token=self.token, timeout=self.timeout, retries=self.retries)
        model = self.model or next(iter(client.models()), "")
        if not model:
            raise EndpointError(f"{api_url}/models lists no model; give the model name")
        with self._lock:
            return self._known.setdefault(api_url, (client, model))

    def models(self) -> list[str]:
        """The served model names of the servers used so far."""
        with self._lock:
            return sorted({model for _, model in self._known.values()})


def _one(servers: _Servers, route: Callable[[], Any], index: int, prompt: Prompt, params: dict[str, Any],
         stream: bool) -> ReplayRow:
    """Send one prompt to the URL ``route()`` yields (a context manager: the router counts it in flight)."""
    row = ReplayRow(index=index, id=prompt.id, latency_s=0.0)
    t0 = time.perf_counter()
    try:
        with route() as url:
            client, model = servers.get(url)
            row.url = client.api_url
            body = {"messages": prompt.chat(), "model": model, **params}
            t0 = time.perf_counter()
            if stream:
                stream_chat(client, body, row=row, t0=t0)
            else:
                data = client.chat(body)
                choice = data["choices"][0]
                row.text = (choice.get("message") or {}).get("content") or ""
                row.finish_reason = choice.get("finish_reason")
                _usage(row, data.get("usage"))
                row.histogram = _histogram(speculative_decoding(data))
    except (EndpointError, ValueError) as exc:
        row.error = str(exc)
    row.latency_s = time.perf_counter() - t0
    return row


def replay(url: str | WeightedRouter, prompts: Sequence[Prompt], *, concurrency: int = 1, max_tokens: int = 128,
           temperature: float = 0.0, seed: int | None = None, model: str | None = None, stream: bool = False,
           token: str | None = None, timeout: float = 600.0, retries: int = 2,
           progress: Callable[[str], None] | None = print, progress_every: int = PROGRESS_EVERY) -> ReplayResult:
    """Send every prompt as a chat request to the OpenAI server at ``url`` (its root or ``.../v1``), or
    to the server a :class:`WeightedRouter` picks per request (when it is sent: a weight changed
    mid-replay holds for the requests not yet sent; ``ReplayRow.url`` says which answered),
    ``concurrency`` at a time; ``model`` defaults to the first one each server lists. ``progress``
    gets a :func:`progress_line` every ``progress_every`` answers and at the end."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    servers = _Servers(model=model, token=token, timeout=timeout, retries=retries)
    if isinstance(url, WeightedRouter):
        route, where = url.route, {"split": {safe_url(api_url_of(u)): w for u, w in url.weights().items()}}
    else:
        servers.get(url)  # a server that lists no model fails the replay here, not every request
        route, where = (lambda: nullcontext(url)), {"url": safe_url(api_url_of(url))}
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        params["seed"] = seed
    rows: list[ReplayRow] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(_one, servers, route, i, p, params, stream) for i, p in enumerate(prompts)]
        for fut in as_completed(futures):
            with lock:
                rows.append(fut.result())
                done = len(rows)
            if progress is not None and (done % progress_every == 0 or done == len(prompts)):
                progress(progress_line(done, len(prompts), summarise(rows, time.perf_counter() - t0, resamples=200)))
    elapsed = time.perf_counter() - t0
    rows.sort(key=lambda r: r.index)
    models = servers.models()
    return ReplayResult(rows, elapsed, concurrency, meta={**where, "model": ", ".join(models),
                                                          "stream": stream, "max_tokens": max_tokens,
                                                          "temperature": temperature})


def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """The prompts of a set name or ``.jsonl`` file (:func:`peagle.evaluate.prompts.load_prompt_sets`),
    all categories in order, the first ``limit``."""
    if limit is not None and limit < 1:  # 0 used to mean "all": refused rather than silently sending them all
        raise ValueError(f"--limit: {limit} is not a number of prompts to send (at least 1; omit it to send all)")
    prompts = [p for ps in load_prompt_sets([name]).values() for p in ps.prompts]
    return prompts if limit is None else prompts[:limit]


def write_rows(result: ReplayResult, out: str | Path) -> None:
    """The rows as JSON lines at ``out``, replaced atomically (a failed write leaves the old file)."""
    with write_errors(str(out), Path(out).parent), atomic_path(Path(out)) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in result.rows:
                fh.write(json.dumps(asdict(row)) + "\n")
