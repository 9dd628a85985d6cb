# `make demo` and `make test` work on a fresh machine: they create .venv, install the Python packages
# and, as root, the Debian packages, and start a throwaway Slurm when none answers.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CUDA build of torch runs on the CPU; this pair is what the local package index holds.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# libfabric1: oneCCL's transport (backend ccl); the wheels' own libfabric>=2.6 requirement is on no registry.
# gcc, g++, ninja-build: hpcdl/distributed/native/c_comm_thread.c and ccl_backend.cpp (the oneCCL group's small all-reduce), built
# by `hpcdl ccl install` (run by make venv) through hpcdl/distributed/native/build.py, the C++ one with torch's cpp_extension.
APT_PACKAGES := slurmctld slurmd slurm-client munge libpmix-dev slurmdbd mariadb-server libjemalloc2 libfabric1 gcc g++ ninja-build
PYTEST_ARGS ?=
# make test: tests that wait (Slurm, MPI, start-up) run beside those that compute; 4 workers kept both cores of
# the 2-core CI machine busy (docs/contributing.md). Slurm tests run side by side and queue in the local Slurm.
WORKERS ?= 4
# The suite oversubscribes the cores on purpose (4 workers, their ranks, simulated nodes sharing the host's cores):
# OpenMP threads that spin at each barrier, as libgomp's default does for dedicated cores, burn the time the other
# processes wait for. Waiting passively, 4 two-thread ranks on 2 cores trained in 20-23 s and 36-44 s of CPU instead
# of 34-35 s and 65-68 s; the unit tier took 0.9 min instead of 1.2 (docs/contributing.md). Ranks and pytest
# inherit it (sbatch exports the submitter's environment); a value already in the environment is kept.
test test-quick: export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: all demo test test-quick venv ccl system slurm slurm-down slurm-scripts clean
all: test

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,mpi,plot,timm]' mpich
	# Animal-MNIST's images (datasets/animal_mnist): its loader needs TensorFlow, which nothing here imports
	$(PY) -m pip install -q --no-deps animal-mnist==0.4
	touch $@

# backend ccl: hpcdl's pinned oneCCL runtime (three wheels from PyPI, sha256-checked) in ~/.cache/hpcdl, and
# Debian's libfabric1, and the group's C and C++ parts (c_comm_thread, ccl_backend: ccl install calls
# hpcdl.distributed.native.build's main() in-process, not through python -m; it starts nothing). A runtime already
# there is only checked; parts that cannot be built (no compiler) do not fail the venv: their failure is recorded in
# ~/.cache/hpcdl/native/KEY/ and oneCCL goes through Python.
ccl: $(VENV)/.installed system
	$(PY) -m hpcdl ccl install

venv: $(VENV)/.installed ccl

system:
	@if [ "$$(id -u)" != 0 ]; then echo "system: not root, not installing: $(APT_PACKAGES)"; exit 0; fi; \
	missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "system: installing" $$missing; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi

# Starts slurm/local (munge, MariaDB, slurmdbd, slurmctld, slurmd n1 n2) unless a Slurm answers.
# Outside CI a failure only warns: the Slurm tests then skip with the reason. In CI it is fatal.
slurm: system
	@bash slurm/local/up.sh || { if [ "$${CI:-}" = true ]; then exit 1; fi; \
	  echo "slurm: no Slurm here; tests that need one will be skipped"; }

slurm-down:
	bash slurm/local/down.sh

slurm-scripts: venv
	$(PY) -m hpcdl.launch.sbatch slurm

# Every tier, in three passes: the tests in parallel; then the many-rank rehearsals (scale: each job fills
# the machine with 16 or 32 ranks, so beside the others they slowed everything past its timeouts) and those
# that stop the shared filesystem's servers (exclusive: its other readers would fail), one at a time; then
# those marked alone (they compare timings) by themselves. Exit 5 (nothing selected, e.g. PYTEST_ARGS names
# a file with no such test) is no failure.
test: venv slurm
	@status=0; \
	$(PY) -m pytest -n $(WORKERS) --dist loadgroup --durations=30 -m "not alone and not scale and not exclusive" $(PYTEST_ARGS) tests || status=$$?; \
	$(PY) -m pytest --durations=10 -m "scale or exclusive" $(PYTEST_ARGS) tests || { s=$$?; [ $$s = 5 ] || status=$$s; }; \
	$(PY) -m pytest -m alone $(PYTEST_ARGS) tests || { s=$$?; [ $$s = 5 ] || status=$$s; }; \
	exit $$status

# The unit tier: no root, no Slurm, no MPI or multi-rank processes; for the edit-test loop.
test-quick: $(VENV)/.installed
	$(PY) -m pytest -n 2 -m unit $(PYTEST_ARGS) tests

# The demo: synthetic JPEGs, packed into shards, then TinyCNN with LARS on 2 ranks: a job on the local
# Slurm when one answers, submitit's local executor otherwise. It fails unless top-1 reaches DEMO_TOP1.
DEMO := build/demo
DEMO_TOP1 ?= 95
DEMO_TRAIN = train demo_tiny_lars --set data.train=$(abspath $(DEMO))/packed/train \
  --set data.val=$(abspath $(DEMO))/packed/val --set run_dir=$(abspath $(DEMO))/run --set loop.target_top1=$(DEMO_TOP1)

$(DEMO)/packed/val/manifest.json: | venv
	$(PY) datasets/synthetic/generate.py $(DEMO)/src --classes 10 --per-class 150 --val-per-class 25 --tree imagenet
	$(PY) -m hpcdl pack $(DEMO)/src/train $(DEMO)/packed/train --tree imagenet-train --short-side 72 --shard-size 1MB
	$(PY) -m hpcdl pack $(DEMO)/src/val $(DEMO)/packed/val --tree imagenet-val --short-side 72 --shard-size 1MB \
	  --val-labels $(DEMO)/src/ILSVRC2012_validation_ground_truth.txt --synsets $(DEMO)/src/map_clsloc.txt

demo: venv slurm $(DEMO)/packed/val/manifest.json
	@rm -rf $(DEMO)/run
	@if sinfo -h >/dev/null 2>&1; then \
	  $(PY) -m hpcdl sbatch --profile local --nodes 1 --tasks-per-node 2 --time 10:00 --job-name hpcdl-demo \
	    --python $(abspath $(PY)) --output $(abspath $(DEMO))/demo-%j.out --write $(DEMO)/demo.sbatch -- $(DEMO_TRAIN) && \
	  job=$$(sbatch --parsable --wait $(DEMO)/demo.sbatch); status=$$?; cat $(DEMO)/demo-$$job.out; \
	  [ $$status = 0 ] || exit $$status; \
	else \
	  echo "demo: no Slurm answers; running the 2 ranks through submitit's local executor"; \
	  $(PY) -m hpcdl submit --cluster local --nodes 1 --tasks-per-node 2 --time 10 --folder $(DEMO)/jobs/%j \
	    -- $(DEMO_TRAIN) || exit $$?; \
	fi
	@$(PY) -c 'import json, sys; s = json.load(open(sys.argv[1])); top1, t = s["best_top1"] or 0.0, float(sys.argv[2]); \
	  print("demo: best top-1 %.1f%% (target %g%%), reached after %.1f s of training; run folder %s" \
	        % (top1, t, s["time_to_target_s"] or float("nan"), s["run_dir"])); sys.exit(0 if top1 >= t else 1)' \
	  $(DEMO)/run/summary.json $(DEMO_TOP1)

clean:
	rm -rf build hpcdl-jobs .pytest_cache
