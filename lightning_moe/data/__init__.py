"""Prompt sources (jsonl, mtbench), tokenization + chat templates, results writer, sharding.

Submodules: ``sources`` (Request, load_requests, DataError), ``tokenize`` (load_tokenizer,
encode_requests, TokenizedRequest), ``writer`` (ResultsWriter, write_json_atomic, error_record),
``shard`` (shard_of, select_shard, merge_results). Importing this package does not import transformers.
"""

from lightning_moe.data.shard import MergeError, merge_results, select_shard, shard_of
from lightning_moe.data.sources import DataError, Request, load_requests
from lightning_moe.data.writer import ResultsWriter, WriterError, error_record, read_results, write_json_atomic

__all__ = [
    "DataError", "Request", "load_requests",
    "ResultsWriter", "WriterError", "error_record", "read_results", "write_json_atomic",
    "MergeError", "merge_results", "select_shard", "shard_of",
]
