"""Production backend: vLLM's ``extract_hidden_states`` speculative method + :mod:`.connector`.

vLLM starts worker processes with spawn and holds much memory, so the engine always runs in a child
interpreter (``python -m peagle.extract.vllm_backend``): callers -- tests, the CLI, pipeline steps --
need no ``__main__`` guard. :func:`run_engine_job` (parent side) sends the child a JSON job on stdin;
the child (:func:`engine_main`) starts one engine, extracts the shard sets listed in the job, set by
set, writing and publishing each itself (hidden states never cross the process boundary,
:func:`.output.extract_sets`), then prints one result line with the entries of the shards it wrote.

Per request: the prompt is sent pre-tokenised with ``max_tokens=1``; the connector writes the
prompt's hidden states to ``<scratch>/<request>.safetensors`` and returns that path in
``kv_transfer_params``. :func:`read_request_file` waits on the file's ``.lock`` (the connector holds
it exclusively until the file is complete), checks the stored token ids equal the row's and splits
``hidden_states`` [T, 4, H] into aux [T, 3, H] and last [T, H].

Progress: the child reports every finished request through :func:`peagle.progress.child_reporter`
(vLLM's ``use_tqdm`` hook, :func:`peagle.engine.metering.vllm_tqdm`); :func:`run_engine_job` hands
those lines to the caller's ``progress``.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
from typing import Any

from safetensors.torch import load_file

from .. import progress as progress_mod
from ..scratch import owned_dir
from ..engine import child, llm as engine
from ..engine.metering import vllm_tqdm
from ..storage import open_store
from .errors import ExtractError
from .output import SAY_PREFIX, SetJob, extract_sets
from .rows import ExtractRow, CapturedHiddenStates
from .settings import ExtractSettings, LayerIds
from .shard_format import DatasetHeader

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "PeagleHiddenStatesConnector"
CONNECTOR_MODULE = "peagle.extract.connector"
PROGRESS_MARKER = "PEAGLE_EXTRACT_PROGRESS "


def read_request_file(path: str, row: ExtractRow) -> CapturedHiddenStates:
    """Load one connector output file for ``row`` (waiting for its write to finish), then delete it."""
    lock_path = path + ".lock"
    try:
        if os.path.exists(lock_path):
            with open(lock_path) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the writer thread releases LOCK_EX
                data = load_file(path, device="cpu")
        else:  # connector configured without locks: the file is complete once the request finished
            data = load_file(path, device="cpu")
    except FileNotFoundError:
        raise ExtractError(f"sample {row.sample_id!r}: vLLM wrote no hidden-state file at {path}") from None
    finally:
        for p in (lock_path, path):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
    got = data["token_ids"].tolist()
    if got != list(row.input_ids):
        first = next((i for i, (a, b) in enumerate(zip(got, row.input_ids)) if a != b), min(len(got), row.num_tokens))
        raise ExtractError(
            f"sample {row.sample_id!r}: token ids returned by vLLM differ from the input "
            f"({len(got)} vs {row.num_tokens} tokens, first difference at position {first})"
        )
    hs = data["hidden_states"]
    if hs.ndim != 3 or hs.shape[0] != row.num_tokens or hs.shape[1] != 4:
        raise ExtractError(f"sample {row.sample_id!r}: hidden_states has shape {tuple(hs.shape)}, "
                           f"expected ({row.num_tokens}, 4, H)")
    return CapturedHiddenStates(row, hs[:, :3].contiguous(), hs[:, 3].contiguous())


class VllmHiddenStatesExtractor:
    """One vLLM engine configured for hidden-state extraction. Only instantiate in the engine process."""

    def __init__(self, target: str, layer_ids: LayerIds, dtype: str, settings: ExtractSettings,
                 max_model_len: int, scratch_dir: str, progress=None):
        from vllm import SamplingParams

        self.scratch_dir = scratch_dir
        self.progress = progress  # advanced by one per finished request (samples)
        engine_settings = settings.engine.model_copy(update={"max_model_len": max_model_len})
        kwargs = engine.engine_kwargs(
            engine_settings, target, seed=settings.seed, dtype=dtype,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids.all}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR_CLASS,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": scratch_dir},
            },
        )
        self.llm = engine.build_llm(kwargs, engine_settings)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def extract(self, rows: list[ExtractRow]) -> list[CapturedHiddenStates]:
        """Hidden states of ``rows``, in the order given (vLLM schedules them as one batch)."""
        prompts = [{"prompt_token_ids": list(r.input_ids)} for r in rows]
        hook = vllm_tqdm(self.progress) if self.progress is not None else False
        outputs = self.llm.generate(prompts, self.params, use_tqdm=hook)
        results = []
        for row, out in zip(rows, outputs):
            if list(out.prompt_token_ids or []) != list(row.input_ids):
                raise ExtractError(f"sample {row.sample_id!r}: vLLM's prompt token ids differ from the input")
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise ExtractError(f"sample {row.sample_id!r}: vLLM returned no hidden_states_path "
                                   "(is the extract_hidden_states connector active?)")
            results.append(read_request_file(path, row))
        return results

    def close(self) -> None:
        engine.shutdown(self.llm)
        del self.llm


# ----------------------------------------------------------------------------------------------
# Engine process


def engine_main() -> None:
    """Child entry: run the job read from stdin; print one result (or error) line on stdout."""
    job = json.loads(sys.stdin.read())
    try:
        records = _run_job(job)
    except ExtractError as exc:
        child.print_error(str(exc))
        sys.exit(2)
    child.print_result(records)


def _run_job(job: dict[str, Any]) -> list[dict[str, Any]]:
    settings = ExtractSettings.model_validate(job["settings"])
    header = DatasetHeader.from_dict(job["header"])
    layer_ids = LayerIds(aux=tuple(job["layer_ids"][:-1]), last=job["layer_ids"][-1])
    store = open_store(job["out_dir"])
    scratch = str(owned_dir("peagle-hs-", settings.scratch_dir))  # swept by the next job if this one is killed
    reporter = progress_mod.child_reporter()
    extractor = VllmHiddenStatesExtractor(job["target"], layer_ids, header.compute_dtype, settings,
                                          int(job["max_model_len"]), scratch, reporter)
    reporter.ready()

    def shard_done(entry: dict[str, Any], seconds: float) -> None:
        progress = {"shard": entry["name"], "samples": entry["num_samples"], "tokens": entry["num_tokens"],
                    "seconds": round(seconds, 3)}
        print(PROGRESS_MARKER + json.dumps(progress), file=sys.stderr, flush=True)

    try:
        records = extract_sets(extractor, [SetJob.from_dict(j) for j in job["sets"]], store, header, shard_done,
                               max_sets_ahead=settings.max_sets_ahead,
                               wait_timeout_s=settings.max_sets_ahead_timeout_s)
        reporter.flush()
    finally:
        extractor.close()
        try:
            os.rmdir(scratch)  # empty unless a request file was left behind after an error
        except OSError:
            pass
    return records


# ----------------------------------------------------------------------------------------------
# Parent side


def run_engine_job(job: dict[str, Any], settings: ExtractSettings,
                   progress: progress_mod.Progress | None = None) -> list[dict[str, Any]]:
    """Run ``job`` in a fresh interpreter; return the entries of the shards it wrote (their sets published).

    The child's per-request progress goes to ``progress`` (samples done; its total is the caller's).
    The child's stderr (vLLM's log) is logged at DEBUG, shard lines at INFO, lines for the user
    (:func:`.output.say`: what a shard set waits for) go to this process's stderr; on failure the error
    names the sample/shard when the child could, else the last lines of its log are included.
    Past ``settings.engine.timeout_s`` the engine and its workers are killed.
    """
    def shard_line(line: str) -> bool:
        if line.startswith(PROGRESS_MARKER):
            log.info("extracted %s", line[len(PROGRESS_MARKER):])
            return True
        if line.startswith(SAY_PREFIX):
            print(line, file=sys.stderr, flush=True)
            return True
        return False

    env = engine.engine_child_env(settings.engine, offline=True)  # the target is a local directory
    return child.run_module("peagle.extract.vllm_backend", job, what="vLLM extraction engine", error=ExtractError,
                            progress=progress, env=env, timeout=settings.engine.timeout_s, on_stderr=shard_line)


if __name__ == "__main__":
    engine_main()
