"""What a run is built from, once per process: the model with its optimizer and schedule, its starting
weights, the data (manifests, datasets, sampler, loaders, normalization) and the cores kept for the loader.

Each builder takes the config and the job's context and returns a narrow object; the trainer wires them.
Shared files are read by rank 0 alone and handed to the others (:func:`hpcdl.distributed.group.share.from_rank0`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket

import torch

from hpcdl.config import RunConfig, cache_budget_bytes
from hpcdl.data.cache.spec import AgentSpec
from hpcdl.data.cache.client import CacheClient, start_agent
from hpcdl.data.cache.owners import sample_owners
from hpcdl.data.dataset import InMemory, ShardDataset
from hpcdl.data.format import Manifest
from hpcdl.data.loader import make_loader
from hpcdl.data.recipe import channel_stats, parse
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.data.transforms import Augment, BatchMix, EvalTransform, normalize_batch
from hpcdl.data.verify import check_dataset, load_manifest
from hpcdl.distributed.group.lifecycle import DistContext
from hpcdl.distributed.group.share import from_rank0
from hpcdl.distributed.ranks.env import SLURM_NODELIST_VARS
from hpcdl.distributed.ranks.hostlist import expand_hostlist
from hpcdl.errors import ConfigError, DataError
from hpcdl.models import build_model, model_info
from hpcdl.models.finetune import load_weights, lr_scales, read_weights
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.shard import SCATTER_WIRE, ShardedOptimizer, scatters
from hpcdl.optim.schedule import LRSchedule
from hpcdl.train.accel import apply_ipex
from hpcdl.train.checkpoint import rank_seed, seed_rng
from hpcdl.train.loader_sizing import LoaderSizing, loader_cost, size_loader, step_rate
from hpcdl.train.precision import choose_memory_format
from hpcdl.train.step import criterion as make_criterion
from hpcdl.utils import filesystem_type

__all__ = ["DataParts", "ModelParts", "build_data", "build_model_parts", "read_manifests", "size_loader_for"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ModelParts:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    criterion: torch.nn.Module
    ipex_note: str
    channels_last: bool  # the model's memory format, and its batches' (loop.channels_last, auto resolved)
    channels_last_why: str


def build_model_parts(cfg: RunConfig, ctx: DistContext, precision: str, *, resuming: bool) -> ModelParts:
    """The model (initialized alike on every rank: seeded with ``loop.seed``), ``model.weights`` unless the run
    resumes its own checkpoint, the optimizer and the schedule. Then each rank's RNG streams are seeded by
    (seed, rank), so dropout and stochastic depth draw differently on each rank."""
    tuned = cfg.model
    torch.manual_seed(cfg.loop.seed)
    model = build_model(tuned.name, cfg.num_classes, in_channels=cfg.data.channels)
    scales, body = {}, None
    if tuned.weights:
        if not resuming:  # a checkpoint of the run itself holds the weights it got to
            _start_weights(model, cfg, ctx)
        scales, body = lr_scales(model, cfg.num_classes, tuned.body_lr_scale, tuned.layer_decay,
                                 needed=tuned.body_lr_scale != 1.0 or tuned.layer_decay != 1.0
                                 or tuned.freeze_body_epochs > 0)
    seed_rng(rank_seed(cfg.loop.seed, ctx.rank))
    channels_last, channels_last_why = choose_memory_format(cfg.loop.channels_last, model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, cfg.optimizer, scales, body)
    if cfg.optimizer.shard and ctx.world_size > 1:  # ipex.optimize's fused step would replace the one it wraps
        optimizer = ShardedOptimizer(optimizer, ctx.group, scatter=scatters(cfg.sync.hook, ctx.group),
                                     wire=SCATTER_WIRE.get(cfg.sync.hook),
                                     bucket_bytes=round(cfg.sync.bucket_cap_mb * 2**20),
                                     order=list(model.parameters()),
                                     # not under compile: the forward's hooks' waits would break its graph
                                     ahead=model if cfg.optimizer.gather_ahead and not cfg.loop.compile else None)
        note = "ipex: not used with optimizer.shard=true" + ("; optimizer.gather_ahead off under loop.compile (the "
                                                             "forward's hooks would break its graph)"
                                                             if cfg.optimizer.gather_ahead and cfg.loop.compile else "")
    else:
        model, optimizer, note = apply_ipex(model, optimizer, precision=precision, mode=cfg.loop.ipex)
    freeze = round(tuned.freeze_body_epochs * cfg.schedule.steps_per_epoch)
    return ModelParts(model, optimizer, LRSchedule(optimizer, cfg.schedule, freeze_steps=freeze),
                      make_criterion(cfg.label_smoothing), note, channels_last, channels_last_why)


def _start_weights(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext) -> None:
    """model.weights into rank 0's model, read by rank 0 alone: DDP gives the other ranks rank 0's weights when
    it wraps the model. Rank 0's error stops every rank."""
    m = cfg.model
    found = from_rank0(lambda: load_weights(model, read_weights(m.weights, m.name), cfg.num_classes, m.weights),
                       ctx.group, "load model.weights", catch=(ConfigError,))
    if ctx.rank == 0:
        log.info("fine-tuning from %s: %s; body lr x%g, frozen for %g epochs, layer decay %g", m.weights,
                 "; ".join(found) or "every tensor loaded", m.body_lr_scale, m.freeze_body_epochs, m.layer_decay)


def read_manifests(cfg: RunConfig, ctx: DistContext) -> tuple[Manifest | None, Manifest | None]:
    """data.train's and data.val's manifests on every rank, read once, by rank 0."""
    def read():
        train = load_manifest(os.path.expandvars(cfg.data.train)) if cfg.data.train else None
        return train, load_manifest(os.path.expandvars(cfg.data.val)) if cfg.data.val else None

    return from_rank0(read, ctx.group, "read a manifest", catch=(DataError, OSError))


@dataclasses.dataclass(slots=True)
class DataParts:
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader | None
    sampler: DistributedShardSampler
    mix: BatchMix
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels_last: bool
    classes: list[str]  # for the confusion matrix

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        return normalize_batch(images, self.mean, self.std, channels_last=self.channels_last)

    def blank_batch(self, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch of black images, class 0: for the probes that only time or order a step."""
        images = torch.zeros(cfg.micro_batch, cfg.crop, cfg.crop, cfg.data.channels, dtype=torch.uint8)
        return self.prepare(images), torch.zeros(cfg.micro_batch, dtype=torch.long)


def build_data(cfg: RunConfig, ctx: DistContext, manifests: tuple[Manifest, Manifest | None],
               channels_last: bool) -> DataParts:
    """The loaders, the sampler and the batch mixing; batches normalized into ``channels_last`` memory or not
    (the model's format, :class:`ModelParts`)."""
    steps = parse(cfg.data.augment)
    augment = Augment(steps, cfg.crop, decoder=cfg.data.decoder, channels=cfg.data.channels)
    train = _dataset(cfg, ctx, os.path.expandvars(cfg.data.train), manifests[0], augment, seed=cfg.data.seed)
    info = model_info(cfg.model.name)
    mean, std, why = channel_stats(cfg.data, train.manifest.stats, train.root,
                                   stated=(info.mean, info.std, info.description), finetuning=bool(cfg.model.weights))
    names = [c["name"] or c["wnid"] for c in train.manifest.classes]
    if ctx.rank == 0:
        log.info("data: %s; normalized with mean %s, std %s (%s)", ", ".join(cfg.data.augment),
                 [round(v, 4) for v in mean], [round(v, 4) for v in std], why)
    sampler = DistributedShardSampler(train.shard_sizes, ctx.world_size, ctx.rank, cfg.data.sampler,
                                      shuffle=True, seed=cfg.data.seed)
    if cfg.data.in_memory:
        train = InMemory(train, cfg.data.in_memory)
    elif node_cache_wanted(cfg.data.cache, train.root, ctx):
        _node_cache(cfg, ctx, train)
    val_loader = None
    if cfg.data.val:
        val = _dataset(cfg, ctx, os.path.expandvars(cfg.data.val), manifests[1],
                       EvalTransform(cfg.data.eval_resize, cfg.crop, decoder=cfg.data.decoder, channels=cfg.data.channels))
        val_sampler = DistributedShardSampler(val.shard_sizes, ctx.world_size, ctx.rank, "global", shuffle=False)
        val_loader = make_loader(val, val_sampler, cfg.micro_batch, cfg.data.workers)
    return DataParts(make_loader(train, sampler, cfg.micro_batch, cfg.data.workers), val_loader, sampler,
                     BatchMix(steps, cfg.num_classes), mean, std, channels_last,
                     names if len(names) == cfg.num_classes else [str(i) for i in range(cfg.num_classes)])


_AGENTS: list = []  # the node cache's agent, started by this node's first rank; it ends with this process


# where data.cache=auto reads the shards directly: the node's own storage (anything else: Lustre, GPFS, NFS, BeeGFS,
# a FUSE mount such as the local cluster's MooseFS, is shared by the nodes, and the node cache reads it once a job)
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay",
                               "squashfs", "vfat"})


def node_cache_wanted(setting: str, root: str, ctx: DistContext, fs_type=filesystem_type) -> bool:
    """data.cache: ``node``; or ``auto`` on a job of more than one node whose training set is on a filesystem that
    is not the node's own (bench data-path on the local cluster's shared filesystem: the first epoch read 1.02x
    the dataset from it, later epochs nothing, and images/s per node 3.2x to 5.5x direct reads'). The ranks agree
    (an all-reduce): a node whose copy is local still joins the others' agents."""
    if setting != "auto" or ctx.env.nodes < 2:
        return setting == "node"
    kind = fs_type(root)
    shared = torch.tensor([int(kind not in LOCAL_FILESYSTEMS)], dtype=torch.int64)
    torch.distributed.all_reduce(shared, op=torch.distributed.ReduceOp.MAX, group=ctx.group)
    if ctx.rank == 0:
        log.info("data.cache=auto: %s (%s is on %s, %d nodes)", "node" if shared.item() else "none", root, kind,
                 ctx.env.nodes)
    return bool(shared.item())


def _node_cache(cfg: RunConfig, ctx: DistContext, train: ShardDataset) -> None:
    """``data.cache=node``: each node's first rank starts the node's agent; two all-reduces (the ranks' nodes, the
    agents' addresses, IPv4) tell every rank where its node's agent is and every agent where the others are. The
    address is the one this node reaches rank 0 at (the network the job's group uses). An agent that did not start
    stops every rank, naming its node."""
    env = ctx.env
    node_of_rank = torch.zeros(ctx.world_size, dtype=torch.int64)
    node_of_rank[ctx.rank] = env.node_rank
    torch.distributed.all_reduce(node_of_rank, group=ctx.group)
    nodes = int(node_of_rank.max()) + 1
    where = torch.zeros(nodes, 3, dtype=torch.int64)  # address, port, local ranks 0 that claim the node
    failure, spec = None, None
    if env.local_rank == 0:
        try:  # whatever fails here fails every rank below, after the all-reduce, naming this node
            host = _node_address(env.master_addr, env.master_port, nodes)
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            spec = AgentSpec(train.root, train.paths, train.shard_sizes,
                             sample_owners(train.shard_sizes, nodes), env.node_rank,
                             cache_budget_bytes(cfg.data.cache_budget, memory), nodes=nodes, host=host,
                             window=4 * (cfg.data.workers + 1) * cfg.micro_batch * env.local_size)
            proc, port = start_agent(spec)
            _AGENTS.append(proc)
            where[env.node_rank] = torch.tensor([int(ipaddress.IPv4Address(host)), port, 1])
        except (DataError, ConfigError, OSError, ValueError) as exc:
            failure = exc if isinstance(exc, DataError) else DataError(f"data.cache=node on node {env.node_rank} "
                                                                       f"({env.hostname}): {exc}")
            where[env.node_rank, 2] = 1
    torch.distributed.all_reduce(where, group=ctx.group)
    bad = [n for n, (_, port, claims) in enumerate(where.tolist()) if port <= 0 or claims != 1]
    if failure is not None:
        raise failure
    if bad:
        raise DataError(f"data.cache=node: node(s) {bad} have no agent (it did not start, or the launcher's local ranks "
                        "do not give each node one local rank 0: the node's first rank says why); set data.cache=none")
    agents = {n: (str(ipaddress.IPv4Address(a)), p) for n, (a, p, _) in enumerate(where.tolist())}
    train.cache, train.cache_rank = CacheClient(agents[env.node_rank]), (env.local_rank, ctx.rank == 0)
    if ctx.rank == 0 and nodes > len(train.shard_sizes):
        log.warning("data cache: %d nodes and %d shards: a node owns whole shards, so %d nodes serve every other node "
                    "and the rest hold nothing; pack with a smaller --shard-size (at least as many shards as nodes)",
                    nodes, len(train.shard_sizes), len(train.shard_sizes))
    if env.local_rank == 0:
        try:
            train.cache.peers({n: a for n, a in agents.items() if n != env.node_rank})
        except (OSError, DataError) as exc:  # the agent died since: its readers fall back to the shards themselves
            log.warning("data cache: node %d's agent did not take its peers' addresses (%s)", env.node_rank, exc)
        log.info("data cache: node %d's agent at %s:%d keeps up to %.0f MiB of the %d samples it owns", env.node_rank,
                 *agents[env.node_rank], spec.budget / 2**20, int((spec.owners == env.node_rank).sum()))


def stop_node_cache() -> None:
    """End this process's node agent, if it started one (it ends with the process otherwise): a benchmark that
    builds the loader again in the same process (bench data-path) starts each path without the last one's."""
    while _AGENTS:
        proc = _AGENTS.pop()
        proc.kill()  # it ignores SIGTERM, as the loader's workers do (scancel's reaches every process of a step)
        proc.wait()


def _node_address(master: str, port: int, nodes: int) -> str:
    """The IPv4 address the other nodes reach this one at: the one on the route to rank 0's. On rank 0's own node
    that route is loopback (a stock Debian maps the hostname to 127.0.1.1); with other nodes in the job it is then
    the route toward the next node of the Slurm allocation, or an error that says to set data.cache=none."""
    address = _address_toward(master, port)
    if nodes == 1 or not ipaddress.IPv4Address(address).is_loopback:
        return address
    nodelist = next((os.environ[v] for v in SLURM_NODELIST_VARS if os.environ.get(v)), "")
    names = expand_hostlist(nodelist) if nodelist else []
    for name in names:
        try:
            other = _address_toward(name, port)
        except OSError:
            continue
        if not ipaddress.IPv4Address(other).is_loopback:
            return other
    if ipaddress.IPv4Address(socket.gethostbyname(master)).is_loopback and master not in names:
        return address  # every rank reaches rank 0 on loopback: the job's nodes share this host (tests, rehearsals)
    raise DataError(f"data.cache=node: this node ({socket.gethostname()}) reaches rank 0 ({master}) only on loopback "
                    "and no other node of the job on anything else; set data.cache=none")


def _address_toward(host: str, port: int) -> str:
    """This node's IPv4 address on the route to ``host`` (rank 0's): where the other nodes reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port))  # a UDP connect sends nothing; it picks the route
        return s.getsockname()[0]


def _dataset(cfg: RunConfig, ctx: DistContext, root: str, manifest: Manifest, transform,
             seed: int | None = None) -> ShardDataset:
    """The packed dataset at ``root`` without every rank reading the same files: ``manifest`` is rank 0's; the
    shards' check (``data.verify``) is split over the ranks, and when any rank found a problem every rank stops
    (each naming what it found)."""
    problems = [] if cfg.data.verify == "none" else check_dataset(
        root, manifest, full=cfg.data.verify == "full", rank=ctx.rank, world=ctx.world_size, split=True)
    bad = torch.tensor([len(problems)], dtype=torch.int64)
    torch.distributed.all_reduce(bad, group=ctx.group)
    if bad.item():
        mine = ("; here:\n  " + "\n  ".join(problems)) if problems else " (the ranks that checked them name them)"
        raise DataError(f"{root}: {bad.item()} damaged or missing shards{mine}\nrun 'hpcdl verify --full {root}', "
                        "then repack or restore them")
    return ShardDataset(root, transform, verify="none", seed=seed, manifest=manifest)


def size_loader_for(cfg: RunConfig, ctx: DistContext, data: DataParts, parts: ModelParts,
                    precision: str) -> LoaderSizing:
    """Keep whole cores from compute for the loader only where its measured need fills them (see
    :mod:`hpcdl.train.loader_sizing`), and re-plan the rank's threads around them."""
    def measure() -> tuple[float, float]:
        x, y = data.blank_batch(cfg)
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" \
            else contextlib.nullcontext
        return loader_cost(data.train_loader.dataset), step_rate(parts.model, parts.criterion, x, y, autocast)

    sizing = size_loader(cfg.data.reserve_cores, cfg.data.workers, measure)
    ctx.keep_data_cores(sizing.reserved)
    return sizing
