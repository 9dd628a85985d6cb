"""``hpcdl plan``'s optimizer table: a rank's memory and the optimizer's time per step, replicated and sharded
(``optimizer.shard``, :mod:`hpcdl.optim.shard`), at each node count.

With ``r`` ranks, ``W`` bytes of fp32 weights (as many of gradients), the optimizer's state ``S = c W`` (its row's
``state_copies``, :data:`hpcdl.names.OPTIMIZER_TABLE`) and the replicated update's time ``U`` on one rank:

- replicated, every rank: memory ``2 W + S``; the update ``U``;
- sharded, the busiest rank: a share ``s = max(1 / r, L / P)`` of the tensors, ``L`` the largest tensor's elements
  and ``P`` all of them (tensors are dealt whole, so no share is smaller than the largest tensor; the dealing, by
  cost and state, measured 1.00-1.10x of ``1 / r`` at 2 and 4 ranks: ``s`` is a lower bound); memory
  ``W + r s W + s S + (r + 1) s W``: the gradients (DDP's buckets), the weights as views of the all-gather's buffer
  (the ``r`` padded shares: :func:`hpcdl.optim.shard_layout.bind`), the state, and the reduce-scatter's buffers (the
  ``r`` padded shares and this rank's; half that under ``fp16`` or ``bf16``, none where the gradients are
  all-reduced), kept from step to step (fresh each step they cost their page faults); the update ``s U``. The gradients are reduce-scattered to their owners and the updated tensors all-gathered, each a
  ring of ``r - 1`` steps of ``s W`` bytes (every share padded to the largest), ``(r - 1) (alpha + s W beta)`` on
  the network's link (:mod:`hpcdl.plan.cost`), in place of the replicated run's all-reduce, a ring of
  ``2 (r - 1)`` steps of ``W / r``. What sharding adds to the wire (``added_s``) depends on the exchange
  (``hpcdl plan --hook``, ``--backend``, as :func:`hpcdl.optim.shard.scatters` decides):

  - ``sync.hook=none`` on MPI or oneCCL: the padding, ``2 (r - 1) (s - 1 / r) W beta``, nothing while the tensors
    can be dealt evenly;
  - ``fp16`` or ``bf16`` on them: the reduce-scatter in 16 bits (its padding halved), the all-gather of the fp32
    weights in place of the 16-bit all-reduce's all-gather half: ``(r - 1) (s W - W / 2r) beta`` more;
  - on gloo, or with ``hierarchical`` or ``chunk_sparse``: the gradients all-reduced as before, the whole
    all-gather added.

The update's ``(1 - s) U`` is what sharding saves, ``added_s`` what it costs: the table says, per node count,
whether sharding saves time (``saves``) and by how much. Past ``r = P / L`` ranks the share stops shrinking while
the padding grows with ``r``. The reduce-scatters overlap backward as the all-reduce they replace did; the all-gather overlaps nothing.

``U`` comes from ``hpcdl bench optim --json`` (``--optim-json``: the optimizer's median step on the report's
model, scaled by the weights' ratio, an element-wise update's cost; Muon's Newton-Schulz grows faster than its
weights, so its scaled time is a lower bound); without it the table gives the memory alone.
"""

from __future__ import annotations

import dataclasses

from hpcdl import names
from hpcdl.bench.reports import OptimReport
from hpcdl.errors import ConfigError
from hpcdl.model_facts import ModelFacts
from hpcdl.plan.cost import Link

__all__ = ["OptimizerModel", "format_optimizer"]


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerModel:
    optimizer: str
    weight_bytes: float  # fp32: the gradients' bytes
    share_floor: float  # the largest tensor's share of the elements, L / P
    state_copies: float  # the optimizer's state per weight
    update_s: float | None  # the replicated update on one rank, s; None: not measured
    network: Link
    ranks_per_node: int
    source: str  # where update_s came from
    # the gradients' exchange sharded: "scatter" (reduce-scatter, sync.hook none on MPI or oneCCL), "scatter16" (fp16
    # or bf16 on them: the reduce-scatter in 16 bits, the all-gather in 32), "allreduce" (gloo, hierarchical,
    # chunk_sparse: the all-reduce kept, the all-gather added whole)
    exchange: str = "scatter"

    @classmethod
    def of(cls, optimizer: str, facts: ModelFacts, network: Link, ranks_per_node: int,
           optim_json: str | None = None, hook: str = "none", backend: str = "ccl") -> OptimizerModel:
        if not facts.largest:
            raise ConfigError(f"model {facts.name}: its largest tensor is not counted (an older facts cache); remove "
                              "~/.cache/hpcdl's model facts and plan again")
        update_s, source = None, "not measured: give --optim-json, the JSON of hpcdl bench optim"
        if optim_json:
            report = OptimReport.from_json(optim_json)
            if optimizer not in report.ms_per_step:
                raise ConfigError(f"{optim_json}: no row for optimizer {optimizer} (it has "
                                  f"{', '.join(report.ms_per_step)}); rerun hpcdl bench optim with it")
            scale = facts.gradient_bytes / 4 / report.parameters
            update_s = report.ms_per_step[optimizer] / 1e3 * scale
            source = (f"{optim_json}: {report.ms_per_step[optimizer]:.1f} ms for {report.parameters:,} parameters on "
                      f"{report.threads} threads, x{scale:.3g} for {facts.name}'s")
        exchange = "allreduce" if backend not in names.SCATTER_BACKENDS or hook not in names.SCATTER_HOOKS else \
            "scatter16" if hook != "none" else "scatter"
        return cls(optimizer, float(facts.gradient_bytes), facts.largest * 4 / facts.gradient_bytes,
                   names.OPTIMIZER_TABLE[optimizer].state_copies, update_s, network, ranks_per_node, source, exchange)

    def terms(self, nodes: int) -> dict:
        r = nodes * self.ranks_per_node
        if names.OPTIMIZER_TABLE[self.optimizer].schedule_free:  # optimizer.shard refuses it: replicated only
            return {"nodes": nodes, "ranks": r, "memory_replicated_bytes": (2 + self.state_copies) * self.weight_bytes}
        share = max(1.0 / r, self.share_floor) if r > 1 else 1.0
        w, state = self.weight_bytes, self.state_copies * self.weight_bytes
        gather_s = (r - 1) * (self.network.latency_s + share * w * self.network.beta)
        added_s = 2 * (r - 1) * (share - 1.0 / r) * w * self.network.beta  # the padding, over the all-reduce
        if self.exchange == "scatter16":  # the 16-bit all-reduce's all-gather half replaced by a 32-bit one
            added_s = gather_s - (r - 1) * (self.network.latency_s + w / (2 * r) * self.network.beta) \
                + (r - 1) * (share - 1.0 / r) * w / 2 * self.network.beta
        elif self.exchange == "allreduce":  # nothing replaced: the all-gather on top
            added_s = gather_s
        # the gradients (DDP's buckets), the weights in the all-gather's r padded shares, the reduce-scatter's buffers
        scatter = {"scatter": (r + 1) * share * w, "scatter16": (r + 1) * share * w / 2}.get(self.exchange, 0.0)
        row = {"nodes": nodes, "ranks": r, "share": share, "memory_replicated_bytes": 2 * w + state,
               "memory_sharded_bytes": w + r * share * w + share * state + scatter if r > 1 else 2 * w + state,
               "gather_s": gather_s, "gather_bytes": (r - 1) * share * w, "added_s": added_s}
        if self.update_s is not None:
            row |= {"update_replicated_s": self.update_s, "update_sharded_s": share * self.update_s,
                    "saved_s": self.update_s - share * self.update_s - added_s}
        return row


ADDS = {"scatter": "the padding (sync.hook none on MPI or oneCCL: the gradients reduce-scattered, the all-gather "
                   "in place of the all-reduce's other half)",
        "scatter16": "the fp32 all-gather in place of the 16-bit all-reduce's other half, and the padding (the fp16 "
                     "or bf16 hook on MPI or oneCCL)",
        "allreduce": "the whole all-gather (on gloo, or with the hierarchical or chunk_sparse hook, the gradients "
                     "are all-reduced as replicated)"}


def format_optimizer(model: OptimizerModel, rows: list[dict]) -> str:
    if names.OPTIMIZER_TABLE[model.optimizer].schedule_free:
        return f"# optimizer {model.optimizer}: Schedule-Free, not sharded (optimizer.shard refuses it)"
    timed = model.update_s is not None
    lines = [f"# optimizer {model.optimizer}, replicated against sharded (optimizer.shard): a rank's memory for "
             f"the weights, gradients and state (sharded: the weights in the all-gather's r padded shares, and the "
             f"reduce-scatter's buffers, r + 1 shares, kept from step to step; rank 0 gathers the whole state for a "
             f"checkpoint); the update; the "
             f"all-gather of the shares and what sharding adds to the wire: {ADDS[model.exchange]}. The "
             f"busiest rank's share is a lower bound (tensors dealt whole, by cost and state: Muon's Newton-Schulz "
             f"makes it larger), so its memory, update and padding are at least these and what sharding saves at "
             f"most; update time {model.source}",
             f"{'nodes':>6} {'ranks':>7} {'share':>7} {'mem repl':>9} {'shard':>9} {'gather':>9} "
             f"{'gather':>9} {'adds':>9}" + (f" {'update':>9} {'update':>9} {'saves':>9}" if timed else ""),
             f"{'':>6} {'':>7} {'':>7} {'MB':>9} {'MB':>9} {'MB':>9} {'ms':>9} {'ms':>9}"
             + (f" {'repl ms':>9} {'shard ms':>9} {'ms':>9}" if timed else "")]
    for t in rows:
        line = (f"{t['nodes']:>6} {t['ranks']:>7} {t['share']:>7.4f} {t['memory_replicated_bytes'] / 1e6:>9.0f} "
                f"{t['memory_sharded_bytes'] / 1e6:>9.0f} "
                f"{t['gather_bytes'] / 1e6:>9.1f} {t['gather_s'] * 1e3:>9.2f} {t['added_s'] * 1e3:>9.2f}")
        if timed:
            line += (f" {t['update_replicated_s'] * 1e3:>9.2f} {t['update_sharded_s'] * 1e3:>9.2f} "
                     f"{t['saved_s'] * 1e3:>9.2f}")
        lines.append(line)
    return "\n".join(lines)

