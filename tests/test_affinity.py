import os
import subprocess
import sys

import pytest

from hpcdl.distributed.affinity import allocator_env, plan_cpus
from hpcdl.distributed.group.lifecycle import apply_cpu_plan
from hpcdl.errors import ConfigError


def test_unbound_task_takes_its_slice_of_the_node():
    plans = [plan_cpus(local_rank=r, local_size=2, task_cpus=set(range(48)), online_cpus=48) for r in range(2)]
    assert [p.compute_cpus for p in plans] == [tuple(range(24)), tuple(range(24, 48))]
    assert all(p.threads == 24 for p in plans)


def test_bound_task_keeps_its_cpu_set_and_reserves_comm_and_data_cpus():
    plan = plan_cpus(local_rank=1, local_size=2, comm_threads=1, data_cores=2,
                     task_cpus=set(range(24, 48)), online_cpus=48)
    assert plan.compute_cpus == tuple(range(24, 45)) and plan.threads == 21
    assert plan.data_cpus == (45, 46) and plan.comm_cpus == (47,)


def test_too_few_cpus_to_reserve_still_computes():
    plan = plan_cpus(local_rank=0, local_size=1, comm_threads=1, data_cores=4, task_cpus={0, 1}, online_cpus=2)
    assert plan.threads == 2 and "too few" in plan.source


def test_thread_limit_below_threads_is_refused():
    plan = plan_cpus(local_rank=0, local_size=1, task_cpus={0, 1}, online_cpus=2)
    with pytest.raises(ConfigError, match="OMP_THREAD_LIMIT=1 is below"):
        apply_cpu_plan(plan, {"OMP_THREAD_LIMIT": "1"})


def test_allocator_choice(tmp_path):
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator_env("auto", (str(tmp_path),)) == ("tcmalloc", {"LD_PRELOAD": str(tmp_path / "libtcmalloc.so.4")})
    assert allocator_env("auto", ("/nonexistent",))[0] == "glibc"
    assert "mmap_max=0" in allocator_env("glibc")[1]["GLIBC_TUNABLES"]
    with pytest.raises(ConfigError, match="libjemalloc"):
        allocator_env("jemalloc", ("/nonexistent",))
    with pytest.raises(ConfigError, match="choose one of"):
        allocator_env("hoard")


@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_exports_take_effect_in_a_new_python(choice):
    """The exports are eval'd by bash and the allocator is really in the started process."""
    probe = ("import os; maps=open('/proc/self/maps').read(); "
             "print('jemalloc' if 'libjemalloc' in maps else 'tcmalloc' if 'tcmalloc' in maps else "
             "os.environ.get('GLIBC_TUNABLES', 'none'))")
    script = f'eval "$({sys.executable} -m hpcdl tune --exports --allocator {choice})"; {sys.executable} -c "{probe}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    expected = allocator_env(choice)[0]
    if expected == "glibc":
        assert "mmap_max=0" in out
    else:
        assert out == expected


@pytest.mark.slow
def test_apply_sets_threads_and_binds(tmp_path):
    code = ("import os, torch; from hpcdl.distributed.affinity import plan_cpus; from hpcdl.distributed.group.lifecycle import apply_cpu_plan; "
            "p = plan_cpus(local_rank=1, local_size=2); apply_cpu_plan(p); "
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(maxsplit=2)
    n = len(os.sched_getaffinity(0)) // 2
    assert out[0] == out[1] == str(n)
    assert out[2].strip() == str(sorted(os.sched_getaffinity(0))[n:2 * n])
