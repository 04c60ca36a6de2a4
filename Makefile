# The two commands of the README: `make demo` and `make test`. Both set up everything first.
.PHONY: setup test demo lint crds

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/test.sh

demo: setup
	.venv/bin/loraplane up --demo

lint: setup
	bash scripts/lint.sh

crds: setup
	.venv/bin/loraplane gen-crds
