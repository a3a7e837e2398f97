# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv themselves.
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test]'
	# real PP-OCR models for the tests: only the wheel's .onnx files are used, so no dependencies
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps rapidocr-onnxruntime==1.4.4
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qtool run configs/demo.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis
