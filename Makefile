# The two entry points of the README: `make serve` and `make test`.
.PHONY: setup serve test lint slow bench

.venv/.ready: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: .venv/.ready

serve: setup
	./launch.sh $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: lint
	.venv/bin/python -m pytest -q $(ARGS)

slow: setup
	.venv/bin/python -m pytest -q -m slow $(ARGS)
