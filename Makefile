# The two commands of the quick start: `make test` and `make demo`. Each installs what it
# needs: Open MPI through apt-get (when absent and running as root), then the package and its
# test extras (torch, diffusers and accelerate among them) into a virtual environment at
# .venv (set VENV to move it).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 4
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_btl_vader_single_copy_mechanism := none
export OMPI_MCA_mpi_yield_when_idle := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export OMPI_MCA_hwloc_base_binding_policy := none

CC ?= gcc
CFLAGS_CHECK := -std=c11 -O1 -g -Wall -Wextra -Werror -Wshadow -fsanitize=address,undefined -fno-sanitize-recover=all
include csrc/sources.mk
CORE_SRC += $(TEST_SRC)  # the C tests run the test-only backends too
TESTBIN := csrc/tests/bin

.PHONY: all sysdeps venv build cuda-abi-check ctest ctest-clang clang pytest test demo demo-latents bench clean fuzz fuzz-smoke fuzz-build fuzz-deps

all: build

# System packages: Open MPI (with mpicc), a C compiler, Python's venv module and headers.
# Installed with apt-get when missing and running as root; otherwise the message says what.
sysdeps:
	@missing=""; \
	{ command -v mpicc && command -v mpiexec; } >/dev/null || missing="$$missing libopenmpi-dev openmpi-bin"; \
	command -v cc >/dev/null || missing="$$missing gcc make"; \
	$(PYTHON) -c "import venv, ensurepip" 2>/dev/null || missing="$$missing python3-venv"; \
	$(PYTHON) -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
	  2>/dev/null || missing="$$missing python3-dev"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing system packages:$$missing (install them, e.g. with apt-get, then rerun)"; exit 1; \
	  fi; \
	fi

$(VENV)/.stamp: pyproject.toml | sysdeps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --upgrade "setuptools>=77" wheel "numpy>=2.0" "pytest>=7" "pytest-xdist>=3.5" "safetensors>=0.4"
	@echo "installing torch, diffusers, accelerate, transformers and the video writer (the torch wheel brings its CUDA libraries: a few GB)"
	$(PY) -m pip install -q "torch>=2.4" "diffusers>=0.35" "accelerate>=1.0" "transformers>=4.45" "tokenizers>=0.20" \
	  "ftfy>=6.0" "imageio>=2.30" "imageio-ffmpeg>=0.5"
	@echo "installing the HTTP server of hsdp serve and its test clients (fastapi, uvicorn, python-multipart, prometheus_client, httpx, openai)"
	$(PY) -m pip install -q "fastapi>=0.110" "uvicorn>=0.29" "python-multipart>=0.0.9" "prometheus_client>=0.20" "httpx>=0.27" \
	  "openai>=1.100"
	touch $@

venv: $(VENV)/.stamp

# Editable install: the extension is rebuilt from csrc/ each time; warnings are errors.
build: sysdeps venv
	HSDP_WERROR=1 HSDP_TEST_BACKENDS=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .

$(TESTBIN)/test_dtype: csrc/tests/test_dtype.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk
	@mkdir -p $(TESTBIN)
	$(CC) $(CFLAGS_CHECK) -Icsrc $(CORE_SRC) $< -o $@ -lm -lpthread
$(TESTBIN)/test_core: csrc/tests/test_core.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk csrc/tests/check.h
	@mkdir -p $(TESTBIN)
	$(CC) $(CFLAGS_CHECK) -Icsrc $(CORE_SRC) $< -o $@ -lm -lpthread
$(TESTBIN)/test_layout: csrc/tests/test_layout.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk csrc/tests/check.h
	@mkdir -p $(TESTBIN)
	$(CC) $(CFLAGS_CHECK) -Icsrc $(CORE_SRC) $< -o $@ -lm -lpthread
$(TESTBIN)/test_mpi: csrc/tests/test_mpi.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk csrc/tests/check.h | sysdeps
	@mkdir -p $(TESTBIN)
	$(CC) $(CFLAGS_CHECK) -DHSDP_HAVE_MPI $$(mpicc --showme:compile) -Icsrc $(CORE_SRC) $< -o $@ $$(mpicc --showme:link) -ldl -lm -lpthread

$(TESTBIN)/test_mpi_preinit: csrc/tests/test_mpi_preinit.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk csrc/tests/check.h | sysdeps
	@mkdir -p $(TESTBIN)
	$(CC) $(CFLAGS_CHECK) -DHSDP_HAVE_MPI $$(mpicc --showme:compile) -Icsrc $(CORE_SRC) $< -o $@ $$(mpicc --showme:link) -ldl -lm -lpthread

# The NCCL backend's loading and refusals, built like the package: against csrc/cuda_abi.h,
# no CUDA or NCCL header. Run against the libraries of torch's nvidia wheels (no GPU needed)
# when they are installed, and always against fake_cuda_nccl.so: a world of one ending in a
# timeout, one ending in an asynchronous error, and a world of 3 forked ranks ending in a rank
# that never arrives (named by the others), and one (NCCL before 2.28.3: the all-to-all as
# grouped sends and receives between the ranks) ending in ranks that gather different units.
# The float8 wire's kernel is loaded as a CUBIN for the fake's sm_90, in the ranks under a
# driver that refuses PTX (FAKE_REFUSE_PTX=1), and as PTX in the race run (FAKE_CC=100: a
# device newer than the fake NVRTC).
NCCL_LIB = $$(find $(VENV)/ -name 'libnccl.so.2' -path '*nvidia*' | head -1)
CUDART_LIB = $$(find $(VENV)/ -name 'libcudart.so.1[0-9]' -path '*nvidia*' | head -1)
$(TESTBIN)/test_nccl: csrc/tests/test_nccl.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk csrc/tests/check.h
	@mkdir -p $(TESTBIN)
	$(CC) $(CFLAGS_CHECK) -DHSDP_PIN_SLOT_BYTES=16 -Icsrc $(CORE_SRC) $< -o $@ -ldl -lm -lpthread

$(TESTBIN)/fake_cuda_nccl.so: csrc/tests/fake_cuda_nccl.c csrc/cuda_abi.h
	@mkdir -p $(TESTBIN)
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -fPIC -shared -Icsrc $< -o $@ -lpthread

# csrc/cuda_abi.h against the real headers, each installation found (csrc/cuda_headers.py:
# HSDP_CUDA_HOME, torch's nvidia wheels, /usr/local/cuda): compiling it is the check.
# Skipped, saying so, where there are none.
cuda-abi-check: | venv
	@mkdir -p $(TESTBIN)
	@found="$$($(PY) csrc/cuda_headers.py)"; \
	if [ -z "$$found" ]; then \
	  echo "test_cuda_abi: SKIPPED: no nccl.h and cuda_runtime_api.h found (HSDP_CUDA_HOME, torch's nvidia wheels,"; \
	  echo "  /usr/local/cuda), so csrc/cuda_abi.h was not compared with the real headers"; \
	else \
	  while read -r flags; do \
	    echo "$(CC) ... $$flags csrc/tests/test_cuda_abi.c"; \
	    $(CC) -std=c11 -O1 -Wall -Wextra -Werror -Wshadow $$flags -Icsrc csrc/tests/test_cuda_abi.c \
	      -o $(TESTBIN)/test_cuda_abi && $(TESTBIN)/test_cuda_abi || exit 1; \
	  done <<< "$$found"; \
	fi

# The C core's own tests, under AddressSanitizer and UndefinedBehaviorSanitizer. Where a libnvrtc
# is installed (torch's nvidia wheels, /usr/local/cuda), test_nccl --nvrtc compiles the float8
# wire's kernel with it (no GPU needed): a CUBIN for sm_90, and PTX for a device newer than it knows; LD_LIBRARY_PATH points at its directory because under
# ASan NVRTC does not find its builtins library by its own $ORIGIN. Open MPI
# keeps allocations alive past MPI_Finalize by design, so leak checking is off for its test.
ctest: $(TESTBIN)/test_dtype $(TESTBIN)/test_core $(TESTBIN)/test_layout $(TESTBIN)/test_mpi $(TESTBIN)/test_mpi_preinit \
	$(TESTBIN)/test_nccl $(TESTBIN)/fake_cuda_nccl.so cuda-abi-check
	$(TESTBIN)/test_dtype
	$(TESTBIN)/test_core
	$(TESTBIN)/test_layout
	set -o pipefail; ASAN_OPTIONS=detect_leaks=0 mpiexec -n 4 $(TESTBIN)/test_mpi | sort | uniq -c
	set -o pipefail; for level in funneled serialized; do \
	  ASAN_OPTIONS=detect_leaks=0 mpiexec -n 2 $(TESTBIN)/test_mpi_preinit $$level | sort | uniq -c || exit 1; done
	@nccl="$(NCCL_LIB)"; cudart="$(CUDART_LIB)"; \
	if [ -n "$$nccl" ] && [ -n "$$cudart" ]; then \
	  echo "ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl $$nccl $$cudart"; \
	  ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl "$$nccl" "$$cudart" || exit 1; \
	else echo "test_nccl: SKIPPED the real libraries: no libnccl.so.2 and libcudart in $(VENV)'s nvidia wheels"; fi
	ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --fake $(TESTBIN)/fake_cuda_nccl.so
	ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --fake $(TESTBIN)/fake_cuda_nccl.so clean   # finalize with a group held
	FAKE_NCCL_VERSION=22700 FAKE_CC=100 ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --fake \
	  $(TESTBIN)/fake_cuda_nccl.so race   # before 2.28.3: all_to_all as grouped sends and receives; a device newer than NVRTC: PTX
	FAKE_REFUSE_PTX=1 ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --fake $(TESTBIN)/fake_cuda_nccl.so ranks 3   # a driver older than NVRTC: the CUBIN loads
	FAKE_NCCL_VERSION=22700 ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --fake \
	  $(TESTBIN)/fake_cuda_nccl.so ranks 3 desync   # the grouped all-to-all between ranks too
	ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --fake $(TESTBIN)/fake_cuda_nccl.so ranks 2 desync-sizes
	@nvrtc="$$(find -L $(VENV)/ /usr/local/cuda/lib64/ -name 'libnvrtc.so.1[0-9]' 2>/dev/null | head -1)"; \
	driver="$$(find -L /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/lib64/stubs -maxdepth 1 -name 'libcuda.so*' 2>/dev/null | head -1)"; \
	if [ -n "$$nvrtc" ] && [ -n "$$driver" ]; then \
	  libdir="$$(dirname "$$(readlink -f "$$nvrtc")")"; \
	  echo "LD_LIBRARY_PATH=$$libdir ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --nvrtc $$nvrtc $$driver"; \
	  LD_LIBRARY_PATH="$$libdir" ASAN_OPTIONS=detect_leaks=0 $(TESTBIN)/test_nccl --nvrtc "$$nvrtc" "$$driver" || exit 1; \
	else echo "test_nccl: SKIPPED the float8 wire's kernel through the real NVRTC: no libnvrtc or libcuda found"; fi

# The same C tests (but MPI's) built by clang at -O2: another compiler's choices, e.g. the
# order it evaluates a call's arguments in (an NCCL join that read the communicator in the
# same call that wrote it passed under gcc and failed here). Run by .ci/run.
CLANG ?= clang
CLANG_CHECK := -std=c11 -O2 -g -Wall -Wextra -Werror -Wshadow -Wunsequenced -Wsequence-point \
	-fsanitize=address,undefined -fno-sanitize-recover=all
CLANGBIN := $(TESTBIN)/clang
clang:
	@command -v $(CLANG) >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing: clang (apt-get), for ctest-clang"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; \
	  else echo "missing: $(CLANG) (install clang, e.g. apt-get install clang)"; exit 1; fi; }

ctest-clang: clang
	@mkdir -p $(CLANGBIN)
	for t in test_dtype test_core test_layout test_nccl; do \
	  $(CLANG) $(CLANG_CHECK) -DHSDP_PIN_SLOT_BYTES=16 -Icsrc $(CORE_SRC) csrc/tests/$$t.c -o $(CLANGBIN)/$$t -ldl -lm -lpthread || exit 1; done
	$(CLANG) -std=c11 -O2 -g -Wall -Wextra -Werror -fPIC -shared -Icsrc csrc/tests/fake_cuda_nccl.c \
	  -o $(CLANGBIN)/fake_cuda_nccl.so -lpthread
	$(CLANGBIN)/test_dtype
	$(CLANGBIN)/test_core
	$(CLANGBIN)/test_layout
	ASAN_OPTIONS=detect_leaks=0 $(CLANGBIN)/test_nccl --fake $(CLANGBIN)/fake_cuda_nccl.so stall
	ASAN_OPTIONS=detect_leaks=0 $(CLANGBIN)/test_nccl --fake $(CLANGBIN)/fake_cuda_nccl.so clean
	FAKE_NCCL_VERSION=22700 FAKE_CC=100 ASAN_OPTIONS=detect_leaks=0 $(CLANGBIN)/test_nccl --fake $(CLANGBIN)/fake_cuda_nccl.so race
	FAKE_REFUSE_PTX=1 ASAN_OPTIONS=detect_leaks=0 $(CLANGBIN)/test_nccl --fake $(CLANGBIN)/fake_cuda_nccl.so ranks 3
	FAKE_NCCL_VERSION=22700 ASAN_OPTIONS=detect_leaks=0 $(CLANGBIN)/test_nccl --fake $(CLANGBIN)/fake_cuda_nccl.so ranks 3 desync

# Two pytest workers, one test file each at a time (--dist loadfile): a file's tests share
# fixtures and resources (network namespaces, servers), and the multi-rank jobs of two files
# overlap one another's start-up and waits. 7 minutes on 2 cores, against 11 in one process.
PYTEST_FLAGS ?= -n 2 --dist loadfile
pytest: build
	$(PY) -m pytest -q $(PYTEST_FLAGS)

test: ctest pytest

# A tiny random Wan2.2 pipeline folder (two transformers, text encoder, VAE; no downloads),
# then prompt to video on NP ranks, sharded, checked against the stock unsharded pipeline, and
# the mp4 read back (imageio, with imageio-ffmpeg's own ffmpeg binary).
DEMO_MODEL := outputs/tiny-wan22
DEMO_VIDEO := outputs/demo.mp4
demo: build
	$(PY) -m hsdp.testing.tiny_pipeline $(DEMO_MODEL) --kind wan22
	$(PY) -m hsdp generate --model $(DEMO_MODEL) --prompt "a red fish swimming in the river" \
	  --height 64 --width 64 --num-frames 9 --num-inference-steps 8 --dtype float32 \
	  --use-hsdp --hsdp-shard-size $(NP) --verify --output $(DEMO_VIDEO)
	$(PY) -c "import imageio, sys; r = imageio.get_reader(sys.argv[1]); f = [x for x in r]; \
	  print(f'{sys.argv[1]}: {len(f)} frames of {f[0].shape[1]}x{f[0].shape[0]}, {r.get_meta_data()[\"fps\"]:g} fps, {r.get_meta_data()[\"codec\"]}')" $(DEMO_VIDEO)

# The pipeline on hsdp's reference NumPy DiT, latents only (the demo before pipelines).
demo-latents: build
	$(PY) -m hsdp.launch -n $(NP) -- examples/offline_inference/text_to_video.py --use-hsdp --hsdp-shard-size $(NP) --verify \
	  --preset base --frames 2 --height 32 --width 32

bench: build
	$(PY) bench/run_all.py

# Fuzzing the checkpoint reader (docs/checkpoints.md#fuzzing): a libFuzzer harness (clang,
# ASan + UBSan) over the C data path, hsdp_unit_read, and an atheris harness over the header
# parser and validator. `make fuzz` runs each for FUZZ_RUNS executions; `make fuzz-smoke`
# (what CI runs, after `make test`) each for FUZZ_SECONDS. Neither builds the package: the
# atheris harness runs under FUZZ_PY (by default the project's venv, into which fuzz-deps
# installs atheris from a wheel) with hsdp importable there, as `make build` leaves it.
# Findings (crash-*, leak-*, timeout-*) land in $(FUZZ_OUT).
FUZZ_RUNS ?= 10000000
FUZZ_SECONDS ?= 60
FUZZ_PY ?= $(PY)
FUZZ_CC ?= clang
FUZZ_OUT := $(TESTBIN)/fuzz
FUZZ_FLAGS := -std=c11 -O1 -g -Wall -Wextra -Werror -Wshadow -fsanitize=fuzzer,address,undefined \
	-fno-sanitize-recover=all -DHSDP_BOUNCE_BYTES=64

$(TESTBIN)/fuzz_checkpoint: csrc/tests/fuzz_checkpoint.c $(CORE_SRC) csrc/*.h csrc/*.def csrc/sources.mk
	@command -v $(FUZZ_CC) >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing: clang (apt-get), for the libFuzzer harness"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; \
	  else echo "missing: $(FUZZ_CC) with libFuzzer (install clang, e.g. apt-get install clang)"; exit 1; fi; }
	@mkdir -p $(TESTBIN)
	$(FUZZ_CC) $(FUZZ_FLAGS) -Icsrc $(CORE_SRC) $< -o $@ -lm -lpthread

fuzz-build: $(TESTBIN)/fuzz_checkpoint

fuzz-deps:
	@$(FUZZ_PY) -c "import hsdp" 2>/dev/null || { \
	  echo "missing: hsdp importable by $(FUZZ_PY) (run 'make build', or set FUZZ_PY/PYTHONPATH)"; exit 1; }
	@$(FUZZ_PY) -c "import atheris" 2>/dev/null || { \
	  echo "installing: atheris into $(FUZZ_PY)'s environment (a binary wheel only)"; \
	  $(FUZZ_PY) -m pip install -q --only-binary=:all: atheris || { \
	    echo "missing: atheris for $$($(FUZZ_PY) -V) on $$(uname -m): no wheel installs here (it needs a"; \
	    echo "  supported CPython and platform, or clang and libFuzzer to build from source)"; exit 1; }; }

# One harness: $(1) name, $(2) the command, $(3) its seed folder, $(4) libFuzzer flags. New
# inputs go to a working corpus ($(FUZZ_OUT)/NAME), not into the committed seeds.
define run_fuzzer
	@mkdir -p $(FUZZ_OUT)/$(1)
	set -o pipefail; $(2) $(FUZZ_OUT)/$(1) $(3) -artifact_prefix=$(FUZZ_OUT)/$(1)- $(4) 2>&1 \
	  | tee $(FUZZ_OUT)/$(1).log | { grep -E "DONE|SUMMARY|ERROR|Done [0-9]+ runs" || true; }
	@echo "$(1): $$(grep -Eo 'number_of_executed_units: [0-9]+' $(FUZZ_OUT)/$(1).log | tail -1) (log: $(FUZZ_OUT)/$(1).log)"
endef

fuzz-smoke: fuzz-build fuzz-deps
	$(call run_fuzzer,checkpoint,$(CURDIR)/$(TESTBIN)/fuzz_checkpoint,fuzz/seeds/checkpoint,-max_total_time=$(FUZZ_SECONDS) -print_final_stats=1)
	$(call run_fuzzer,header,$(FUZZ_PY) $(CURDIR)/fuzz/fuzz_header.py,fuzz/seeds/header,-max_total_time=$(FUZZ_SECONDS) -print_final_stats=1)

fuzz: fuzz-build fuzz-deps
	$(call run_fuzzer,checkpoint,$(CURDIR)/$(TESTBIN)/fuzz_checkpoint,fuzz/seeds/checkpoint,-runs=$(FUZZ_RUNS) -print_final_stats=1)
	$(call run_fuzzer,header,$(FUZZ_PY) $(CURDIR)/fuzz/fuzz_header.py,fuzz/seeds/header,-atheris_runs=$(FUZZ_RUNS) -print_final_stats=1)

clean:
	rm -rf build $(TESTBIN) python/hsdp/*.so python/*.egg-info
