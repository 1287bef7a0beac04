"""ParallelDims: the layout degrees, validated against the world size, and the one DeviceMesh built from them.

Mesh dimension order, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp. The innermost dimensions
talk most (TP every layer), so they map onto neighbouring ranks (the same node); pipeline stages talk least.
Only dimensions of degree > 1 are materialized in the mesh. Expert parallel is not a dimension of its own: the
experts of an MoE layer are spread over ranks that already split the data (dp_shard x cp), as a view of those
dimensions, so `ep` must divide dp_shard x cp and does not change the world size.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from shardforge.config.parallel_schema import ParallelSection, zero_bubble_refusal
from shardforge.errors import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    zero_stage: int
    world_size: int

    @classmethod
    def from_config(cls, parallel: ParallelSection, world_size: int) -> ParallelDims:
        """Resolve `dp_shard=-1` (the rest of the world) and check the degrees multiply to the world size."""
        rest = parallel.cp * parallel.tp * parallel.pp
        for name in ("tp", "pp", "cp"):
            if getattr(parallel, name) > world_size:
                raise ConfigError(
                    f"parallel.{name}={getattr(parallel, name)} needs at least that many processes, but "
                    f"{world_size} are running (launch with --nproc N)"
                )
        replicate, shard = parallel.dp_replicate, parallel.dp_shard
        if shard == -1 and parallel.zero_stage < 2:  # no sharding: the rest of the world replicates
            shard = 1
            if parallel.dp_replicate == 1:
                replicate = max(1, world_size // rest)
        elif shard == -1:
            if world_size % (replicate * rest):
                raise ConfigError(
                    f"{world_size} processes cannot be split evenly: dp_replicate ({replicate}) x cp "
                    f"({parallel.cp}) x tp ({parallel.tp}) x pp ({parallel.pp}) = {replicate * rest} "
                    f"does not divide {world_size}"
                )
            shard = world_size // (replicate * rest)
        product = replicate * shard * rest  # first: every other rule reads the degrees
        if product != world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: dp_replicate ({replicate}) x dp_shard "
                f"({shard}) x cp ({parallel.cp}) x tp ({parallel.tp}) x pp ({parallel.pp}) = {product}, "
                f"but {world_size} processes are running"
            )
        if parallel.zero_stage < 2 and shard > 1:
            raise ConfigError(
                f"parallel.zero_stage={parallel.zero_stage} keeps a full model replica per rank: use "
                f"parallel.dp_replicate for its data-parallel degree "
                f"(parallel.dp_shard={shard} must be 1 or -1)"
            )
        # Context-parallel ranks join the sharding (FSDP2 over dp_shard x cp).
        if parallel.zero_stage >= 2 and rest == world_size > 1 and parallel.cp == 1:
            raise ConfigError(
                f"parallel.zero_stage={parallel.zero_stage}: the {world_size} processes are all used by "
                f"tp x pp x cp = {rest}, none is left to shard data-parallel states over; use zero_stage=0 "
                f"or more processes"
            )
        if parallel.zero_stage >= 2 and shard * parallel.cp == 1 and world_size > 1:
            raise ConfigError(
                f"parallel.zero_stage={parallel.zero_stage} with dp_shard=1 shards nothing (every rank is a "
                f"replica): use zero_stage 0 or 1 for pure replication, or a dp_shard above 1"
            )
        dims = cls(
            replicate,
            shard,
            parallel.cp,
            parallel.tp,
            parallel.pp,
            parallel.ep,
            parallel.zero_stage,
            world_size,
        )
        # Gradients are reduced over replicas and context-parallel ranks: DDP there, unless FSDP2.
        replicas = replicate * parallel.cp
        if parallel.tp > 1 and replicas > 1 and parallel.zero_stage < 2:
            raise ConfigError(
                f"parallel.tp={parallel.tp} with {replicate} data-parallel replicas x cp={parallel.cp} needs "
                f"FSDP2: set parallel.zero_stage to 2 or 3 (DDP and ZeRO-1 do not take tensor-parallel "
                f"parameters)"
            )
        if (refused := zero_bubble_refusal(parallel, replicate, world_size)) is not None:
            raise ConfigError(refused)
        if parallel.pp > 1 and replicas > 1 and parallel.zero_stage < 2:
            raise ConfigError(
                f"parallel.pp={parallel.pp} with {replicate} data-parallel replicas x cp={parallel.cp} needs "
                f"FSDP2: set parallel.zero_stage to 2 or 3 (pipeline stages are sharded over the "
                f"data-parallel ranks)"
            )
        if (shard * parallel.cp) % parallel.ep:
            raise ConfigError(
                f"parallel.ep={parallel.ep} must divide dp_shard ({shard}) x cp ({parallel.cp}): "
                f"expert parallel reuses the data-parallel ranks"
            )
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def averaged(self) -> int:
        """The ranks data parallel averages gradients over: dp, times cp (context-parallel ranks hold parts
        of the same rows' gradients, which the same reduction adds)."""
        return self.dp * self.cp

    @property
    def sharded(self) -> bool:
        return self.zero_stage >= 2

    def cp_multiple(self, sequence_parallel: bool) -> int:
        """Row widths under context parallel: 2 x cp chunks, each rank's part split again over tp by
        sequence parallel."""
        return 2 * self.cp * (self.tp if sequence_parallel and self.tp > 1 else 1)

    def row_multiple(self, sequence_parallel: bool, max_length: int, pipeline: bool) -> int:
        """Every row's width is padded to a multiple of this: sequence parallel splits every row's tokens
        evenly over the TP ranks, context parallel cuts it into 2 x cp chunks, and a pipeline builds a
        schedule per micro-batch shape (widths rounded to 1/8 of max_length keep the shapes few)."""
        multiple = self.tp if sequence_parallel else 1
        if self.cp > 1:
            multiple = math.lcm(multiple, self.cp_multiple(sequence_parallel))
        if pipeline:
            multiple = math.lcm(multiple, max(1, max_length // 8))
        return multiple

    def degrees(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    def build_mesh(self, device_type: str, timeout: datetime.timedelta | None = None) -> DeviceMesh | None:
        """The one mesh of the job (None in a single process); its groups get the job's collective timeout."""
        if self.world_size == 1:
            return None
        names = [n for n in MESH_ORDER if self.degrees()[n] > 1]
        mesh = init_device_mesh(
            device_type, tuple(self.degrees()[n] for n in names), mesh_dim_names=tuple(names)
        )
        if timeout is not None:
            for dim in range(mesh.ndim):  # sub-groups otherwise keep torch's 30-minute default
                _set_pg_timeout(timeout, mesh.get_group(dim))
        return mesh

    def dp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The data-parallel sub-mesh: 1-D (replicate or shard) or 2-D (replicate, shard) for HSDP. Under
        context parallel the cp ranks join it (flattened into one dimension): gradients and logged sums
        are reduced over them too."""
        if mesh is None:
            return None
        names = tuple(n for n in ("dp_replicate", "dp_shard") if self.degrees()[n] > 1)
        if self.cp > 1:
            joined = (*names, "cp")
            return mesh["cp"] if len(joined) == 1 else mesh[joined]._flatten("_".join(joined))
        if not names:
            return None
        return mesh[names[0]] if len(names) == 1 else mesh[names]

    def model_group(self, mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
        """The ranks that hold the parts of one model copy (its pipeline stages and tensor shards; None when
        each rank holds a whole one): RL's rollouts run led by the group's first rank."""
        names = tuple(n for n in ("pp", "tp") if self.degrees()[n] > 1)
        if mesh is None or not names:
            return None
        return (mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))).get_group()

    def pp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index along the pipeline (which stages it runs)."""
        return mesh.get_local_rank("pp") if self.pp > 1 else 0

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among data-parallel ranks (which slice of the global batch it reads)."""
        if mesh is None:
            return 0
        names = mesh.mesh_dim_names or ()
        rep = mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0
        shard = mesh.get_local_rank("dp_shard") if "dp_shard" in names else 0
        return rep * self.dp_shard + shard

    def describe(self) -> str:
        kind = {0: "DDP", 1: "DDP + ZeRO-1", 2: "FSDP2 ZeRO-2", 3: "FSDP2 ZeRO-3"}[self.zero_stage]
        if self.sharded and self.dp_replicate > 1:
            kind = f"HSDP ({self.dp_replicate} replicas x {self.dp_shard} shards, ZeRO-{self.zero_stage})"
        shown = " x ".join(f"{k}={v}" for k, v in self.degrees().items() if v > 1) or "single process"
        if self.ep > 1:
            shown += f" (ep={self.ep} over dp_shard x cp)"
        return f"{shown} on {self.world_size} rank(s), {kind if self.averaged > 1 else 'no data parallel'}"
