# Quick start:  make demo   (set up .venv, install, train the demo model with NVMe offload)
#               make test   (set up .venv, install, run the suite with native kernels, then numba)
#
# torch==2.13.0 is pinned for set-up because on a machine without a GPU pip takes the local
# CPU wheel for exactly that release; an unpinned `torch` would pull a multi-GB CUDA build.
# tools/install_torch.py installs it: where pip would still take a CUDA build on a machine
# without a GPU (a Python the local wheel is not for), it takes PyTorch's CPU index or stops.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.offload-installed
# Three pytest workers (pytest-xdist, a test module each at a time) on CI's two cores: with
# two the suite kept about 1.5 cores busy (subprocesses, gloo ranks, disk waits, spawned
# interpreters importing torch), and it must fit its 10-minute budget. WORKERS=0 runs it in
# one process. OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning, which
# ate about half of the CPU with three workers (tests/conftest.py).
# PYTHONDONTWRITEBYTECODE= (empty: off), where the environment sets it: the workers and the
# interpreters the tests start then reuse the compiled test modules (their asserts rewritten
# by pytest) and offload's, instead of compiling them again in each (~5 CPU-s per worker).
WORKERS ?= 3
# Each native unit's object is kept under a digest of its sources, flags and compiler
# ([Note: native object cache] in setup.py): the wheel test's `pip wheel` of a copy of the
# tree links what set-up compiled instead of compiling it again. `make clean` drops it.
export OFFLOAD_NATIVE_CACHE ?= $(CURDIR)/build/native-objects
PYTEST := OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadscope)

.PHONY: setup demo test test-native test-numba bench clean

setup: $(STAMP)

$(STAMP): setup.py setup.cfg pyproject.toml $(wildcard native/*.cpp native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PY) tools/install_torch.py "$(TORCH)"
	$(PIP) install -q --no-build-isolation -e ".[test,plot]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/offload demo

test: setup
	$(MAKE) --no-print-directory test-native
	$(MAKE) --no-print-directory test-numba

test-native:
	OFFLOAD_BACKEND=native $(PYTEST) tests

test-numba:
	OFFLOAD_BACKEND=numba $(PYTEST) tests

clean:
	rm -rf $(VENV) build *.egg-info offload/kernels/liboffload_native.so offload/kernels/native_build_error.txt
