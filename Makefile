# kvtc front door. Every target sets itself up on a fresh Debian 12 machine:
#   make          bootstrap (Debian packages, pinned PyPI downloads, models,
#                 llama.cpp static libraries) + build       -> .deps/, build/
#   make corpus   the text corpus from Debian packages       -> .deps/corpus/
#   make test     all of the above, then the test suite (ctest)
#   make demo     capture a real session and restore it       -> out/demo/
#   make check-long  capture + restore at the full 8K context -> bench/results/capture.md
JOBS ?= $(shell nproc)
BUILD ?= build
CORPUS := .deps/corpus/manifest.json

.PHONY: all bootstrap build corpus test demo check-long clean distclean

all: build

bootstrap:
	@scripts/bootstrap.sh

build: bootstrap
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >$(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@cmake --build $(BUILD) -j$(JOBS)

$(CORPUS): scripts/build_corpus.py | build
	python3 scripts/build_corpus.py --kvtc $(BUILD)/kvtc --out .deps/corpus

corpus: build $(CORPUS)

test: build $(CORPUS)
	cd $(BUILD) && ctest --output-on-failure -j1

demo: build $(CORPUS)
	@scripts/demo.sh $(BUILD)/kvtc

check-long: build $(CORPUS)
	@scripts/check_long.sh $(BUILD)/kvtc

clean:
	rm -rf $(BUILD) $(BUILD).configure.log out

distcheck-long: build $(CORPUS)
	@scripts/check_long.sh $(BUILD)/kvtc

clean: clean
	rm -rf .deps
