"""Device-side operations: paged KV writes, ragged paged attention, sampling."""
