"""hpcdl's pinned oneCCL runtime: what it is (three wheels and the sha256 of each wheel and of each file taken from
it), where ``hpcdl ccl install`` (which ``make venv`` runs) assembles it, and the assembly.

Why hpcdl assembles a runtime: upstream's packaging is broken. ``oneccl-cpu`` 2022.2.0 ships a
``libccl.so.1`` that needs a ``libccl.so.2`` it does not ship; the SYCL wheel ``oneccl`` ships
``libccl.so.2`` and the CPU plugin ``libccl_legacy_cpu.so``, but its own ``libccl.so.1`` needs SYCL.
``libccl.so.1`` from the first and the other two from the second, in one folder, work. ``pip install``
of either fails on a ``libfabric>=2.6`` that no registry has, so the wheels are downloaded without
their dependencies and Debian's ``libfabric1`` is the transport. Every file is checked against the
sha256 pinned here when installed, and again when :mod:`hpcdl.distributed.ccl.library` finds the runtime
(:func:`verify`); nothing is downloaded at job time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from hpcdl.errors import ConfigError, LaunchError
from hpcdl.utils import cache_dir

__all__ = ["FILES", "VERSION", "WHEELS", "home", "install", "verify"]

VERSION = "2022.2.0"
# wheel -> (its sha256, {member in the wheel: (path in the runtime, its sha256)})
WHEELS = {
    "oneccl-cpu": ("cc912935bd882b4328a569f70a475942e6e77994255775bde7de6452a982af54", {
        "oneccl_cpu-2022.2.0.data/data/lib/libccl.so.1":
            ("lib/libccl.so.1", "b6393a705aa02f0c3e7228544d62a2e1bf4745300d9f28eb15f44a281cb3153f")}),
    "oneccl": ("02c2f52434bfad50cc2d00be6e97fd81e3f365d279ac7bdabd2e3b656194c19f", {
        "oneccl-2022.2.0.data/data/lib/libccl.so.2":
            ("lib/libccl.so.2", "2c2e6a2a3da7a9f1e3fab83bca7730ecad10f2267aba6dca879f4af64f0229ed"),
        "oneccl-2022.2.0.data/data/lib/libccl_legacy_cpu.so":
            ("lib/libccl_legacy_cpu.so", "063814ce690d80df4717617712f92a0f4a4df203c3bb78bc42148b09ef39ddf9")}),
    "oneccl-cpu-devel": ("44346f5758843b17a20d277048aa4eb3a2991029009182b00755c59265b85f0b", {
        "oneccl_cpu_devel-2022.2.0.data/data/include/oneapi/ccl.h":
            ("include/oneapi/ccl.h", "5419c779752ce0bf6ef532c16f1a9ac84f364504be43214b21e2efc06197ff8e"),
        "oneccl_cpu_devel-2022.2.0.data/data/include/oneapi/ccl/v2/types.h":
            ("include/oneapi/ccl/v2/types.h", "5785640978b17d78c1dc3d42c0b82e3b6eaef65d5b7032b51252ae9358c952b0")}),
}
FILES = {path: sha for _, members in WHEELS.values() for path, sha in members.values()}


def home(environ: Mapping[str, str] = os.environ) -> Path:
    """Where ``hpcdl ccl install`` puts the runtime: ``HPCDL_CCL_HOME`` or the user's cache."""
    if environ.get("HPCDL_CCL_HOME"):
        return Path(environ["HPCDL_CCL_HOME"])
    return cache_dir(environ) / f"oneccl-{VERSION}"


def verify(root: Path) -> None:
    """Check every file of hpcdl's runtime against its pinned sha256."""
    for path, sha in FILES.items():
        file = root / path
        if not file.exists() or _sha256(file) != sha:
            raise ConfigError(f"oneCCL: {file} is {'missing' if not file.exists() else 'not the pinned file (sha256)'}; "
                              f"hpcdl's runtime {root} is damaged: run 'hpcdl ccl install --force'")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install(root: Path | None = None, *, wheels: Path | None = None, force: bool = False) -> Path:
    """Assemble hpcdl's runtime in ``root`` from the pinned wheels (downloaded with pip, or found in
    ``wheels``); each wheel and each file is checked against its sha256. Written to a temporary folder
    and renamed, so a runtime is whole or absent. Returns ``root``."""
    root = root or home()
    if not force and (root / "lib" / "libccl.so.2").exists():
        verify(root)
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".oneccl-", dir=root.parent) as tmp:
        staging = Path(tmp) / "runtime"
        for package, (wheel_sha, members) in WHEELS.items():
            wheel = _wheel(package, wheels, Path(tmp))
            if _sha256(wheel) != wheel_sha:
                raise ConfigError(f"oneCCL: {wheel} is not the pinned {package} {VERSION} (sha256 differs); "
                                  "remove it and run 'hpcdl ccl install' again")
            with zipfile.ZipFile(wheel) as zf:
                for member, (path, sha) in members.items():
                    target = staging / path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(member))
                    if _sha256(target) != sha:
                        raise ConfigError(f"oneCCL: {member} in {wheel.name} does not match its pinned sha256")
        (staging / "lib" / "libccl.so.2").chmod(0o755)
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    return root


def _wheel(package: str, wheels: Path | None, tmp: Path) -> Path:
    name = package.replace("-", "_")  # the wheel file's spelling
    if wheels:
        found = sorted(wheels.glob(f"{name}-{VERSION}-*.whl"))
        if found:
            return found[0]
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                          str(tmp), f"{package}=={VERSION}"], capture_output=True, text=True)
    found = sorted(tmp.glob(f"{name}-{VERSION}-*.whl"))
    if run.returncode != 0 or not found:
        raise LaunchError(f"oneCCL: pip could not download {package}=={VERSION}: {run.stderr.strip()[-500:]}. "
                          "On a node without network, run 'hpcdl ccl install' on the login node (the runtime is a "
                          "folder any node can read) or pass --wheels DIR with the three wheels")
    return found[0]
