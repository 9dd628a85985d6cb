"""The IPEX path, in a torch 2.8 + IPEX 2.8 environment that this test builds (about 4 GB of downloads,
once: it is kept in HPCDL_IPEX_VENV, by default ~/.cache/hpcdl/venv-ipex-2.8)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, missing

IPEX_VENV = Path(os.environ.get("HPCDL_IPEX_VENV", Path.home() / ".cache" / "hpcdl" / "venv-ipex-2.8"))
IPEX_PACKAGES = ["torch==2.8.0", "intel-extension-for-pytorch==2.8.0",
                 # hpcdl's other dependencies; torchvision is left out (hpcdl imports it only for ResNets)
                 "h5py", "submitit", "numpy", "pillow", "pyyaml", "tqdm", "tensorboard", "schedulefree"]


@pytest.fixture(scope="session")
def ipex_python() -> str:
    python, ready = IPEX_VENV / "bin" / "python", IPEX_VENV / ".hpcdl-ready"
    # built once; a venv of an older package list (a dependency hpcdl gained since) gets the list installed
    if not ready.exists() or ready.read_text().split() != IPEX_PACKAGES:
        steps = [[str(python), "-m", "pip", "install", "-q", "--no-cache-dir", *IPEX_PACKAGES]]
        if not python.exists():
            steps.insert(0, [sys.executable, "-m", "venv", "--clear", str(IPEX_VENV)])
        for step in steps:
            run = subprocess.run(step, capture_output=True, text=True, timeout=1800)
            if run.returncode != 0:
                missing("the IPEX environment", f"{' '.join(step[:4])} failed: {run.stderr[-2000:]}")
        ready.write_text(" ".join(IPEX_PACKAGES) + "\n")
    return str(python)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the fixture builds the IPEX venv on a fresh machine: minutes, more under load
def test_training_goes_through_ipex_optimize(ipex_python, data, tmp_path):
    run = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))},
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([ipex_python, "-m", "hpcdl.train", "demo_tiny_lars", "--set", f"data.train={data / 'train'}",
                           "--set", f"data.val={data / 'val'}", "--set", f"run_dir={run}", "--set", "global_batch=16",
                           "--set", "crop=32", "--set", "data.eval_resize=36", "--set", "loop.max_steps=4",
                           "--set", "data.workers=0", "--set", "loop.precision=fp32"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert re.search(r"ipex: ipex\.optimize applied \(IPEX 2\.8\.0\S* on torch 2\.8\.0\S*, fp32\)", done.stderr), done.stderr
    assert "summary: 4 steps" in done.stderr
    # The checkpoint it wrote loads, weights only, in this (torch 2.14, no IPEX) environment.
    from hpcdl.models import build_model

    state = torch.load(run / "checkpoints" / "ckpt-000000004.pt", map_location="cpu", weights_only=True)
    model = build_model("tiny_cnn", 10)
    model.load_state_dict(state["model"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_without_ipex_the_log_says_why():
    from hpcdl.train.accel import ipex_module

    module, why = ipex_module("auto")
    assert module is None and "not installed" in why  # the main environment has no IPEX
    assert ipex_module("off") == (None, "off (loop.ipex=off)")
