# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv themselves and
# install the dependency versions the suite was last run with (tests/constraints.txt), so a new
# release of onnxruntime or numpy cannot break a fresh clone. `make test-latest` runs the suite in
# .venv-latest against the newest releases instead.
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-stamp
CONSTRAINTS := tests/constraints.txt
PIP_FLAGS := -q --disable-pip-version-check
# the pinned set is for Python 3.11 and newer (numpy 2.4 needs it); older Pythons get the ranges
PINNED = $(shell $(PYTHON) -c 'import sys; print("-c $(CONSTRAINTS)" if sys.version_info >= (3, 11) else "")')

.PHONY: demo test test-latest clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(PINNED) -e '.[test]'
	# real PP-OCR models for the tests: only the wheel's .onnx files are used, so no dependencies
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps rapidocr-onnxruntime==1.4.4
	# silero-vad's voice-activity models (If subgraphs, LSTM, scalar and state inputs), same way
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps silero-vad==6.2.3
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qtool run configs/demo.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-latest:
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install $(PIP_FLAGS) --upgrade --upgrade-strategy eager -e '.[test]'
	.venv-latest/bin/pip install $(PIP_FLAGS) --no-deps rapidocr-onnxruntime==1.4.4
	.venv-latest/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .venv-latest build .pytest_cache .hypothesis
