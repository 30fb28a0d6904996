"""Host side of the engine: requests, blocks, scheduling, batches, detokenization."""
