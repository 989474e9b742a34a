"""A ``DeviceMesh`` built before any process group, under the fake process group.

PyTorch's tensor-parallel and 2-D tutorials call ``init_device_mesh("cuda", (dp, tp), ...)`` with
no ``init_process_group`` first: the mesh starts the default group itself, through the name
``torch.distributed.device_mesh`` imported from ``distributed_c10d`` when it was first loaded.
Patching ``c10d.init_process_group`` does not reach that name, so such a script opened a real
TCP store on MASTER_PORT (two plans at once: EADDRINUSE; alone: waiting for ranks that never
come). The mesh's sub-groups (one per mesh dimension, through ``new_group`` / ``split_group``)
are answered by the fake backend as they are for the default group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def install_mesh_support(init_process_group: Callable[..., None], saved: list[tuple[Any, str, Any]]) -> None:
    """The mesh module's own ``init_process_group`` replaced by ``init_process_group`` (the fake
    group's); what it replaced goes in ``saved``, as (owner, name, value), for the undo."""
    import torch.distributed.device_mesh as device_mesh

    if not hasattr(device_mesh, "init_process_group"):  # a torch whose mesh does not start the group
        return
    saved.append((device_mesh, "init_process_group", device_mesh.init_process_group))
    device_mesh.init_process_group = init_process_group
