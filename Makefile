# `make demo` and `make test` work on a fresh machine: they create .venv, install the Python packages
# and, as root, the Debian packages, and start a throwaway Slurm when none answers.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CUDA build of torch runs on the CPU; this pair is what the local package index holds.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
APT_PACKAGES := slurmctld slurmd slurm-client munge libpmix-dev slurmdbd mariadb-server libjemalloc2
PYTEST_ARGS ?=

.PHONY: all demo test venv system slurm slurm-down slurm-scripts clean
all: test

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,mpi]' mpich
	touch $@

venv: $(VENV)/.installed

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

test: venv slurm
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The allreduce benchmark as a 2-task job on the local Slurm, through a script that hpcdl generates.
demo: venv slurm
	@mkdir -p build
	$(PY) -m hpcdl sbatch --profile local --nodes 1 --tasks-per-node 2 --time 10:00 --job-name hpcdl-demo \
	  --python $(abspath $(PY)) --output $(abspath build)/demo-%j.out --write build/demo.sbatch \
	  -- bench allreduce --json $(abspath build)/allreduce-%j.json
	@job=$$(sbatch --parsable --wait build/demo.sbatch) || { cat build/demo-*.out; exit 1; }; \
	  cat build/demo-$$job.out; echo "JSON report: build/allreduce-$$job.json"

clean:
	rm -rf build hpcdl-jobs .pytest_cache
