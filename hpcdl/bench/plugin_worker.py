"""One rank of ``hpcdl bench plugin``'s plugin path: a script that imports only torch until its groups exist.

    mpiexec -n 2 hpcdl exec python plugin_worker.py BACKENDS CONFIG.json OUT.json

Run as a file (importing it runs nothing): ``hpcdl exec`` sets torch's env:// variables and replaces itself by this
script, so hpcdl is not in the process when ``init_process_group`` runs. Each torch backend name in BACKENDS
(``gloo``: the default group; ``mpi4py``, ``oneccl``: ``new_group(backend=...)``) is found through torch's
entry points, as in a user's script. Once the groups exist it measures them with ``hpcdl bench allreduce``'s
own sweep, so that the two paths differ only in how the groups were made. Rank 0 writes OUT.json.
"""

import dataclasses
import json
import os
import sys
import types

import torch
import torch.distributed as dist


def main(backends: list[str], config: str, out: str) -> None:
    before = "hpcdl" in sys.modules
    dist.init_process_group("gloo")
    groups = {name: None if name == "gloo" else dist.new_group(backend=name) for name in backends}
    after = "hpcdl" in sys.modules
    # Imported only now, on purpose: what this script measures is a path with hpcdl absent before the groups.
    from hpcdl.bench.allreduce import Config, measure

    with open(config) as f:
        cfg = Config(**json.load(f))
    ctx = types.SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(), group=None)
    rows = [dataclasses.asdict(measure(ctx, cfg, nbytes, group, name)) for nbytes in cfg.sizes()
            for name, group in groups.items()]
    if ctx.rank == 0:
        with open(out + ".tmp", "w") as f:
            # hpcdl.bench.reports.PluginWorkerReport's layout; bench plugin reads it through that type
            json.dump({"rows": rows, "threads": torch.get_num_threads(),
                       "imports": {"hpcdl_before_init": before, "hpcdl_after_init": after}}, f)
        os.replace(out + ".tmp", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its sibling modules must not shadow top-level names (data, optim, ...)
    main(sys.argv[1].split(","), sys.argv[2], sys.argv[3])
