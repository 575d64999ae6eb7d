# make demo | make test — both create .venv on first use (torch's CPU wheel first, then the project).
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test test-fast bench clean

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	@# pip's exit status is lost in the filter (it only hides index warnings); the import check catches failures
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, diffusers, prefect, tensorboard; assert torch.__version__.startswith('2.13.0')"
	touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/lorapipe demo

test: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra --durations=25

test-fast: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

bench: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks

clean:
	rm -rf demo-run .pytest_cache
