"""Response regeneration: the target rewrites every assistant turn, so the draft learns on-policy.

``run_regenerate`` reads conversations from the same sources as ``prepare``, keeps their system and
user turns, and regenerates the assistant turns one by one (turn k is generated with the already
regenerated turns 1..k-1 as history). Output is a JSONL file of ``{"id", "source", "messages",
"finish_reasons"}`` records in OpenAI ``messages`` form, which ``prepare`` takes as a source.

Two generators, one contract (``generate(list of message lists) -> list of (text, finish_reason)``):

* ``vllm``: offline batches with real vLLM in a child interpreter (vLLM spawns workers);
* ``endpoint``: an OpenAI-compatible ``/v1/chat/completions`` server, e.g. a deployed KServe
  InferenceService, with bounded concurrency and retries. The API key comes from the environment.

The vllm backend renders each prompt with the target's chat template (to count its tokens) within the
time limit prepare's renders have (``prepare.template_time_limit_s``: one target, one template, one
limit); a template that passes it stops the stage with :class:`~peagle.data.errors.TemplateTimeout`.

Resumable by sample id: records are appended and flushed one conversation at a time; a rerun skips
ids already in the output (a torn last line from a crash is cut off first).

Progress (:mod:`peagle.progress`) counts conversations toward ``max_conversations`` (unknown
without it): each regenerated reply is worth 1/T of its conversation (T: the turns it gets), so the
count moves with every finished request and is exact whenever a round of turns ends.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from .. import progress as progress_mod
from ..engine import child, llm as engine
from ..engine.client import EndpointError, OpenAIClient
from ..engine.metering import vllm_tqdm
from .chat import TEMPLATE_TIME_LIMIT_S, ChatRenderer
from .errors import PrepareError, RowRejected
from .rows import Conversation, parse_row, row_id_of
from .settings import PrepareSettings, RegenerateSettings
from .sources import resolve_sources

log = logging.getLogger(__name__)

@dataclass
class RegenerateResult:
    output: Path
    counts: dict[str, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Input and resume


def _conversations(settings: RegenerateSettings):
    """Yield (sample_id, source label, Conversation) for usable conversation rows."""
    n = 0
    for src in resolve_sources(settings.sources):
        for index, row in src.iter_rows():
            try:
                parsed = parse_row(row, vocab_size=1 << 31)
            except RowRejected:
                continue
            if not isinstance(parsed, Conversation):
                continue  # pre-tokenised rows have no turns to regenerate
            rid = row_id_of(row) if isinstance(row, dict) else None
            yield f"{src.label}/{rid if rid is not None else index}", src.label, parsed
            n += 1
            if settings.max_conversations is not None and n >= settings.max_conversations:
                return


def done_ids(output: Path) -> set[str]:
    """Ids already written; cuts off a torn last line (a crash mid-write) so appends stay valid JSONL."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(output, "r+b") as fh:
            fh.truncate(len(keep))
    ids = set()
    for line in keep.decode("utf-8").splitlines():
        if line.strip():
            ids.add(json.loads(line)["id"])
    return ids


# ----------------------------------------------------------------------------------------------
# Generators


class EndpointGenerator:
    """Chat completions against an OpenAI-compatible server."""

    def __init__(self, settings: RegenerateSettings):
        if settings.max_prompt_tokens is not None:
            raise PrepareError("regenerate.max_prompt_tokens needs the vllm backend (it counts tokens with the "
                               "target's tokenizer); the endpoint backend sends every prompt")
        if not settings.endpoint:
            raise PrepareError("regenerate backend 'endpoint' needs regenerate.endpoint (an OpenAI-compatible /v1 URL)")
        self.s = settings
        self.client = OpenAIClient(settings.endpoint, token=os.environ.get(settings.api_key_env),  # never logged
                                   retries=settings.request_retries)
        self.model = settings.model_name or self._first_model()

    def _first_model(self) -> str:
        try:
            models = self.client.models()
        except EndpointError as exc:
            raise PrepareError(f"regenerate endpoint: {exc}") from None
        if not models:
            raise PrepareError(f"endpoint {self.client.api_url} lists no models; set regenerate.model_name")
        return models[0]

    def _one(self, messages: list[dict]) -> tuple[str, str]:
        try:
            out = self.client.chat({"model": self.model, "messages": messages, "max_tokens": self.s.max_tokens,
                                    "temperature": self.s.temperature, "seed": self.s.seed})
        except EndpointError as exc:
            raise PrepareError(f"regenerate endpoint: {exc}") from None
        choice = out["choices"][0]
        return choice["message"].get("content") or "", choice.get("finish_reason") or ""

    def generate(self, batch: list[list[dict]], progress=None) -> list[tuple[str, str]]:
        """Replies in batch order; each finished request advances ``progress`` by 1."""
        def one(messages: list[dict]) -> tuple[str, str]:
            reply = self._one(messages)
            if progress is not None:
                progress.advance(1)
            return reply

        with ThreadPoolExecutor(self.s.concurrency) as pool:
            return list(pool.map(one, batch))


class PromptCounter:
    """Tokens of a prompt as vLLM's ``chat()`` counts them, the chat template rendered by
    :class:`~peagle.data.chat.ChatRenderer` (within ``time_limit_s``; ``source`` names the template's owner)."""

    def __init__(self, tokenizer: Any, time_limit_s: float | None, source: str):
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, time_limit_s=time_limit_s, source=source)

    def __call__(self, messages: list[dict]) -> int | None:
        """The prompt's tokens; None when the template refuses the conversation (raise_exception)."""
        try:
            text = self.renderer.prompt(messages)
        except RowRejected:
            return None
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


PROBE_CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Hello! Can you help me?"}]


def probe_template(target: str, time_limit_s: float | None) -> None:
    """Render :data:`PROBE_CONVERSATION` with ``target``'s chat template within ``time_limit_s``:
    :class:`TemplateTimeout` (a PrepareError naming the target and the limit) past it. A template that
    refuses the conversation is left to the per-conversation handling."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True, trust_remote_code=False)
    renderer = ChatRenderer(tokenizer, time_limit_s=time_limit_s, source=f"target {target}")
    with renderer.time_limits():
        try:
            renderer.prompt(PROBE_CONVERSATION)
        except RowRejected:
            pass


class VllmGenerator:
    """Offline batches with real vLLM; only constructed inside the child interpreter."""

    def __init__(self, settings: RegenerateSettings, target: str,
                 template_time_limit_s: float | None = TEMPLATE_TIME_LIMIT_S):
        from vllm import SamplingParams

        # vLLM renders the chat template once while it starts, outside any time limit of ours: a
        # template that never ends would hold the engine (and its minutes of loading) first. One
        # render through the time-limited renderer before the engine exists ends that in seconds.
        probe_template(target, template_time_limit_s)
        # log stats on: the progress meter reads vLLM's generated-token counter (peagle.engine.metering)
        kwargs = engine.engine_kwargs(settings.engine, target, seed=settings.seed, log_stats=True)
        self.llm = engine.build_llm(kwargs, settings.engine)
        self.params = SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                     seed=settings.seed)
        self.prompt_tokens = PromptCounter(self.llm.get_tokenizer(), template_time_limit_s, f"target {target}")
        self.max_prompt = self.llm.llm_engine.model_config.max_model_len - 1
        if settings.max_prompt_tokens is not None:
            self.max_prompt = min(self.max_prompt, settings.max_prompt_tokens)

    def generate(self, batch: list[list[dict]], progress=None) -> list[tuple[str, str]]:
        """Replies in batch order; each finished request advances ``progress`` by 1."""
        # vLLM refuses a whole batch when one prompt exceeds the context; such a prompt (or one over
        # max_prompt_tokens, or one the template refuses) gets an empty reply instead, which ends its
        # conversation (_regenerate_batch).
        with self.prompt_tokens.renderer.time_limits():
            sizes = [self.prompt_tokens(m) for m in batch]
        replies = [("", "prompt_too_long" if n is not None else "template_error") for n in sizes]
        kept = [i for i, n in enumerate(sizes) if n is not None and n <= self.max_prompt]
        hook = (vllm_tqdm(progress, llm=self.llm, max_tokens=self.params.max_tokens)
                if progress is not None else False)
        for i, o in zip(kept, self.llm.chat([batch[i] for i in kept], self.params, use_tqdm=hook)):
            replies[i] = (o.outputs[0].text, o.outputs[0].finish_reason or "")
        return replies


def prepare_settings(prepare: PrepareSettings, settings: RegenerateSettings, regenerated: Path) -> PrepareSettings:
    """What ``prepare`` reads after regeneration: the regenerated conversations (``regenerated``, JSONL)
    and, with ``keep_source_replies``, the first rows of the regeneration's sources as written, as many
    per source as there are regenerated conversations (``prepare.max_samples`` lifted: the cap is per source)."""
    sources = [str(regenerated)]
    if not settings.keep_source_replies:
        return prepare.model_copy(update={"sources": sources})
    with open(regenerated, encoding="utf-8") as fh:
        conversations = sum(1 for line in fh if line.strip())
    return prepare.model_copy(update={"sources": sources + list(settings.sources), "max_samples": None,
                                      "max_rows_per_source": max(1, conversations)})


# ----------------------------------------------------------------------------------------------
# The loop


class _ConversationCredit:
    """Progress in conversations while their turns are generated round by round.

    A conversation that gets T replies is credited 1/T per reply; during a round each finished
    request is credited the round's mean share (vLLM does not say whose request finished), and
    :meth:`settle` makes the count exact when the round ends (an early end credits the rest).
    """

    def __init__(self, progress, convs: list[Conversation], max_turns: int | None):
        self.progress = progress
        self.turns = [min(sum(m["role"] == "assistant" for m in c.messages), max_turns or math.inf) for c in convs]
        self.credited = [0.0] * len(convs)
        self.live = 0.0  # credited during the current round, not yet assigned to conversations
        for i, t in enumerate(self.turns):
            if t == 0:  # nothing to regenerate: done at once
                self._credit(i, 1.0)

    def _credit(self, i: int, share: float) -> None:
        self.progress.advance(share - self.credited[i])
        self.credited[i] = share

    def round(self, owners: list[int]) -> _RoundReporter:
        """The reporter for one round's generate call (its ``advance(n)`` counts requests)."""
        return _RoundReporter(self, sum(1.0 / self.turns[i] for i in owners) / len(owners))

    def settle(self, i: int, replies: int, ended: bool) -> None:
        share = 1.0 if ended else replies / self.turns[i]
        taken = min(self.live, share - self.credited[i])  # this round's live credit, as far as it goes
        self.live -= taken
        self.credited[i] += taken
        self._credit(i, share)

    def end_round(self) -> None:
        self.live = 0.0  # every owner settled: what is left over was already counted (cannot exceed)


class _RoundReporter:
    def __init__(self, credit: _ConversationCredit, share: float):
        self.credit, self.share = credit, share
        self.lock = threading.Lock()  # the endpoint backend finishes requests on a thread pool

    def advance(self, n: float = 1) -> None:
        with self.lock:
            self.credit.live += n * self.share
        self.credit.progress.advance(n * self.share)

    # the token budget (peagle.engine.metering.vllm_tqdm's meter) is the whole run's, not per conversation
    def add_work(self, total: float, unit: str = "tokens") -> None:
        self.credit.progress.add_work(total, unit)

    def advance_work(self, n: float) -> None:
        self.credit.progress.advance_work(n)


def _regenerate_batch(generator, convs: list[Conversation], max_turns: int | None = None,
                      progress=None) -> list[tuple[list[dict], list[str]]]:
    """Regenerate the assistant turns (the first ``max_turns``, default all) of each conversation,
    round by round (turn k of all at once). ``progress`` (an ``advance(n)``) is credited
    conversations (:class:`_ConversationCredit`): ``len(convs)`` in all."""
    histories: list[list[dict]] = [[] for _ in convs]
    finishes: list[list[str]] = [[] for _ in convs]
    pending = [list(c.messages) for c in convs]
    alive = list(range(len(convs)))
    credit = _ConversationCredit(progress, convs, max_turns) if progress is not None else None
    while alive:
        prompts, owners = [], []
        for i in alive:
            # move system/user turns up to the next assistant turn into the history
            while pending[i] and pending[i][0]["role"] != "assistant":
                histories[i].append(pending[i].pop(0))
            if pending[i]:
                pending[i].pop(0)  # the original reply is replaced
                prompts.append(list(histories[i]))
                owners.append(i)
        if not prompts:
            break
        replies = generator.generate(prompts, credit.round(owners)) if credit else generator.generate(prompts)
        still = []
        for i, (text, finish) in zip(owners, replies):
            if not text.strip():
                pending[i] = []  # an empty reply ends the conversation here
            else:
                histories[i].append({"role": "assistant", "content": text})
                finishes[i].append(finish)
                if max_turns is not None and len(finishes[i]) >= max_turns:
                    pending[i] = []
                still.append(i)
            if credit:
                ended = not any(m["role"] == "assistant" for m in pending[i])
                credit.settle(i, len(finishes[i]), ended)
        if credit:
            credit.end_round()
        alive = still
    out = []
    for hist, fin in zip(histories, finishes):
        while hist and hist[-1]["role"] != "assistant":
            hist.pop()  # trailing user turn without a reply teaches nothing
        out.append((hist, fin))
    return out


def regenerate_into(settings: RegenerateSettings, output: Path, make_generator, progress=None) -> dict[str, int]:
    """Append regenerated conversations to ``output``; ``make_generator()`` is called only if there is work.

    ``progress`` (a :class:`peagle.progress.Progress` or a child's relay) is advanced in
    conversations; ones already in ``output`` are skipped, not counted in the rate."""
    output.parent.mkdir(parents=True, exist_ok=True)
    generator = None
    done = done_ids(output)
    counts = {"already_done": 0, "regenerated": 0, "dropped_empty": 0}
    todo: list[tuple[str, str, Conversation]] = []

    def flush() -> None:
        nonlocal generator
        if generator is None:
            generator = make_generator()
            if progress is not None:
                progress.ready()  # the engine is up: the rate counts generation only
        results = _regenerate_batch(generator, [c for _, _, c in todo], settings.max_turns, progress)
        with open(output, "a", encoding="utf-8") as fh:
            for (sid, label, _), (messages, finishes) in zip(todo, results):
                if not any(m["role"] == "assistant" for m in messages):
                    counts["dropped_empty"] += 1
                    continue
                fh.write(json.dumps({"id": sid, "source": label, "messages": messages,
                                     "finish_reasons": finishes}, ensure_ascii=False) + "\n")
                counts["regenerated"] += 1
            fh.flush()
            os.fsync(fh.fileno())
        todo.clear()

    for sid, label, conv in _conversations(settings):
        if sid in done:
            counts["already_done"] += 1
            if progress is not None:
                progress.skip(1)
            continue
        todo.append((sid, label, conv))
        if len(todo) >= settings.conversations_per_batch:
            flush()
    if todo:
        flush()
    return counts


def run_regenerate(settings: RegenerateSettings, target: str | os.PathLike | None, output: str | os.PathLike,
                   progress: progress_mod.Progress | None = None, *,
                   template_time_limit_s: float | None = TEMPLATE_TIME_LIMIT_S) -> RegenerateResult:
    """Regenerate into ``output`` (JSONL). ``target`` is the model directory for the vllm backend;
    ``progress`` replaces the stage's own meter (a benchmark reads when the engine was ready);
    ``template_time_limit_s``: seconds one chat-template render may take (``prepare.template_time_limit_s``)."""
    output = Path(output)
    if progress is None:
        progress = progress_mod.Progress("regenerate", settings.max_conversations, "conversations")
    if settings.backend == "endpoint":
        with progress:
            counts = regenerate_into(settings, output, lambda: EndpointGenerator(settings), progress)
        return RegenerateResult(output, counts)
    if not target:
        raise PrepareError("regenerate backend 'vllm' needs a target directory")
    job = {"settings": settings.model_dump(), "target": str(target), "output": str(output),
           "template_time_limit_s": template_time_limit_s}
    with progress:
        counts = child.run_module("peagle.data.regenerate", job, what="offline regeneration", error=PrepareError,
                                  progress=progress, env=engine.engine_child_env(settings.engine),
                                  timeout=settings.engine.timeout_s)
    return RegenerateResult(output, counts)


def _child_main() -> None:
    job: dict[str, Any] = json.loads(sys.stdin.read())
    settings = RegenerateSettings.model_validate(job["settings"])
    reporter = progress_mod.child_reporter()
    limit = job.get("template_time_limit_s", TEMPLATE_TIME_LIMIT_S)
    try:
        counts = regenerate_into(settings, Path(job["output"]), lambda: VllmGenerator(settings, job["target"], limit),
                                 reporter)
    except PrepareError as exc:  # one the child can name (a template past its time limit, a missing source)
        child.print_error(str(exc))
        sys.exit(2)
    reporter.flush()
    child.print_result(counts)


if __name__ == "__main__":
    _child_main()
