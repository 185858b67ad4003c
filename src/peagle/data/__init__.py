"""Data preparation: conversations -> loss-masked token rows for training a draft (``peagle prepare``)."""
from .chat import ChatRenderer, tokenizer_fingerprint
from .errors import PrepareError, RowRejected
from .output import PreparedData, PreparedHeader, open_writer, read_manifest, read_rows, read_split, read_token_freq
from .prepare import PrepareResult, run_prepare, split_of
from .settings import PrepareSettings
from .sources import JsonRecordStream, embedded_sharegpt_path, resolve_sources

__all__ = [
    "ChatRenderer", "JsonRecordStream", "PrepareError", "PrepareResult", "PrepareSettings", "PreparedData",
    "PreparedHeader", "RowRejected",
    "embedded_sharegpt_path", "open_writer", "read_manifest", "read_rows", "read_split", "read_token_freq", "resolve_sources",
    "run_prepare", "split_of", "tokenizer_fingerprint",
]
