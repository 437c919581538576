"""Variable-length data: collates for ragged samples (collate) written into a slot (slots),
length-aware samplers (samplers) and memory-mapped token files (tokens).

Imports core/ and engine/ (it writes into the engine's slots)."""
