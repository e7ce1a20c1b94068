"""Retrieval indexes for the suffix drafter: an on-disk datastore (suffix array over token ids,
built by ``specdecode index build``) and in-memory tables for a request's own tokens and the
history of earlier requests."""

from specdecode.index.build import build_datastore
from specdecode.index.datastore import Datastore, DatastoreMeta
from specdecode.index.fingerprint import tokenizer_fingerprint
from specdecode.index.history import SuffixHistory
from specdecode.index.ngram_table import NgramTable
from specdecode.index.suffix_array import SuffixIndex, build_suffix_array

__all__ = ["Datastore", "DatastoreMeta", "NgramTable", "SuffixHistory", "SuffixIndex", "build_datastore",
           "build_suffix_array", "tokenizer_fingerprint"]
