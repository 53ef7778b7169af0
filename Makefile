# Two commands: `make demo` and `make test`. Both install what is missing.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test demo learn clean asan tsa fuzz lint

all: build

deps:
	./deploy/install-deps.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 1500

demo: build
	./deploy/demo.sh $(BUILD_DIR)

# Learning harness (bench/learn, not part of `make test`): CartPole-v1,
# Acrobot-v1 and MountainCar-v0 over seeds 1-3 with the CPU backend; JSON
# lines, summary.json and PNG curves in LEARN_OUT. LEARN_ARGS adds flags of
# bench/learn/learn.py (e.g. --envs CartPole-v1 --jobs 2).
LEARN_OUT ?= bench/learn/out
LEARN_ARGS ?=
learn: build
	python3 -c "import matplotlib, gymnasium" 2>/dev/null || python3 -m pip install -q \
	  $$(python3 -m pip install --help | grep -q -- --break-system-packages && echo --break-system-packages) \
	  -r bench/learn/requirements.txt
	python3 bench/learn/learn.py --qstreamd $(BUILD_DIR)/qstreamd --out $(LEARN_OUT) $(LEARN_ARGS)

clean:
	rm -rf $(BUILD_DIR)

# ASan + UBSan build of the host code (CPU backend), fast tests only.
asan: deps
	cmake -S . -B build-asan -G Ninja -DQSTREAM_CUDA=OFF -DQSTREAM_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS) -LE slow

# clang -Wthread-safety build: checks the ABSL_GUARDED_BY annotations (GCC ignores them).
tsa: deps
	CXX=clang++ CC=clang cmake -S . -B build-tsa -G Ninja -DQSTREAM_CUDA=OFF -DQSTREAM_WERROR=ON \
	  -DCMAKE_CXX_FLAGS="-Wthread-safety"
	cmake --build build-tsa -j $(JOBS)

# libFuzzer targets (fuzz/): clang build with ASan + UBSan, then each target
# for FUZZ_SECONDS on a copy of its seed corpus; fails on any finding.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := transition_batch config checkpoint
fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DQSTREAM_FUZZ=ON -DQSTREAM_CUDA=OFF \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)
	cmake --build build-fuzz -j $(JOBS) --target $(FUZZ_TARGETS:%=%_fuzzer)
	./fuzz/run.sh build-fuzz $(FUZZ_SECONDS) $(FUZZ_TARGETS)

# clang-format and clang-tidy, warnings are errors, on the changed lines of the
# C++ code (tools/lint-changed.sh: BASE defaults to the merge-base with
# origin/main, else HEAD~1). Needs the build's compile_commands.json and
# generated headers. LINT_ARGS=--full: the changed files as a whole;
# LINT_ARGS=--all: every file.
LINT_BASE ?=
LINT_ARGS ?=
lint: build
	BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) ./tools/lint-changed.sh $(LINT_ARGS) $(LINT_BASE)
