"""What a login node checks, without torch: every name field, and the commands that submit or plan."""

import pickle
import subprocess

import pytest
from conftest import PYTHON

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.presets import resolve

NO_TORCH = ("import sys\nfrom hpcdl.cli import main\nrc = main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', rc, file=sys.stderr)\n")


def hpcdl_counting_torch(*args):
    return subprocess.run([PYTHON, "-c", NO_TORCH, *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("key, bad, valid", [
    ("model", "nope", names.MODELS),
    ("optimizer.name", "adam", tuple(names.OPTIMIZER_TABLE)),
    ("optimizer.semantics", "torch", names.SEMANTICS),
    ("schedule.decay", "step", names.DECAYS),
    ("loop.backend", "nccl", ("auto",) + names.BACKENDS),
    ("sync.hook", "powersgd", names.HOOKS),
    ("loop.precision", "fp16", names.PRECISIONS),
    ("data.sampler", "random", names.SAMPLERS),
    ("data.verify", "fast", names.VERIFY),
    ("loop.ipex", "on", names.IPEX),
])
def test_every_name_field_is_checked_when_the_config_is_built(key, bad, valid):
    with pytest.raises(ConfigError) as err:
        resolve("demo_tiny_lars", [f"{key}={bad}"])
    assert f"{key}={bad!r} is unknown; choose one of {', '.join(valid)}" in str(err.value)


def test_the_requeue_signal_is_checked_when_the_config_is_built():
    with pytest.raises(ConfigError, match="checkpoint.signal='USR9' is not a signal name; use e.g. USR2"):
        resolve("demo_tiny_lars", ["checkpoint.signal=USR9"])
    assert resolve("demo_tiny_lars", ["checkpoint.signal=SIGTERM"]).checkpoint.signal == "SIGTERM"


def test_the_implementations_are_the_tables():
    """Each registry of implementations is keyed by its table (hpcdl.names.registry refuses drift at import)."""
    from hpcdl.data.sources import TREES
    from hpcdl.distributed.affinity import ALLOCATOR_CHOICES
    from hpcdl.distributed.backend import BACKENDS
    from hpcdl.models import MODELS

    assert tuple(MODELS) == names.MODELS
    assert tuple(BACKENDS) == names.BACKENDS and tuple(TREES) == names.TREES
    assert ALLOCATOR_CHOICES == ("auto", "none") + names.ALLOCATORS
    # an optimizer has no registry beside its row, which names its class: tests/test_optim.py imports each
    with pytest.raises(RuntimeError, match="hpcdl.names lists models"):
        names.registry("models", {"resnet50": None}, names.MODELS)


@pytest.mark.slow
def test_the_planners_model_facts_are_the_counted_ones():
    from hpcdl.bench.flops import count_model_facts
    from hpcdl.model_facts import MODEL_FACTS

    assert {n: count_model_facts(n) for n in names.MODELS} == MODEL_FACTS


def test_sbatch_refuses_a_bad_model_before_torch_is_imported(data):
    run = hpcdl_counting_torch("sbatch", "--profile", "local", "--nodes", "1", "--", "train", "demo_tiny_lars",
                               "--set", "model=nope", "--set", f"data.train={data / 'train'}")
    assert "model='nope' is unknown; choose one of alexnet_bn, resnet18, resnet50, resnet101, tiny_cnn, tiny_cnn_fc" in run.stderr
    assert "no torch 2" in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("args", [
    ("presets",),
    ("presets", "show", "resnet50_b32k_lars_skx1600"),
    ("profiles",),
    ("plan", "--validate"),
    ("plan", "--model", "resnet50", "--nodes", "1,2,4", "--batch", "1024", "--profile", "stampede2-skx",
     "--throughput", "100"),
    ("sbatch", "--profile", "local", "--nodes", "1", "--", "train", "demo_tiny_lars", "--set", "data.train=DATA"),
])
def test_login_node_commands_do_not_import_torch(args, data):
    run = hpcdl_counting_torch(*(a.replace("DATA", str(data / "train")) for a in args))
    assert "no torch 0" in run.stderr, run.stderr[-3000:]


def test_submit_refuses_a_bad_config_before_submitting(data, tmp_path):
    run = hpcdl_counting_torch("submit", "--cluster", "local", "--folder", tmp_path / "jobs", "--", "train",
                               "demo_tiny_lars", "--set", "loop.backend=nccl", "--set", f"data.train={data / 'train'}")
    assert "loop.backend='nccl' is unknown; choose one of auto, gloo, mpi, ccl" in run.stderr, run.stderr
    assert "no torch 2" in run.stderr and not (tmp_path / "jobs").exists()


def test_a_job_pickled_before_trainjob_moved_still_unpickles():
    """submitit unpickles the job it runs when the job starts and after each requeue: one pickled under TrainJob's
    old module (hpcdl.train.job, before issue 45) loads as the class it is now."""
    from hpcdl.launch.train_job import TrainJob

    new = pickle.dumps(TrainJob("demo_tiny_lars", ["loop.max_steps=3"]), protocol=0)
    assert b"hpcdl.launch.train_job" in new
    job = pickle.loads(new.replace(b"hpcdl.launch.train_job", b"hpcdl.train.job"))
    assert type(job) is TrainJob and (job.config, job.overrides) == ("demo_tiny_lars", ["loop.max_steps=3"])
