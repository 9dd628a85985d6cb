"""``hpcdl bench data``: the shard reader against torchvision's ImageFolder and a bare decode loop.

All run in one process tree, on the same JPEGs with the same train transform (RandomResizedCrop 224 and a
flip). ImageFolder reads the source files; the reader and the bare loop read the packed bytes (packed
with ``--short-side``, as a user would pack ImageNet). Each reader is timed the same way: ``workers``
forked processes each fetch their share of one epoch's shuffled indices, one ``dataset[i]`` at a time,
which is what a DataLoader worker does before batching. Rounds alternate between the readers and each
figure is the median round. A last row runs the shard reader through a real DataLoader (batching and
shared-memory transfer included) for the end-to-end figure. A row with the reader's record checksum
turned off shows what the check on every read costs.

Then, in one process on one core, with the packed bytes in memory: each JPEG decoder available (Pillow,
Pillow in draft mode at the crop, ``torchvision.io.decode_jpeg``, and simplejpeg or OpenCV when installed)
decoding every image whole, and each augmentation recipe of ``--recipes`` through each of hpcdl's two
decode paths (``data.decoder``): images/s per core, rounds alternating, the median counted. The report
names the fastest decoder and the fastest path of each recipe, and whether ``data.decoder``'s default is it.

Files opened per epoch are counted with a Python audit hook in every worker, so the count covers Pillow,
h5py (the reader opens shards through Python) and anything else, from fresh processes.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

from hpcdl.bench.configs import DataBench as Config
from hpcdl.bench.reports import DataReport, ReaderRow, RecipeRates
from hpcdl.bench.rounds import alternate, medians
from hpcdl.config import DataConfig
from hpcdl.data import recipe
from hpcdl.data.dataset import ShardDataset
from hpcdl.data.images import Encoding
from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.data.synthetic import generate
from hpcdl.data.transforms import Augment
from hpcdl.names import DECODERS

_opened = None  # a shared counter of files opened under _roots, set before any process forks
_roots: tuple[str, ...] = ()
_cases: dict = {}  # reader name -> function of one index; inherited by the forked workers


def _count_opens(*_):
    torch.set_num_threads(1)  # as a DataLoader worker: torch's thread pool does not survive a fork

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).startswith(_roots):
            with _opened.get_lock():
                _opened.value += 1

    sys.addaudithook(hook)


def _work(task: tuple[str, list[int]]) -> int:
    name, indices = task
    fetch = _cases[name]
    for i in indices:
        fetch(i)
    return len(indices)


def _round(pool, name: str, order: list[int], workers: int) -> tuple[float, int]:
    """(images per second per worker, files opened) for one epoch of ``name``."""
    _opened.value = 0
    t0 = time.perf_counter()
    n = sum(pool.map(_work, [(name, order[w::workers]) for w in range(workers)], chunksize=1))
    return n / (time.perf_counter() - t0) / workers, _opened.value


def _dataloader_round(loader) -> tuple[float, int]:
    _opened.value = 0
    loader.sampler.set_epoch(loader.sampler.epoch + 1)
    t0 = time.perf_counter()
    n = sum(len(labels) for _, labels in loader)
    return n / (time.perf_counter() - t0) / loader.num_workers, _opened.value


def _prepare(cfg: Config, tmp: str) -> tuple[str, str]:
    src = cfg.src
    if src is None:
        src = os.path.join(tmp, "jpeg")
        generate(src, classes=cfg.classes, per_class=max(1, cfg.images // cfg.classes))
    packed = os.path.join(tmp, "packed")
    pack(PackConfig(src=src, out=packed, shard_size="32M", encoding=Encoding(short_side=cfg.short_side)))
    return os.path.abspath(src), packed


def run(cfg: Config, job=None) -> DataReport:
    global _opened, _roots
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder


    _opened = multiprocessing.get_context("fork").Value("l", 0)
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-data-") as tmp:
        src, packed = _prepare(cfg, tmp)
        _roots = (src, os.path.abspath(packed))
        reader = ShardDataset(packed, Augment("imagenet"))
        unchecked = ShardDataset(packed, Augment("imagenet"), verify="none")
        unchecked.checksums = False
        folder = ImageFolder(src, transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                                       T.PILToTensor()]))
        blobs = [reader.read(s, i)[0] for s in range(len(reader.shard_sizes)) for i in range(reader.shard_sizes[s])]
        transform = Augment("imagenet")
        _cases.update({"shard reader": reader.__getitem__, "ImageFolder": folder.__getitem__,
                       "bare decode": lambda i: transform(blobs[i]), "reader, no checksum": unchecked.__getitem__})
        sampler = DistributedShardSampler(reader.shard_sizes)
        orders = {"shard reader": lambda: [i for i, _ in sampler.indices()],
                  "reader, no checksum": lambda: [i for i, _ in sampler.indices()],
                  "ImageFolder": lambda: torch.randperm(len(folder)).tolist(),
                  "bare decode": lambda: torch.randperm(len(blobs)).tolist()}
        loader = torch.utils.data.DataLoader(reader, batch_size=cfg.batch_size, num_workers=cfg.workers,
                                             sampler=DistributedShardSampler(reader.shard_sizes),
                                             worker_init_fn=_count_opens, persistent_workers=True)
        with multiprocessing.get_context("fork").Pool(cfg.workers, initializer=_count_opens) as pool:
            cases = {name: (lambda name=name, order=order: _round(pool, name, order(), cfg.workers))
                     for name, order in orders.items()}
            cases["shard reader + DataLoader"] = lambda: _dataloader_round(loader)
            rounds = alternate(cases, cfg.rounds, warmup=0, before=lambda: sampler.set_epoch(sampler.epoch + 1))
        return DataReport(**_reader_figures(rounds, len(reader), len(folder), len(reader.shard_sizes)),
                          **per_core(cfg, blobs[:cfg.per_core_images]))


def decoders(crop: int) -> dict:
    """Name -> a function of JPEG bytes that decodes the whole image (Pillow's draft: at least ``crop``)."""
    from torchvision.io import decode_jpeg

    def pillow(data):
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

    def pillow_draft(data):
        im = Image.open(io.BytesIO(data))
        im.draft("RGB", (crop, crop))
        return np.asarray(im.convert("RGB"))

    out = {"pillow": pillow, "pillow draft": pillow_draft,
           "torchvision": lambda data: decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))}
    try:
        import simplejpeg

        out["simplejpeg"] = lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ImportError:
        pass
    try:
        import cv2

        out["opencv"] = lambda data: cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    except ImportError:
        pass
    return out


def per_core(cfg: Config, blobs: list[bytes]) -> dict:
    """Images/s on one core of each decoder and of each recipe through each decode path: :class:`DataReport`'s
    fields of them."""


    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        specs = [s.strip() for s in cfg.recipes.split(";") if s.strip()]
        cases = {f"decode: {name}": _images_per_s(fn, blobs) for name, fn in decoders(cfg.crop).items()}
        for spec in specs:
            for decoder in DECODERS:
                t = Augment(recipe.parse(spec, "--recipes"), cfg.crop, decoder=decoder)
                rng = random.Random(0)
                cases[f"{spec} | {decoder}"] = _images_per_s(lambda b, t=t: t(b, rng), blobs)
        median = medians(alternate(cases, cfg.rounds, warmup=1))
    finally:
        torch.set_num_threads(threads)
    default = DataConfig.__dataclass_fields__["decoder"].default
    recipes = []
    for spec in specs:
        rates = {d: median[f"{spec} | {d}"] for d in DECODERS}
        fastest = max(rates, key=rates.get)
        recipes.append(RecipeRates(recipe=", ".join(recipe.expand(spec)), spec=spec, images_per_s_per_core=rates,
                                   fastest=fastest, default=default,
                                   default_over_fastest=rates[default] / rates[fastest]))
    decode = {k.removeprefix("decode: "): v for k, v in median.items() if k.startswith("decode: ")}
    return {"decoders": decode, "fastest_decoder": max(decode, key=decode.get), "recipes": tuple(recipes),
            "per_core_images": len(blobs)}


def _images_per_s(fn, blobs: list[bytes]):
    def case() -> float:
        t0 = time.perf_counter()
        for b in blobs:
            fn(b)
        return len(blobs) / (time.perf_counter() - t0)

    return case


def _reader_figures(rounds: dict, packed: int, source: int, shards: int) -> dict:
    """:class:`DataReport`'s fields of the readers' rounds."""
    median = medians(rounds, key=lambda r: r[0])
    return {
        "images_packed": packed, "images_source": source, "shards": shards,
        # the first round ran in fresh processes: its opens are a whole epoch's
        "rows": tuple(ReaderRow(reader=k, images_per_s_per_worker=median[k], files_opened_per_epoch=v[0][1],
                                files_opened_next_epochs=sum(o for _, o in v[1:]), rounds=tuple(r for r, _ in v))
                      for k, v in rounds.items()),
        "ratios": {"shard reader / ImageFolder": median["shard reader"] / median["ImageFolder"],
                   "shard reader / bare decode": median["shard reader"] / median["bare decode"],
                   "with DataLoader / bare decode": median["shard reader + DataLoader"] / median["bare decode"],
                   "reader / reader without checksum": median["shard reader"] / median["reader, no checksum"]},
    }


def format_report(report: DataReport) -> str:
    c = report.config
    lines = [f"data bench: {report.images_packed} packed images (source: {report.images_source} files, "
             f"packed --short-side {c.short_side} into {report.shards} shards), {c.workers} workers, "
             f"{c.rounds} rounds, {report.provenance.machine.cpu}",
             f"{'reader':26s} {'img/s/worker':>13s} {'files opened: 1st epoch':>24s} {'later epochs':>13s}"]
    for r in report.rows:
        lines.append(f"{r.reader:26s} {r.images_per_s_per_worker:13.1f} {r.files_opened_per_epoch:24d} "
                     f"{r.files_opened_next_epochs:13d}")
    lines += [f"{k}: {v:.2f}x" for k, v in report.ratios.items()]
    lines.append(f"one core, {report.per_core_images} packed images in memory, whole-image decode: "
                 + ", ".join(f"{k} {v:.0f}/s" for k, v in report.decoders.items())
                 + f"; fastest {report.fastest_decoder}")
    lines.append(f"{'recipe (crop ' + str(c.crop) + '), images/s per core':64s} "
                 + " ".join(f"{d:>12s}" for d in report.recipes[0].images_per_s_per_core) + "  fastest")
    for r in report.recipes:
        note = "" if r.fastest == r.default else f" (data.decoder={r.default} is {r.default_over_fastest:.2f}x of it)"
        lines.append(f"{r.spec[:64]:64s} " + " ".join(f"{v:12.0f}" for v in r.images_per_s_per_core.values())
                     + f"  {r.fastest}{note}")
    return "\n".join(lines) + "\n"
