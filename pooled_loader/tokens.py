"""Public import path: re-exports ``pooled_loader.ragged.tokens``, where this module lives since
the regroup (issue 41)."""
from __future__ import annotations

from .ragged.tokens import (MAGIC, VERSION, HEADER, DTYPES, TEXT_EXTENSIONS, MAX_TEXT_BYTES,
                            MAX_ID_CHUNK, TokenFileError, write_tokens, load_tokenizer, text_files,
                            write_from_texts, read_index, TokenDataset, main)  # noqa: F401
