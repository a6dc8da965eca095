# The commands of README.md: `make run` (the main job on the embedded default), `make test` (the
# whole test suite) and `make test-unit` (the unit tests alone). Each creates or reuses the
# project venv first.
VENV ?= .venv
export HF_HUB_OFFLINE := 1

.PHONY: setup run test test-unit
setup:
	@bash scripts/setup.sh

# ARGS: more config flags or files for the run, e.g. make run ARGS="--run.max_steps 20".
run: setup
	$(VENV)/bin/fleetrl rl @ configs/default.toml $(ARGS)

# The unit tests and the light integration modules run beside the others (scripts/test.sh says why). pytest exits 5
# when it collected no test: that fails here like any other non-zero exit.
test: setup
	@VENV=$(VENV) bash scripts/test.sh

test-unit: setup
	$(VENV)/bin/python -m pytest tests/unit
