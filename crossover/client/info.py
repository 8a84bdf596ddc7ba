"""Where a rank stands in its job: from Horovod, torch.distributed or its launcher's
environment."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where a rank stands in its job."""

    rank: int
    size: int
    local_rank: int
    local_size: int

    @classmethod
    def from_env(cls) -> RankInfo:
        """From Horovod if initialised, else from torch.distributed if initialised (with
        torchrun's local rank and size), else from the launcher's environment."""
        try:
            import horovod.common.basics  # noqa: F401 - cheap check that horovod exists

            for mod in ("horovod.torch", "horovod.tensorflow"):
                hvd = sys.modules.get(mod)
                if hvd is not None and hvd.is_initialized():
                    return cls(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
        except ImportError:
            pass
        env = os.environ
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", 1)))
        for prefix in ("OMPI_COMM_WORLD_", "HOROVOD_"):  # mpirun, horovodrun --gloo
            if prefix + "RANK" in env:
                return cls(int(env[prefix + "RANK"]), int(env[prefix + "SIZE"]),
                           int(env.get(prefix + "LOCAL_RANK", 0)),
                           int(env.get(prefix + "LOCAL_SIZE", 1)))
        if "TORCHELASTIC_RUN_ID" in env:  # torchrun, before init_process_group
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                       int(env["LOCAL_WORLD_SIZE"]))
        return cls(0, 1, 0, 1)
