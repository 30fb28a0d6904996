"""Device layouts: the mesh built from ParallelConfig and the sharding rules of every array."""
