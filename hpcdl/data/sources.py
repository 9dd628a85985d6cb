"""The inputs ``hpcdl pack`` reads (``--tree``): what the classes are and which files hold the images.

Every tree lists its classes in sorted wnid (or folder) order, so ImageNet train and val packed
separately agree on the class index. Items are listed in a fixed order and shuffled with the pack's
seed, so every shard mixes classes and every array task sees the same plan.
"""

from __future__ import annotations

import csv
import errno
import os
import random
import re
import stat
import tarfile
from dataclasses import dataclass
from typing import Callable

from hpcdl import names
from hpcdl.data.options import SourceOptions
from hpcdl.errors import ConfigError
from hpcdl.names import registry

WNID = re.compile(r"n\d{8}")
MAX_INPUT_BYTES = 256 << 20  # the largest ImageNet-22K images are tens of MB


@dataclass(frozen=True, slots=True)
class Item:
    """One input image: a file, or a member of a tar at ``offset`` with ``size`` bytes."""

    key: str  # relative to SRC; bytes that are not UTF-8 are shown as \\xNN
    label: int
    path: str  # as the OS gives it (undecodable bytes kept as surrogate escapes)
    offset: int = 0
    size: int = -1  # -1: the whole file
    bad_name: bool = False

    def read(self) -> bytes:
        """The bytes; OSError for what is not a regular file (a FIFO would block a plain open for good) or
        is larger than :data:`MAX_INPUT_BYTES` (read whole, it would take a worker's memory)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            size = st.st_size if self.size < 0 else self.size
            if size > MAX_INPUT_BYTES:
                raise OSError(errno.EFBIG, f"{size} bytes, more than any image hpcdl packs "
                                           f"({MAX_INPUT_BYTES >> 20} MB)")
            if self.size < 0:
                return f.read()
            f.seek(self.offset)
            return f.read(self.size)


@dataclass(slots=True)
class Catalog:
    classes: list[dict]  # {"index", "wnid", "name"}
    items_for_part: Callable[[int, int, int], list[Item]]  # (part, parts, seed) -> items




def printable(rel: str) -> tuple[str, bool]:
    """(a UTF-8 rendering of a relative path, whether the name was valid UTF-8)."""
    try:
        rel.encode("utf-8")
        return rel, True
    except UnicodeEncodeError:
        return os.fsencode(rel).decode("utf-8", "backslashreplace"), False


def _listdir(path: str) -> list[str]:
    try:
        return sorted((n for n in os.listdir(path) if not n.startswith(".")), key=os.fsencode)
    except OSError as exc:
        raise ConfigError(f"cannot list {path}: {exc}") from None


def _read_names(path: str | None) -> dict[str, str]:
    if not path:
        return {}
    names = {}
    for line in _read_lines(path, "--names"):
        wnid, _, name = line.partition(" ")
        names[wnid] = name.strip()
    return names


def _read_lines(path: str, flag: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: {exc}") from None


def _classes(wnids: list[str], names: dict[str, str]) -> list[dict]:
    return [{"index": i, "wnid": w, "name": names.get(w, "")} for i, w in enumerate(wnids)]


def _deal_items(items: list[Item], part: int, parts: int, seed: int) -> list[Item]:
    random.Random(seed).shuffle(items)
    return items[part * len(items) // parts:(part + 1) * len(items) // parts]


def folder(src: str, opts: SourceOptions) -> Catalog:
    """A class-folder tree (``class/**/file``); ``imagenet-train`` is this with wnid folders."""
    dirs = [d for d in _listdir(src) if os.path.isdir(os.path.join(src, d))]
    if not dirs:
        raise ConfigError(f"{src}: no class folders; --tree folder wants SRC/<class>/<image files>")

    def items(part: int, parts: int, seed: int) -> list[Item]:
        found = []
        for label, d in enumerate(dirs):
            for dirpath, subdirs, files in os.walk(os.path.join(src, d)):
                subdirs.sort(key=os.fsencode)
                for name in sorted(files, key=os.fsencode):
                    path = os.path.join(dirpath, name)
                    key, ok = printable(os.path.relpath(path, src))
                    found.append(Item(key=key, label=label, path=path, bad_name=not ok))
        return _deal_items(found, part, parts, seed)

    return Catalog(_classes([printable(d)[0] for d in dirs], _read_names(opts.names)), items)


def csv_list(src: str, opts: SourceOptions) -> Catalog:
    """A CSV file of ``path,label`` rows (a ``path,label`` header is skipped); paths are relative to the
    file's folder unless absolute. Classes are the labels, sorted (numerically when every label is a whole
    number), so a train and a val list with the same labels agree on the class index."""
    base = os.path.dirname(os.path.abspath(src))
    rows = []
    with open(src, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != 2 or not row[0].strip() or not row[1].strip():
                raise ConfigError(f"{src}:{line}: {row!r} is not 'path,label'; --tree csv wants one image path "
                                  "and its class per row")
            if line == 1 and [c.strip().lower() for c in row] == ["path", "label"]:
                continue
            rows.append((row[0].strip(), row[1].strip()))
    if not rows:
        raise ConfigError(f"{src}: no 'path,label' rows; --tree csv wants one image path and its class per row")
    labels = sorted({label for _, label in rows},
                    key=lambda v: (0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v))
    index = {label: i for i, label in enumerate(labels)}

    def items(part: int, parts: int, seed: int) -> list[Item]:
        found = [Item(key=path, label=index[label], path=os.path.join(base, path)) for path, label in rows]
        return _deal_items(found, part, parts, seed)

    return Catalog(_classes(labels, _read_names(opts.names)), items)


def imagenet_train(src: str, opts: SourceOptions) -> Catalog:
    catalog = folder(src, opts)
    odd = [c["wnid"] for c in catalog.classes if not WNID.fullmatch(c["wnid"])]
    if odd:
        raise ConfigError(f"{src}: folders {odd[:5]} are not wnids (n########); use --tree folder for "
                          "other class trees")
    return catalog


def imagenet_val(src: str, opts: SourceOptions) -> Catalog:
    """Flat files; the ground-truth file gives one ILSVRC2012_ID per file, in the files' sorted order."""
    if not (opts.val_labels and opts.synsets):
        raise ConfigError("--tree imagenet-val needs --val-labels (ILSVRC2012_validation_ground_truth.txt) "
                          "and --synsets (wnid per line in ILSVRC2012_ID order, or map_clsloc.txt)")
    id_to_wnid = _read_synsets(opts.synsets)
    wnids = sorted(set(id_to_wnid.values()))
    index = {w: i for i, w in enumerate(wnids)}
    ids = _read_lines(opts.val_labels, "--val-labels")
    files = [n for n in _listdir(src) if not os.path.isdir(os.path.join(src, n))]
    if len(files) != len(ids):
        raise ConfigError(f"{src} holds {len(files)} files but --val-labels {opts.val_labels} has {len(ids)} "
                          "labels; they must pair up in sorted file-name order")
    bad = [i for i in ids if i not in id_to_wnid]
    if bad:
        raise ConfigError(f"--val-labels {opts.val_labels}: IDs {bad[:5]} are not in --synsets {opts.synsets}")

    def items(part: int, parts: int, seed: int) -> list[Item]:
        found = []
        for name, cid in zip(files, ids):
            key, ok = printable(name)
            found.append(Item(key=key, label=index[id_to_wnid[cid]], path=os.path.join(src, name), bad_name=not ok))
        return _deal_items(found, part, parts, seed)

    return Catalog(_classes(wnids, _read_names(opts.names)), items)


def _read_synsets(path: str) -> dict[str, str]:
    mapping = {}
    for n, line in enumerate(_read_lines(path, "--synsets"), start=1):
        fields = line.split()
        if not WNID.fullmatch(fields[0]):
            raise ConfigError(f"--synsets {path} line {n}: {fields[0]!r} is not a wnid (n########)")
        cid = fields[1] if len(fields) > 1 and fields[1].isdigit() else str(n)
        mapping[cid] = fields[0]
    return mapping


def imagenet22k_tars(src: str, opts: SourceOptions) -> Catalog:
    """One ``wnid.tar`` per synset, read in place: each item is a (tar, offset, size) triple."""
    tars = [n for n in _listdir(src) if n.endswith(".tar")]
    if not tars:
        raise ConfigError(f"{src}: no .tar files; --tree imagenet22k-tars wants SRC/<wnid>.tar")
    wnids = [t[:-4] for t in tars]

    def items(part: int, parts: int, seed: int) -> list[Item]:
        found = []
        for label in _deal_tars(src, tars, part, parts):
            found.extend(_tar_items(os.path.join(src, tars[label]), tars[label], label))
        random.Random(f"{seed}-{part}").shuffle(found)
        return found

    return Catalog(_classes(wnids, _read_names(opts.names)), items)


def _deal_tars(src: str, tars: list[str], part: int, parts: int) -> list[int]:
    """Longest first to the lightest part: parts get about equal bytes without listing every member."""
    sizes = [os.path.getsize(os.path.join(src, t)) for t in tars]
    load, mine = [0] * parts, []
    for i in sorted(range(len(tars)), key=lambda i: (-sizes[i], i)):
        p = load.index(min(load))
        load[p] += sizes[i]
        if p == part:
            mine.append(i)
    return sorted(mine)


def _tar_items(path: str, tar: str, label: int) -> list[Item]:
    with tarfile.open(path, "r:") as t:
        return [Item(key=f"{tar}/{printable(m.name)[0]}", label=label, path=path, offset=m.offset_data,
                     size=m.size, bad_name=not printable(m.name)[1]) for m in t if m.isfile()]


TREES: dict[str, Callable[[str, SourceOptions], Catalog]] = registry("pack trees", {
    "imagenet-train": imagenet_train,
    "imagenet-val": imagenet_val,
    "imagenet22k-tars": imagenet22k_tars,
    "folder": folder,
    "csv": csv_list,
}, names.TREES)


def catalog(tree: str, src: str, opts: SourceOptions) -> Catalog:
    if tree not in TREES:
        raise ConfigError(f"--tree {tree!r} is unknown; choose one of {', '.join(TREES)}")
    if tree == "csv":
        if not os.path.isfile(src):
            raise ConfigError(f"SRC {src} is not a file; --tree csv wants a CSV of path,label rows")
    elif not os.path.isdir(src):
        raise ConfigError(f"SRC {src} is not a directory")
    return TREES[tree](src, opts)
