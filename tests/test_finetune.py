"""Fine-tuning: model.weights from a state dict, safetensors file or hpcdl run; the head kept at its
initialization when the classes differ, every other difference refused by key; the body's lr scale, its
freeze and timm's layer decay; and on the digits, fine-tuned beats trained from scratch."""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import PYTHON, REPO, free_port, hpcdl, rank_env

from hpcdl.errors import ConfigError
from hpcdl.models import build_model
from hpcdl.models.finetune import head_names, load_weights, lr_scales, read_weights
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig


def test_the_head_is_kept_when_the_classes_differ_and_the_rest_loads(tmp_path):
    source = build_model("tiny_cnn", num_classes=6)
    torch.save({"module." + k: v for k, v in source.state_dict().items()}, tmp_path / "w.pt")  # saved from DDP
    target = build_model("tiny_cnn", num_classes=4)
    head = dict(target.fc.state_dict())
    notes = load_weights(target, read_weights(str(tmp_path / "w.pt")), 4, "w.pt")
    assert notes == ["fc.weight [6, 32] -> [4, 32]", "fc.bias [6] -> [4]"]
    assert torch.equal(target.fc.weight, head["weight"])  # the new head as initialized
    body = [k for k in source.state_dict() if not k.startswith("fc.")]
    assert all(torch.equal(target.state_dict()[k], source.state_dict()[k]) for k in body)


def test_weights_of_another_shape_are_refused_naming_the_keys(tmp_path):
    torch.save(build_model("tiny_cnn_fc", 10).state_dict(), tmp_path / "fc.pt")
    with pytest.raises(ConfigError) as err:
        load_weights(build_model("tiny_cnn", 10), read_weights(str(tmp_path / "fc.pt")), 10, "fc.pt")
    said = str(err.value)
    assert "model.weights=fc.pt does not fit this model" in said
    assert "not in the model: fc.0.weight, fc.0.bias, fc.2.weight, fc.2.bias" in said  # tiny_cnn's head: fc
    assert "(0 of wrong shape, 0 missing, 4 unknown)" in said  # the head may be absent from the file: kept
    headless = {k: v for k, v in build_model("tiny_cnn", 10).state_dict().items() if not k.startswith("fc.")}
    assert load_weights(build_model("tiny_cnn", 10), headless, 10, "headless.pt") == \
        ["fc.bias, fc.weight: not in the file, kept at their initialization"]


def test_rgb_weights_go_to_a_gray_model_summed_over_the_channels(tmp_path):
    rgb = build_model("tiny_cnn", 10)
    gray = build_model("tiny_cnn", 10, in_channels=1)
    first = next(k for k, v in rgb.state_dict().items() if v.dim() == 4)
    notes = load_weights(gray, rgb.state_dict(), 10, "rgb.pt")
    assert notes == [f"{first}: 3 input channels summed into the 1 of data.channels=1",
                     "fc.bias, fc.weight: the file's head, of this model's shape (10 classes), loaded as it is; if "
                     "the file's classes are not data.train's, its head only starts the training"]
    assert torch.allclose(gray.state_dict()[first], rgb.state_dict()[first].sum(1, keepdim=True))


def test_each_file_kind_is_read(tmp_path):
    from safetensors.torch import save_file

    state = build_model("tiny_cnn", 10).state_dict()
    save_file(state, str(tmp_path / "w.safetensors"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"format": 2, "model": state, "optimizer": {}}, tmp_path / "run" / "checkpoints" / "ckpt-000000007.pt")
    # a chunk_sparse run's per-rank part sorts after its checkpoint: never taken for the weights
    torch.save({"residuals": {}}, tmp_path / "run" / "checkpoints" / "ckpt-000000007.rank00001.pt")
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "lightning.ckpt")
    for path in ("w.safetensors", "run", "run/checkpoints/ckpt-000000007.pt", "lightning.ckpt"):
        read = read_weights(str(tmp_path / path))
        assert read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state), path
    # a Schedule-Free run's checkpoint: its averaged weights (eval_model), not the ones it trains at (model)
    averaged = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    torch.save({"format": 2, "model": state, "eval_model": averaged}, tmp_path / "sf.pt")
    read = read_weights(str(tmp_path / "sf.pt"))
    assert all(torch.equal(read[k], averaged[k]) for k in state)


def test_a_missing_or_unreadable_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="no such file. No download is attempted; on a login node: hf download "
                                          "timm/vit_tiny_patch16_224 model.safetensors"):
        read_weights(str(tmp_path / "nope.safetensors"), "timm:vit_tiny_patch16_224")
    with pytest.raises(ConfigError, match="get_model_weights\\('convnext_tiny'\\)"):
        read_weights(str(tmp_path / "nope.pt"), "torchvision:convnext_tiny")
    (tmp_path / "pickled.pt").write_bytes(b"")
    torch.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "module.pt")  # a whole module: not weights_only
    for name in ("pickled.pt", "module.pt"):
        with pytest.raises(ConfigError, match=f"model.weights={tmp_path / name}: not a state dict"):
            read_weights(str(tmp_path / name))


def test_a_model_without_a_detectable_head_is_refused_only_when_an_option_needs_the_head():
    headless = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())  # no layer of num_classes outputs
    assert lr_scales(headless, 10, needed=False) == ({}, set())
    with pytest.raises(ConfigError, match="no classifier head found"):
        lr_scales(headless, 10, body_lr_scale=0.1)


def test_the_body_gets_its_lr_scale_and_is_frozen_first():
    model = build_model("tiny_cnn", 4)
    scales, body = lr_scales(model, 4, body_lr_scale=0.1)
    assert head_names(model, 4) == {"fc.weight", "fc.bias"} and body == {n for n, _ in model.named_parameters()} - {"fc.weight", "fc.bias"}
    opt = build_optimizer(model, OptimConfig(name="lars"), scales, body)
    schedule = LRSchedule(opt, ScheduleConfig(base_lr=1.0, global_batch=8, epochs=10, steps_per_epoch=10, decay="constant",
                                              warmup_epochs=0), freeze_steps=3)
    lrs = lambda: sorted({(g["body"], g["lr"]) for g in opt.param_groups})  # noqa: E731
    for _ in range(3):
        assert lrs() == [(False, 1.0), (True, 0.0)]
        schedule.step()
    assert lrs() == [(False, 1.0), (True, pytest.approx(0.1))]
    assert all(not g["adapt"] and g["weight_decay"] == 0 for g in opt.param_groups if all(p.dim() <= 1 for p in g["params"]))


def test_timm_layer_decay_falls_block_by_block_and_a_vit_s_embeddings_are_not_decayed():
    model = build_model("timm:vit_tiny_patch16_224", 5)
    scales, _ = lr_scales(model, 5, layer_decay=0.75)
    assert "head.weight" not in scales  # the head: 1
    assert scales["blocks.11.mlp.fc1.weight"] == pytest.approx(0.75) and scales["blocks.0.attn.qkv.weight"] == pytest.approx(0.75 ** 12)
    assert scales["patch_embed.proj.weight"] == pytest.approx(0.75 ** 13)
    groups = build_optimizer(model, OptimConfig(name="lamb", weight_decay=0.05), scales, set(scales)).param_groups
    owner = {id(p): g for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    for name in ("pos_embed", "cls_token", "norm.weight", "blocks.3.norm1.bias"):
        assert owner[id(named[name])]["weight_decay"] == 0 and not owner[id(named[name])]["adapt"], name
    assert owner[id(named["blocks.3.attn.qkv.weight"])]["weight_decay"] == 0.05
    with pytest.raises(ConfigError, match="layer_decay=0.75: needs a model that names its blocks"):
        lr_scales(build_model("tiny_cnn", 5), 5, layer_decay=0.75)


def test_fine_tuning_options_without_weights_are_refused_on_the_login_node():
    run = hpcdl("train", "demo_tiny_lars", "--set", "model.body_lr_scale=0.1", "--print-config")
    assert run.returncode == 2 and "set model.weights=PATH" in run.stderr
    run = hpcdl("train", "demo_tiny_lars", "--set", "model.weights=w.pt", "--set", "model=resnet18", "--print-config")
    assert run.returncode == 0 and "model:\n  name: resnet18\n  weights: w.pt" in run.stdout  # --set model= keeps weights


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Digits 0-5 (all their training images) and 6-9 (10 training images of each): two datasets with no class
    and no image in common."""
    root = tmp_path_factory.mktemp("digits")
    for name, args in (("a", ["--digits", "0-5"]), ("b", ["--digits", "6-9", "--train-per-class", "10"])):
        subprocess.run([PYTHON, str(REPO / "datasets" / "digits" / "write.py"), str(root / f"src-{name}"), *args],
                       check=True, capture_output=True)
        for split in ("train", "val"):
            packed = hpcdl("pack", root / f"src-{name}" / split, root / name / split, "--tree", "folder", "--workers", 1)
            assert packed.returncode == 0, packed.stderr
    return root


def _train_on_one_cpu(cpu: int, *args: str) -> subprocess.CompletedProcess:
    """``hpcdl train ARGS`` bound to ``cpu``, so that it computes with one OpenMP thread (hpcdl plans its threads
    from the task's CPU set). tiny_cnn gains little from a second thread, and beside the parallel tier's other
    tests on 2 cores two threads wait on each other: a 40-image run took 19 s and 17 CPU-seconds with two, 6 s
    and 5 with one (load 5)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "PMI_"))}
    bound = f"import os, runpy; os.sched_setaffinity(0, {{{cpu}}}); runpy.run_module('hpcdl', run_name='__main__')"
    return subprocess.run([PYTHON, "-c", bound, "train", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=240)  # the child binds itself: preexec_fn is unsafe beside this test's thread


def _digits_run(digits, run, data: str, classes: int, images: int, *extra: str, cpu: int):
    sets = {"model": "tiny_cnn", "data.train": digits / data / "train", "data.val": digits / data / "val",
            "num_classes": classes, "train_images": images, "run_dir": run, "epochs": 10, "global_batch": 8,
            "data.workers": 0, "loop.backend": "gloo"}  # no worker forked per epoch: the same figures, half the time
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    done = _train_on_one_cpu(cpu, REPO / "datasets" / "digits" / "digits.yaml", *args, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run / "summary.json").read_text())["best_top1"], done.stderr


@pytest.mark.slow
def test_fine_tuned_from_other_digits_beats_trained_from_scratch(digits, tmp_path):
    """tiny_cnn trained on digits 0-5, then 10 epochs on 40 images of 6-9 against the same from scratch, three
    seeds: docs/models.md has the figures. The runs from scratch need no pretraining: they run beside it and
    the fine-tuning, each chain on a CPU of its own, one run at a time."""
    cpus = sorted(os.sched_getaffinity(0))
    seeded = lambda seed: ("--set", f"loop.seed={seed}", "--set", f"data.seed={seed}")  # noqa: E731
    with ThreadPoolExecutor(1) as pool:
        from_scratch = pool.submit(lambda: [_digits_run(digits, tmp_path / f"s{seed}", "b", 4, 40, *seeded(seed),
                                                        cpu=cpus[0])[0] for seed in (0, 1, 2)])
        # as docs/models.md's run, without its evaluations (the weights are the same: fine-tuning reads the last)
        _digits_run(digits, tmp_path / "pre", "a", 6, 867, "--set", "global_batch=32", "--set", "data.val=",
                    cpu=cpus[-1])
        tuned = []
        for seed in (0, 1, 2):
            top1, log = _digits_run(digits, tmp_path / f"t{seed}", "b", 4, 40, *seeded(seed),
                                    "--set", f"model.weights={tmp_path / 'pre'}", cpu=cpus[-1])
            tuned.append(top1)
            assert "fine-tuning from" in log and "fc.weight [6, 32] -> [4, 32]" in log
        scratch = from_scratch.result()
    print("from scratch", scratch, "fine-tuned", tuned)
    assert all(t > s for t, s in zip(tuned, scratch)) and sum(tuned) / 3 >= sum(scratch) / 3 + 5, (scratch, tuned)
    wrong = _train_on_one_cpu(cpus[-1], REPO / "datasets" / "digits" / "digits.yaml",
                              "--set", f"model.weights={tmp_path / 'pre'}",
                              "--set", f"data.train={digits / 'b' / 'train'}", "--set", f"data.val={digits / 'b' / 'val'}",
                              "--set", f"run_dir={tmp_path / 'wrong'}",
                              "--set", "num_classes=4", "--set", "train_images=40")  # digits.yaml's model: tiny_cnn_fc
    assert wrong.returncode == 2 and "missing from the file: fc.0.weight, fc.0.bias" in wrong.stderr, wrong.stderr[-2000:]


@pytest.mark.ranks
def test_on_two_ranks_rank_0_reads_the_weights_and_the_frozen_body_stays_as_loaded(data, tmp_path):
    """Only rank 0 opens model.weights (Python's audit hook watches each rank's opens: tests/audit_ranks.py);
    DDP gives rank 1 rank 0's weights as it wraps the model. With the body frozen for the first epoch, 2 steps
    change the head alone."""
    weights = build_model("tiny_cnn", 10).state_dict()
    torch.save(weights, tmp_path / "w.pt")
    run = tmp_path / "run"
    args = ["train", "demo_tiny_lars", "--set", f"data.train={data / 'train'}", "--set", "data.val=",
            "--set", "crop=32", "--set", "global_batch=16", "--set", f"run_dir={run}", "--set", "loop.max_steps=2",
            "--set", f"model.weights={tmp_path / 'w.pt'}", "--set", "model.freeze_body_epochs=1",
            "--set", "data.workers=0", "--set", "checkpoint.every_minutes=0"]
    port = free_port()
    procs = [subprocess.Popen([PYTHON, REPO / "tests" / "audit_ranks.py", *args],
                              env={**rank_env(r, 2, port), "HPCDL_TEST_WATCH": str(tmp_path / "w.pt")},
                              stdout=open(tmp_path / f"rank{r}.log", "w"), stderr=subprocess.STDOUT, cwd=tmp_path)
             for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert f"opened: {tmp_path / 'w.pt'}" in logs[0] and "opened:" not in logs[1]
    assert "fine-tuning from" in logs[0] and "the file's head, of this model's shape (10 classes)" in logs[0]
    assert "identical on 2 ranks" in logs[0]  # the replicas' sha256 after the steps
    trained = torch.load(run / "checkpoints" / "ckpt-000000002.pt", weights_only=True)["model"]
    body = [k for k in weights if not k.startswith("fc.") and weights[k].is_floating_point() and "running" not in k]
    assert body and all(torch.equal(trained[k], weights[k]) for k in body)
    assert not torch.equal(trained["fc.weight"], weights["fc.weight"])