# make demo | make test — both create .venv on first use (torch's CPU wheel first, then the project).
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test test-fast bench clean

$(VENV_STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv .venv
	@# pip's exit status is lost in the filter (it only hides index warnings); the import check catches failures
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, diffusers, prefect, tensorboard, xdist; assert torch.__version__.startswith('2.13.0')"
	touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/lorapipe demo

# Two workers (pytest-xdist), then the tests marked serial alone; the wall time includes the install.
TEST_WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra
test:
	@start=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory $(VENV_STAMP) || status=$$?; \
	if [ $$status -eq 0 ]; then \
	  $(PYTEST) --durations=25 -n $(TEST_WORKERS) --dist loadfile -m "not serial" || status=$$?; \
	  $(PYTEST) --durations=10 -p no:xdist -m serial || status=$$?; \
	fi; \
	echo "make test: $$(( $$(date +%s) - start )) s wall time, install included (exit $$status)"; exit $$status

test-fast: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

bench: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks

clean:
	rm -rf demo-run .pytest_cache
