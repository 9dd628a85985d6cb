"""A node layout: how one node's cores are split into ranks and how each rank computes, as ``hpcdl tune
--measure`` chose it on a node of the cluster. ``hpcdl sbatch --layout FILE`` and ``hpcdl submit --layout FILE``
read it: the ranks per node, cores per rank and allocator go into the job request, and a ``train`` command
gets the precision and memory format. The batch per rank is the training recipe's, so it stays advice.
"""

from __future__ import annotations

import dataclasses
import json

from hpcdl.errors import ConfigError

__all__ = ["NodeLayout", "load_layout", "train_overrides"]

FORMAT = "hpcdl-node-layout/1"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeLayout:
    ranks_per_node: int
    cpus_per_task: int
    precision: str  # fp32 | bf16
    channels_last: bool
    allocator: str
    batch_per_rank: int  # the smallest batch per rank within 5% of the best images/s measured (advice)
    images_per_s: float  # the node's, measured
    model: str
    node: dict  # where it was measured: host, CPU, cores, flags

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=1) + "\n"

    def describe(self) -> str:
        return (f"{self.ranks_per_node} ranks x {self.cpus_per_task} cores, {self.precision}, "
                f"{'channels_last' if self.channels_last else 'contiguous'}, allocator {self.allocator}")


def load_layout(path: str) -> NodeLayout:
    """The layout in ``path``; a file that is not one names itself and the field at fault."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--layout {path}: cannot read it as JSON ({exc}); write one with hpcdl tune --measure "
                          f"--write {path}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"--layout {path}: not a node layout (its format is {data.get('format') if isinstance(data, dict) else None!r}, "
                          f"expected {FORMAT!r}); write one with hpcdl tune --measure")
    fields = {f.name for f in dataclasses.fields(NodeLayout)}
    missing = sorted(fields - set(data))
    if missing:
        raise ConfigError(f"--layout {path}: missing field(s) {', '.join(missing)}; measure it again with hpcdl tune --measure")
    layout = NodeLayout(**{k: data[k] for k in fields})
    for name in ("ranks_per_node", "cpus_per_task", "batch_per_rank"):
        if not isinstance(getattr(layout, name), int) or getattr(layout, name) < 1:
            raise ConfigError(f"--layout {path}: field {name} is {getattr(layout, name)!r}, not a count >= 1")
    if layout.precision not in ("fp32", "bf16"):
        raise ConfigError(f"--layout {path}: field precision is {layout.precision!r}; fp32 or bf16")
    return layout


def train_overrides(command: list[str], layout: NodeLayout) -> list[str]:
    """``command`` with the layout's precision and memory format for an ``hpcdl train PRESET`` command, set right
    after the preset so that a ``--set`` the user gave for the same key, which comes later, wins; any other
    command unchanged."""
    if len(command) < 2 or command[0] != "train":
        return list(command)
    return [*command[:2], "--set", f"loop.precision={layout.precision}",
            "--set", f"loop.channels_last={str(layout.channels_last).lower()}", *command[2:]]
