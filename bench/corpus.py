"""The corpus manifest (.deps/corpus/manifest.json, docs/corpus.md) for the
bench scripts: their one reader of it, with the same selection as the C++
reader kvtc::Corpus::docs (include/kvtc/corpus.h): documents of one split,
of the given kinds, holding at least a number of tokens, in manifest order.
Each document is the manifest's entry as is (id, kind, split, file, tokens,
...); path() joins its file to the corpus root. Only the standard library.
"""
import json
import os

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(TOP, ".deps", "corpus")
KINDS = ("prose", "docs", "code", "math")


def documents(split="eval", kinds=(), min_tokens=0, root=ROOT):
    """The documents of `split` of the given kinds (empty: all) holding at
    least min_tokens tokens, in manifest order (kvtc::Corpus::docs)."""
    with open(os.path.join(root, "manifest.json")) as f:
        docs = json.load(f)["documents"]
    return [d for d in docs if d["split"] == split and d["tokens"] >= min_tokens and (not kinds or d["kind"] in kinds)]


def per_kind(n, min_tokens, root=ROOT):
    """The first n evaluation documents of each kind (prose, docs, code,
    math, in that order) holding at least min_tokens tokens: the captures
    bench/ratio.py and bench/entropy.py measure."""
    docs = []
    for kind in KINDS:
        docs += documents("eval", [kind], min_tokens, root)[:n]
    return docs


def path(doc, root=ROOT):
    """The document's text file."""
    return os.path.join(root, doc["file"])
