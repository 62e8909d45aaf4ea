# Two commands set up a fresh machine: `make serve` and `make test`.
VENV      ?= .venv
PY        := $(VENV)/bin/python
# The CPU build of torch; override on a GPU machine (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR  ?= .demo-model
VISION_DIR ?= .demo-vision-model
HOST      ?= 127.0.0.1
PORT      ?= 8000

.PHONY: install serve serve-vision test demo-model clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so that nothing later pulls the multi-GB CUDA build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $@

install: $(VENV)/.installed

$(DEMO_DIR)/model.safetensors: | $(VENV)/.installed
	$(VENV)/bin/loom demo-model $(DEMO_DIR)

demo-model: $(DEMO_DIR)/model.safetensors

serve: $(VENV)/.installed $(DEMO_DIR)/model.safetensors
	$(VENV)/bin/loom serve $(DEMO_DIR) --host $(HOST) --port $(PORT)

$(VISION_DIR)/model.safetensors: | $(VENV)/.installed
	$(VENV)/bin/loom demo-model --vision $(VISION_DIR)

serve-vision: $(VENV)/.installed $(VISION_DIR)/model.safetensors
	$(VENV)/bin/loom serve $(VISION_DIR) --host $(HOST) --port $(PORT)

# Two pytest-xdist workers (a file's tests stay on one worker, with its module's servers): the
# suite keeps one core busy on its own, and CI has two. The files go out in tests/conftest.py's
# order (its RUN_FIRST: the few slow tests first), not xdist's.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

clean:
	rm -rf $(VENV) $(DEMO_DIR) $(VISION_DIR) *.egg-info
