# The two entry points of the README: `make serve` and `make test`.
.PHONY: setup serve test test-shuffled lint slow bench

.venv/.ready: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: .venv/.ready

serve: setup
	./launch.sh $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Two test processes side by side (most tests wait on daemons, not on a core); a file's tests stay
# in one process, so its module fixtures start once. WORKERS=0 runs them in this one.
WORKERS ?= 2
test: lint
	.venv/bin/python -m pytest -q -n $(WORKERS) --dist loadfile $(ARGS)

# Tests that must pass in any order: a shuffled run (a new seed each time, printed) of the suites
# that share in-process state or module fixtures.
SHUFFLED = tests/test_lane_host*.py tests/test_kv_blocks.py tests/test_validation.py tests/test_sampling.py \
	tests/test_attention.py tests/test_probe.py tests/test_wire.py tests/test_text_stream.py tests/test_job_queue.py \
	tests/test_cache_pair.py tests/test_tp_exact.py tests/test_resume_exact.py
test-shuffled: setup
	seed=$${SEED:-$$(date +%s)}; echo "shuffled with SEED=$$seed (make test-shuffled SEED=$$seed repeats it)"; \
	.venv/bin/python -m pytest -q -p random_order --random-order-bucket=global --random-order-seed=$$seed $(SHUFFLED) $(ARGS)

slow: setup
	.venv/bin/python -m pytest -q -m slow $(ARGS)
