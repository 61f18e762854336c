# recps: `make train` and `make test` set up .venv on first use (CPU stack), then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.recps-installed
TORCHREC := torchrec==1.8.0

.PHONY: train test test-fast setup setup-gpu bench bench-quick clean hdfs hdfs-stop

setup: $(STAMP)

# torchrec goes in a second --no-deps step: its metadata asks for the CUDA fbgemm-gpu.
# Bytecode is compiled at install: this machine sets PYTHONDONTWRITEBYTECODE=1 and
# importing torch+fbgemm+torchrec without .pyc files costs ~30 s per process.
$(STAMP): requirements/cpu.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps $(TORCHREC)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m recps.train

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# Every test that starts no process (tests marked e2e start one: a CLI run, a cluster, HDFS, ...).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not e2e" --durations=10

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick

# A test HDFS (Hadoop 2.7.3 NameNode + DataNode on 127.0.0.1; needs Java and Debian's Jersey 1,
# the jars are fetched once into ~/.cache/recps): tests/hdfs/start_hdfs.sh.
HDFS_DIR ?= /tmp/recps-hdfs
hdfs:
	PYTHON=$(PYTHON) bash tests/hdfs/start_hdfs.sh $(HDFS_DIR)
	@echo "HDFS up: see $(HDFS_DIR)/cluster.env; stop it with: make hdfs-stop HDFS_DIR=$(HDFS_DIR)  (or tests/hdfs/stop_hdfs.sh $(HDFS_DIR))"

hdfs-stop:
	bash tests/hdfs/stop_hdfs.sh $(HDFS_DIR)

# CUDA variant: a separate venv with torch 2.13 (CUDA) and the matching fbgemm-gpu 1.8.0.
setup-gpu:
	test -x .venv-gpu/bin/python || $(PYTHON) -m venv .venv-gpu
	.venv-gpu/bin/python -m pip install -q -r requirements/gpu.txt
	.venv-gpu/bin/python -m pip install -q --no-deps $(TORCHREC)
	.venv-gpu/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	.venv-gpu/bin/python -m compileall -q -j 0 .venv-gpu/lib > /dev/null || true

clean:
	rm -rf $(VENV) .venv-gpu outputs multirun .pytest_cache
