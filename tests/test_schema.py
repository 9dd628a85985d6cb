"""--set overrides on typed configs: keys and types are checked, derived values follow."""

import pytest

from hpcdl.presets import get_preset, resolve
from hpcdl.errors import ConfigError
from hpcdl.schema import from_dict, to_dict


def test_overrides_apply_with_types_and_derived_values_follow():
    cfg = resolve("resnet50_b32k_lars", ["schedule.base_lr=20", "global_batch=16384", "epochs=45",
                                         "optimizer.betas=[0.9, 0.99]", "label_smoothing=0", "optimizer.semantics=caffe"])
    assert cfg.schedule.peak_lr == cfg.optimizer.lr == 20.0 and isinstance(cfg.schedule.base_lr, float)
    assert cfg.optimizer.betas == (0.9, 0.99) and cfg.optimizer.semantics == "caffe"
    assert cfg.schedule.global_batch == 16384 and cfg.schedule.epochs == 45
    assert cfg.schedule.steps_per_epoch == 79  # ceil(1,281,167 / 16,384)
    assert cfg.derived()["total_steps"] == 79 * 45


@pytest.mark.parametrize("item,message", [
    ("optimizer.lrr=1", "no key 'lrr'; valid: name='lars', lr=31.2"),
    ("global_batch=big", "global_batch: 'big' is not an int; write a whole number such as 8"),
    ("epochs=nan", "epochs: 'nan' is not a float; write a number such as 0.1"),
    ("ranks=3", "does not split over ranks=3"),
    ("optimizer.name=adam", "choose one of sgd, nesterov, lars, larc, lamb, adamw, schedulefree"),
    ("schedule.steps_per_epoch=10", "follows train_images / global_batch"),
    ("optimizer.lr=25", "set schedule.base_lr"),
    ("lr", "write key=value"),
])
def test_bad_overrides_name_the_key_and_the_fix(item, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        resolve("resnet50_b32k_lars", [item])


def test_round_trip_through_plain_data():
    cfg = get_preset("alexnet_bn_b32k_skx1024")
    again = from_dict(type(cfg), to_dict(cfg))
    assert again == cfg
    with pytest.raises(ConfigError, match="unknown keys \\['bogus'\\]"):
        from_dict(type(cfg), {**to_dict(cfg), "bogus": 1})


def test_yaml_config_files(tmp_path):
    from hpcdl.config import dump_yaml
    from hpcdl.presets import resolve

    partial = tmp_path / "run.yaml"
    partial.write_text("preset: resnet50_b32k_lars\nglobal_batch: 16384\ndata:\n  train: /scratch/in1k/train\n"
                       "loop: {accum_steps: 2}\n")
    cfg = resolve(str(partial), ["loop.max_steps=5"])
    assert (cfg.global_batch, cfg.data.train, cfg.loop.accum_steps, cfg.loop.max_steps) == (16384, "/scratch/in1k/train", 2, 5)
    assert cfg.schedule.global_batch == 16384  # derived, as with --set
    whole = tmp_path / "config.yaml"
    whole.write_text(dump_yaml(cfg))
    assert resolve(str(whole)) == cfg
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: resnet50_b32k_lars\nloop: {precison: fp32}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: .*no key 'precison'"):
        resolve(str(bad))
    bad.write_text("preset: resnet50_b32k_lars\nschedule: {steps_per_epoch: 3}\n")
    with pytest.raises(ConfigError, match="steps_per_epoch: follows"):
        resolve(str(bad))


@pytest.mark.parametrize("text, message", [
    ("name: mine\nmodel: tiny_cnn\nglobal_batch: 64\nepochs: 2\noptimizer: {name: lars}\nschedule: {decay: cosine}\n",
     "schedule.base_lr is not set and has no default: add 'base_lr: VALUE' under schedule:"),
    ("name: mine\n", "model is not set and has no default: add 'model: VALUE' at the top level"),
])
def test_a_yaml_without_a_required_value_names_it_and_the_fix(tmp_path, text, message):
    """Was a TypeError from the dataclass (ScheduleConfig.__init__() missing ... 'base_lr')."""
    import subprocess
    import sys

    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="preset: NAME") as info:
        resolve(str(path), [])
    assert message in str(info.value) and str(path) in str(info.value)
    run = subprocess.run([sys.executable, "-m", "hpcdl", "train", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    partial = tmp_path / "partial.yaml"  # a partial section on top of a preset is filled from it
    partial.write_text("preset: demo_tiny_lars\nschedule: {decay: cosine}\n")
    cfg = resolve(str(partial), [])
    assert cfg.schedule.decay == "cosine" and cfg.schedule.base_lr == get_preset("demo_tiny_lars").schedule.base_lr
