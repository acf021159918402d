#!/usr/bin/env python3
"""A llama-cpp-python chat whose earlier turns are kept compressed by kvtc.

    make python
    LLAMA_CPP_LIB_PATH=.deps/llama-shared .deps/venv/bin/python examples/python_cache.py CALIBRATION.safetensors

Two conversations take turns in one Llama (as on a server with one slot):
each switch would recompute the other conversation's whole prefix; with
KvtcCache the prefix is restored from its compressed state instead.
Prints each turn's time to the answer and what the cache holds.
"""
import glob
import sys
import time

import llama_cpp
from kvtc.llama_cpp import KvtcCache

MODEL = ".deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    llm = llama_cpp.Llama(MODEL, n_ctx=4096, verbose=False)
    cache = KvtcCache(sys.argv[1], llm, capacity_bytes=64 << 20, ratio=16)
    llm.set_cache(cache)
    # Two documents of the corpus (make corpus): a letter and a manual page.
    docs = {}
    for name, path in (("letter", ".deps/corpus/eval/prose/bible_1John.txt"), ("manual", sorted(glob.glob(".deps/corpus/eval/docs/*"))[0])):
        with open(path) as f:
            docs[name] = f.read()[:3000]
    chats = {name: text + "\n\nQuestion: What is this text about?\nAnswer:" for name, text in docs.items()}
    for turn in range(3):
        for name in chats:
            t = time.perf_counter()
            answer = llm(chats[name], max_tokens=16, temperature=0)["choices"][0]["text"]
            print(f"turn {turn} {name:7s} {time.perf_counter() - t:6.2f} s  {answer.strip()[:60]!r}")
            chats[name] += answer + "\nQuestion: And then?\nAnswer:"
    cache.flush()
    s = cache.stats()
    print(f"cache: {s['entries']} prompts, {s['ram_bytes'] / 2**20:.1f} MiB compressed in RAM, "
          f"hits {s['hits_ram'] + s['hits_pending']}, misses {s['misses']}, {s['tokens_restored']} tokens restored")
    cache.close()


if __name__ == "__main__":
    main()
