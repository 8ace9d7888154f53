"""Layer 2, data: rows from a source, the [start_idx, end_idx) slice, tokens, packed or padded blocks, the
rank-independent order of global batches."""
