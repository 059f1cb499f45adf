# Two commands for a newcomer: `make demo` and `make test` (both install first if needed).
PYTHON_VENV := .venv/bin/python
STAMP := .venv/.install-stamp
DEMO_MINUTES ?= 11
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` and `make test-fast` (one per core of the 2-core CI machine);
# each test file runs whole on one worker, so its module fixtures are built once, and each worker
# computes on one thread (tests/conftest.py).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: install demo test test-fast test-gpu test-toolkits gpu-check gpu-speed bench clean-outputs

install: $(STAMP)

$(STAMP): constraints.txt pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

demo: install
	$(PYTHON_VENV) -m experiments.sdma.quickstart --minutes $(DEMO_MINUTES)

# Everything (the CI command): unit tier (tests/unit) and CLI/training runs (tests/integration).
test: install
	$(PYTHON_VENV) -m pytest tests $(XDIST) --durations=25 $(PYTEST_ARGS)

# The unit tier only: equations, readers, in-process models (about 3 minutes on 2 cores); the Triton kernels' own
# exactness tests (in Triton's interpreter, minutes on a CPU) and the `slow` unit tests (the README's models built
# through fairseq's command line) run in `make test`, and the readers' fuzz tests run a quarter
# of their examples here (TEST_TIER=fast, tests/conftest.py:fuzz_examples).
test-fast: install
	TEST_TIER=fast $(PYTHON_VENV) -m pytest tests/unit -m "not integration and not interpreter and not slow" $(XDIST) $(PYTEST_ARGS)

# fairseq's and ESPnet's own tests (pinned sdists from PyPI, cached in .cache/toolkit-tests/) with the
# plugin's classes substituted, in each SDMA mode and reading; fails on a failure that
# tests/toolkits/expected_failures.toml does not explain, or on an expected failure that passes.
test-toolkits: install
	$(PYTHON_VENV) tests/toolkits/run_toolkit_tests.py

# The GPU tier (tests/gpu): CUDA kernels, fairseq --fp16/--bf16/--amp, DDP, ESPnet --ngpu 1 (needs a GPU).
test-gpu: install
	@$(PYTHON_VENV) -c "import torch, sys; torch.cuda.is_available() or sys.exit('test-gpu: no CUDA device is visible (make test runs everything else)')"
	$(PYTHON_VENV) -m pytest tests/gpu $(PYTEST_ARGS)

# Validate a GPU machine: the GPU tier, then the benchmarks on the GPU; writes outputs/gpu/report.json.
gpu-check: install
	$(PYTHON_VENV) -m benchmarks.gpu_check

# V-T / SMA-T / SDMA-T speed per attention kernel on short and IWSLT-length sentences, every run under its own
# deadline, the whole within 8 minutes (a 15-minute GPU lease); writes outputs/gpu/sdma_gpu_speed.json.
gpu-speed: install
	$(PYTHON_VENV) -m benchmarks.sdma.gpu_speed

bench: install
	$(PYTHON_VENV) -m benchmarks.sdma.bench

clean-outputs:
	rm -rf outputs
