"""Which decoder layers each pipeline stage holds, and where they sit in the padded stacks.

The split (`stage_partition`) is vLLM's (`vllm.distributed.utils.get_pp_indices`): each of
the P stages gets L // P layers and the L % P remaining ones go one each to the stages just
before the last (stage P - 2, then P - 3, ...), because the last stage also runs the final
norm, the LM head and the sampler; 30 layers over 4 stages are [7, 8, 8, 7]. A user-given
partition (`pp_layer_partition="16,14"`, vLLM's `VLLM_PP_LAYER_PARTITION` as an engine
argument) replaces the rule: P positive counts adding up to L.

Stacks of unequal stages (`StageLayout`): a weight's stacked layer axis, and the KV cache's,
is sharded over the "pipeline" mesh axis, and a sharded array has equal shards, so every
stage holds `stage_size` = max(sizes) rows: stage s's layers in its first sizes[s] rows, zeros
after them. The pipeline runs only a stage's real rows (`sharding.pipeline`,
`models.layers.scan_layers`), so the padding costs memory (the difference to the largest
stage, on the smaller stages) but no compute. Per-stage stacks on separate device sets would
save that memory, but one jitted step runs on one mesh: arrays on different device sets
cannot enter the same `shard_map`. With L divisible by P there is no padding and the layout
is the one of the even split.

This module imports no jax: the engine arguments validate partitions with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

FIELD = "pp_layer_partition"


def parse_layer_partition(value: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """A user partition as a tuple of layer counts: "16,14" (vLLM's format) or a sequence
    of ints; None stays None.

    Raises:
        ValueError: naming `pp_layer_partition`, for anything but comma-separated integers
            >= 1.
    """
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        sizes = tuple(int(str(p).strip()) for p in parts)
    except ValueError:
        raise ValueError(
            f"{FIELD} must be comma-separated layer counts such as '16,14', got {value!r}"
        ) from None
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"{FIELD} must give every stage at least 1 layer, got {value!r}")
    return sizes


def stage_partition(
    num_layers: int, num_stages: int, partition: str | Sequence[int] | None = None
) -> tuple[int, ...]:
    """Layers of each pipeline stage: `partition` when given, else vLLM's rule (module
    docstring).

    Raises:
        ValueError: a partition whose count of stages is not `num_stages`, that does not add
            up to `num_layers`, or that gives a stage no layer (the message names
            `pp_layer_partition`); more stages than layers (naming pipeline_parallel_size).
    """
    sizes = parse_layer_partition(partition)
    if sizes is not None:
        if len(sizes) != num_stages:
            raise ValueError(
                f"{FIELD} {partition!r} has {len(sizes)} entries; pipeline_parallel_size is "
                f"{num_stages}"
            )
        if sum(sizes) != num_layers:
            raise ValueError(
                f"{FIELD} {partition!r} adds up to {sum(sizes)} layers; the model has {num_layers}"
            )
        return sizes
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({num_stages}) must be <= the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base] * num_stages
    for i in range(2, extra + 2):  # the stages before the last take the remainder
        sizes[-i] += 1
    return tuple(sizes)


def get_pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, partition: str | Sequence[int] | None = None
) -> tuple[int, int]:
    """[start, end) of the layers of stage `pp_rank` (vLLM's function of the same name, with
    the partition as an argument instead of an environment variable)."""
    sizes = stage_partition(num_layers, pp_size, partition)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """The layers of each pipeline stage, and their rows in the padded stacks (hashable: a
    static argument of the jitted step).

    Attributes:
        sizes: layers of each stage, (P,), each >= 1, adding up to the model's L.
    """

    sizes: tuple[int, ...]

    @classmethod
    def make(
        cls, num_layers: int, num_stages: int, partition: str | Sequence[int] | None = None
    ) -> StageLayout:
        """The layout of `stage_partition(num_layers, num_stages, partition)`."""
        return cls(stage_partition(num_layers, num_stages, partition))

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    @property
    def num_layers(self) -> int:
        """The model's layers, L."""
        return sum(self.sizes)

    @property
    def stage_size(self) -> int:
        """Rows each stage holds of a stacked weight or the KV cache: the largest stage."""
        return max(self.sizes)

    @property
    def padded_num_layers(self) -> int:
        """Rows of a padded stack, P x stage_size (L when the split is even)."""
        return self.num_stages * self.stage_size

    @property
    def is_even(self) -> bool:
        """Every stage holds the same number of layers: no padding."""
        return len(set(self.sizes)) == 1

    @property
    def starts(self) -> tuple[int, ...]:
        """The model index of each stage's first layer (its `layer_offset`)."""
        out, start = [], 0
        for n in self.sizes:
            out.append(start)
            start += n
        return tuple(out)

    def padded_rows(self) -> list[int]:
        """Row of each model layer, in order, in the padded stacks: layer starts[s] + i of
        stage s is row s * stage_size + i."""
        return [s * self.stage_size + i for s, n in enumerate(self.sizes) for i in range(n)]
