"""model= names any classifier: torchvision's zoo, timm's, a builder of one's own; refused with the closest names
when it names nothing; its facts counted for the planner, not tabulated."""

import json
import os
import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, same_states, sbatch_wait
from hpcdl.errors import ConfigError
from hpcdl.model_facts import MODEL_FACTS, facts_cache, model_facts
from hpcdl.models import build_model, model_info

OWN = "own_models:small_net"  # tests/own_models.py


@pytest.fixture(autouse=True)
def own_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))


@pytest.mark.parametrize("name, crop, mean", [
    ("torchvision:convnext_tiny", 224, (0.485, 0.456, 0.406)),  # from its weights' transforms, none downloaded
    ("timm:resnet50d", 224, (0.485, 0.456, 0.406)),
    ("timm:vit_tiny_patch16_224", 224, (0.5, 0.5, 0.5)),  # timm's pretrained config
    (OWN, 48, None),  # the builder's crop attribute
])
def test_a_named_model_builds_with_the_classes_and_channels_asked_for(name, crop, mean):
    info = model_info(name)
    assert (info.crop, info.mean) == (crop, mean)
    model = build_model(name, num_classes=7, in_channels=1).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 1, crop, crop)).shape == (2, 7)


@pytest.mark.parametrize("name, said", [
    ("torchvision:convnext_tinyy", "torchvision has no model 'convnext_tinyy'; did you mean torchvision:convnext_tiny"),
    ("timm:resnet50e", "timm has no model 'resnet50e'; did you mean timm:resnet50"),
    ("resnet5O", "did you mean resnet50"),
    ("convnext_tiny", "did you mean torchvision:convnext_tiny or timm:convnext_tiny?"),
    ("own_modelz:small_net", "cannot import own_modelz (No module named 'own_modelz'); put its folder on PYTHONPATH"),
    ("own_models:smal_net", "own_models has no 'smal_net'"),
    ("own_models:no_classes", "no_classes(width=8) takes no num_classes"),
    ("os:getcwd", "getcwd() takes no num_classes"),
    ("builtins:dir", "dir is a builtin without a signature, not a model builder"),
    ("os:sep", "sep is not a model builder (a str)"),
])
def test_a_name_that_names_nothing_is_refused_with_the_closest(name, said):
    with pytest.raises(ConfigError) as err:
        model_info(name)
    assert said in str(err.value)


@pytest.mark.parametrize("name, said", [
    ("subprocess:run", "model=subprocess:run: calling it with num_classes=10 failed"),
    ("own_models:not_a_model", "model=own_models:not_a_model: called with num_classes=10 it returned a dict, not a "
                               "torch.nn.Module"),
])
def test_a_builder_that_does_not_build_a_model_is_named(name, said):
    with pytest.raises(ConfigError) as err:
        build_model(name, 10)
    assert said in str(err.value)


def test_the_login_node_checks_the_form_without_torch():
    code = ("import sys; sys.modules['torch'] = None\nfrom hpcdl.names import check_model\n"
            "for n in ('timm:vit_tiny_patch16_224', 'torchvision:convnext_tiny', 'pkg.mod:build', 'resnet50'):\n"
            "    check_model(n)\n"
            "for n in ('timm:', 'a b:c', 'pkg.mod:1x', 'nope'):\n"
            "    try:\n        check_model(n)\n    except Exception as e:\n        print(type(e).__name__)\n")
    run = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.stdout.split() == ["ConfigError"] * 4, run.stderr


@pytest.mark.slow  # a subprocess imports torch and counts
def test_facts_of_a_named_model_are_counted_once_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{REPO / 'tests'}")
    facts = model_facts(OWN)
    model = build_model(OWN, 1000)
    assert facts.gradient_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert facts.tensors == len(list(model.parameters())) and facts.train_flops > 0
    cache = facts_cache()
    assert cache == tmp_path / "hpcdl" / "model-facts.json"
    kept = json.loads(cache.read_text())
    kept[OWN]["buckets"] = 99  # read back, not counted again
    cache.write_text(json.dumps(kept))
    assert model_facts(OWN).buckets == 99
    assert model_facts("resnet50") is MODEL_FACTS["resnet50"]
    with pytest.raises(ConfigError, match="torchvision has no model 'resnet5'"):
        model_facts("torchvision:resnet5")
    (tmp_path / "mine.py").write_text((REPO / "tests" / "own_models.py").read_text())  # a module the user edits
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{tmp_path}")
    before = model_facts("mine:small_net")
    (tmp_path / "mine.py").write_text((tmp_path / "mine.py").read_text().replace("8, 3, padding", "16, 3, padding")
                                      .replace("BatchNorm2d(8)", "BatchNorm2d(16)").replace("Linear(8,", "Linear(16,"))
    os.utime(tmp_path / "mine.py", (1e9, 2e9))
    assert model_facts("mine:small_net").gradient_bytes > before.gradient_bytes  # counted again
    cache.write_text("{not json")
    with pytest.raises(ConfigError, match=f"{cache}: unreadable .*remove it"):
        model_facts("mine:small_net")


@pytest.mark.slow  # hpcdl sbatch twice, each asking timm in a subprocess
def test_sbatch_refuses_a_misspelt_model_before_submitting(tmp_path):
    args = ["sbatch", "--profile", "local", "--nodes", "1", "--tasks-per-node", "2", "--write", str(tmp_path / "job"),
            "--", "train", "demo_tiny_lars", "--set", f"data.train={tmp_path}", "--set", "data.verify=none"]
    for name, said in (("timm:vit_tiny_patch16_22", "did you mean timm:vit_tiny_patch16_224"),
                       ("convnext_tiny", "did you mean torchvision:convnext_tiny")):
        run = subprocess.run([PYTHON, "-m", "hpcdl", *args, "--set", f"model={name}"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path)})
        assert run.returncode == 2 and said in run.stderr, run.stderr[-2000:]
        assert not (tmp_path / "job").exists()


def test_a_grouped_convolutions_backward_counts_twice_its_forward():
    """torch 2.14's counter loses the groups in the backward (a depthwise 7x7 counted C times too much)."""
    from hpcdl.models.count import flop_counter_mode

    for groups in (1, 4, 16):
        with torch.device("meta"):
            conv, x = torch.nn.Conv2d(16, 16, 7, padding=3, groups=groups, bias=False), torch.empty(2, 16, 14, 14)
        with flop_counter_mode() as counter:
            y = conv(x.requires_grad_())
        forward = counter.get_total_flops()
        assert forward == 2 * 2 * 14 * 14 * 16 * (16 // groups) * 49
        with flop_counter_mode() as counter:
            y.sum().backward()
        assert counter.get_total_flops() == 2 * forward  # the input's gradient and the weight's


def _train_leg(data, run, name, ccl, hook: str) -> str:
    """One srun of ``hpcdl train`` to step 3 on the allocation's 2 ranks over oneCCL: ``name`` at its own crop,
    a checkpoint at step 2."""
    sets = {"model": name, "crop": 0, "global_batch": 4, "loop.max_steps": 3, "loop.log_every": 1, "sync.hook": hook,
            "loop.backend": "ccl", "loop.ccl_lib": ccl.library.parent, "data.train": data / "train", "data.val": "",
            "data.workers": 0, "data.reserve_cores": 0, "data.augment": "resized_crop(min_scale=0.5), hflip", "run_dir": run,
            "checkpoint.every_minutes": 0, "checkpoint.every_steps": 2}
    args = " ".join(f"--set '{k}={v}'" for k, v in sets.items())
    return f"srun --kill-on-bad-exit=1 {PYTHON} -m hpcdl train demo_tiny_lars {args}\n"


@pytest.mark.slow
@pytest.mark.parametrize("name, hook", [("torchvision:convnext_tiny", "none"), ("timm:resnet50d", "fp16"),
                                        ("timm:vit_tiny_patch16_224", "bf16"), (OWN, "none")])
def test_a_named_model_trains_on_two_ccl_ranks_under_slurm_and_resumes_exactly(slurm, ccl, data, tmp_path, name, hook):
    """3 steps straight, then a resume of its step-2 checkpoint to step 3, in one allocation of the local Slurm, with
    a comm hook: the same weights and optimizer state bit for bit (convnext_tiny's stochastic depth draws from the
    checkpointed RNG)."""
    script = tmp_path / "legs.sbatch"
    ckpt, cut = tmp_path / "ref" / "checkpoints" / "ckpt-000000002.pt", tmp_path / "cut" / "checkpoints"
    copy = f"mkdir -p {cut}\ncp {ckpt} {cut}\n"
    script.write_text("#!/bin/bash\nset -e\n" + _train_leg(data, tmp_path / "ref", name, ccl, hook) + copy
                      + _train_leg(data, tmp_path / "cut", name, ccl, hook))
    sbatch_wait(script, "--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/out", f"--chdir={tmp_path}",
                env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, timeout=600)
    out = (tmp_path / "out").read_text()
    crop = model_info(name).crop
    assert out.count("backend oneccl (requested") == 2 and f"model {name} at crop {crop} (crop {crop}: the input size" in out
    assert "resuming from" in out and out.count(f"comm hook {hook}") == 2, out[-3000:]
    a, b = (torch.load(tmp_path / run / "checkpoints" / "ckpt-000000003.pt", weights_only=True) for run in ("ref", "cut"))
    assert a["model"] and same_states(a["model"], b["model"]) == [] and same_states(a["optimizer"], b["optimizer"]) == []



def test_attention_counts_the_same_on_the_cpu_as_on_the_meta_device():
    """torch 2.14 has no formula for the CPU flash-attention kernels: a ViT's attention counted 0 in bench step."""
    from hpcdl.models.count import flop_counter_mode

    counts = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            q = torch.ones(2, 3, 197, 64, requires_grad=True)
        with flop_counter_mode() as counter:
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * (2 * 3 * 197 * 197 * 64 * 2)  # QK^T and PV, forward and twice back
