"""The device mesh of a replica, from `ParallelConfig`.

Axes ("data", "pipeline", "tensor"), in that order and with the sizes data_parallel_size,
pipeline_parallel_size and tensor_parallel_size. A data-parallel replica is an engine of its
own on one slice of the "data" axis, so a replica's mesh is ("pipeline", "tensor"). The axes
are of the classic automatic kind (GSPMD propagates shardings and inserts the collectives);
`jax.make_mesh` would make explicit axes by default in jax 0.10.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

DATA, PIPELINE, TENSOR = "data", "pipeline", "tensor"


def device_grid(devices, data: int, pipeline: int, tensor: int) -> np.ndarray:
    """The devices as a [data, pipeline, tensor] array (the first data*pipeline*tensor ones).

    Raises:
        ValueError: fewer devices than the layout needs (the message says how many).
    """
    need = data * pipeline * tensor
    devices = list(devices)
    if len(devices) < need:
        raise ValueError(
            f"data_parallel_size x pipeline_parallel_size x tensor_parallel_size = {data} x "
            f"{pipeline} x {tensor} = {need} devices are needed, {len(devices)} are available"
        )
    return np.asarray(devices[:need], dtype=object).reshape(data, pipeline, tensor)


def replica_mesh(devices: np.ndarray) -> Mesh:
    """The ("pipeline", "tensor") mesh of one replica. devices: [pipeline, tensor]."""
    return Mesh(devices, (PIPELINE, TENSOR))
