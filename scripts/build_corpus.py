#!/usr/bin/env python3
"""Build kvtc's text corpus from Debian-packaged sources.

    scripts/build_corpus.py --kvtc build/kvtc --out .deps/corpus

Four kinds of real text, each from installed Debian packages (the bootstrap
installs them):
  prose  the King James Bible (bible-kjv-text, read through bible-kjv's
         `bible` program) and the Jargon File (jargon-text)
  docs   the Python 3.11 documentation sources (python3.11-doc) and the
         Debian Reference (debian-reference-en, HTML converted to text)
  code   the Python 3.11 standard library (libpython3.11-stdlib)
  math   the Maxima manual (maxima-doc, HTML converted to text)

Long sources are cut at paragraph boundaries into documents; documents are
then measured with the model's own tokenizer (`kvtc tokens`) and kept when
they hold 1K-32K tokens. Each document is assigned to the calibration or the
evaluation split by a hash of its id, so the split is disjoint by document
and stable across machines (all parts of one source fall on the same side). manifest.json records, per document: id, kind,
split, package, package version, source path(s), sha256, characters, tokens.

Deterministic: same packages in, same corpus out. Idempotent: the output
folder is rebuilt into a temporary sibling and renamed into place.
"""
import argparse
import glob
import gzip
import hashlib
import html
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys

MIN_TOKENS, MAX_TOKENS = 1024, 32768
MAX_CHARS = 60000     # cut long sources into documents of <= ~15K tokens
MIN_CHARS = 3000      # below ~1K tokens for any of the four kinds
PER_KIND_CAP = 70     # documents kept per kind (enough for 160K+ calibration tokens)
EVAL_SHARE = 30       # percent of documents that go to the evaluation split
CORPUS_VERSION = 1

BIBLE_BOOKS = """Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1Samuel 2Samuel
1Kings 2Kings 1Chronicles 2Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes
Song Isaiah Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum
Habakkuk Zephaniah Haggai Zechariah Malachi Matthew Mark Luke John Acts Romans 1Corinthians
2Corinthians Galatians Ephesians Philippians Colossians 1Thessalonians 2Thessalonians
1Timothy 2Timothy Titus Philemon Hebrews James 1Peter 2Peter 1John 2John 3John Jude
Revelation""".split()


def pkg_version(pkg):
    try:
        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None


class _Text(html.parser.HTMLParser):
    """HTML to plain text: drops scripts/styles, keeps block structure."""
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd", "table", "blockquote"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self.skip += 1
        elif tag in self.BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data)


def html_to_text(s):
    p = _Text()
    p.feed(s)
    text = "".join(p.out)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def split_paragraphs(text, limit=MAX_CHARS):
    """Cuts text at blank lines (or lines) into pieces of <= limit chars."""
    if len(text) <= limit:
        return [text]
    parts, cur, size = [], [], 0
    for para in re.split(r"(\n\s*\n)", text):
        if size + len(para) > limit and cur:
            parts.append("".join(cur))
            cur, size = [], 0
        while len(para) > limit:  # a single huge paragraph: cut at line ends
            cut = para.rfind("\n", 0, limit)
            cut = cut if cut > 0 else limit
            parts.append(para[:cut])
            para = para[cut:]
        cur.append(para)
        size += len(para)
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def sources():
    """Yields (kind, package, source_id, paths, text) for every raw source."""
    if shutil.which("bible"):
        for book in BIBLE_BOOKS:
            r = subprocess.run(["bible", "-f", f"{book}1:1-999:999"], capture_output=True, text=True)
            if r.returncode == 0 and len(r.stdout) > 100:
                yield "prose", "bible-kjv-text", f"bible/{book}", [f"bible -f {book}1:1-999:999 (/usr/lib/bible.data)"], r.stdout
    jargon = "/usr/share/doc/jargon-text/jargon.txt.gz"
    if os.path.exists(jargon):
        with gzip.open(jargon, "rt", encoding="utf-8", errors="replace") as f:
            yield "prose", "jargon-text", "jargon", [jargon], f.read()
    for p in sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/**/*.rst.txt", recursive=True)):
        with open(p, encoding="utf-8", errors="replace") as f:
            yield "docs", "python3.11-doc", "pydoc/" + os.path.relpath(p, "/usr/share/doc/python3.11/html/_sources"), [p], f.read()
    for p in sorted(glob.glob("/usr/share/debian-reference/*.en.html")):
        with open(p, encoding="utf-8", errors="replace") as f:
            yield "docs", "debian-reference-en", "debref/" + os.path.basename(p), [p], html_to_text(f.read())
    for p in sorted(glob.glob("/usr/lib/python3.11/*.py")):
        with open(p, encoding="utf-8", errors="replace") as f:
            yield "code", "libpython3.11-stdlib", "pystdlib/" + os.path.basename(p), [p], f.read()
    for p in sorted(glob.glob("/usr/share/doc/maxima-doc/html/maxima_*.html")):
        with open(p, encoding="utf-8", errors="replace") as f:
            yield "math", "maxima-doc", "maxima/" + os.path.basename(p), [p], html_to_text(f.read())


def h(s):
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtc", required=True, help="path to the kvtc binary (for `kvtc tokens`)")
    ap.add_argument("--model", help="tokenizer model (default: kvtc's default model)")
    ap.add_argument("--out", required=True, help="output folder (replaced)")
    a = ap.parse_args()

    versions = {"bible-kjv": pkg_version("bible-kjv")}  # the program that reads bible-kjv-text
    candidates = []
    for kind, pkg, sid, paths, text in sources():
        if pkg not in versions:
            versions[pkg] = pkg_version(pkg)
        pieces = split_paragraphs(text)
        for i, piece in enumerate(pieces):
            if len(piece) < MIN_CHARS:
                continue
            did = sid if len(pieces) == 1 else f"{sid}#part{i + 1}"
            candidates.append({"id": did, "source_id": sid, "kind": kind, "package": pkg, "paths": paths, "text": piece})
    kinds = sorted({c["kind"] for c in candidates})
    if len(kinds) < 3:
        sys.exit(f"build_corpus: only {kinds} found; the bootstrap installs the text packages")

    # Stable selection: order each kind by a hash of the id, keep the first
    # PER_KIND_CAP that fall in the token range.
    tmp = a.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "staging"))
    by_kind = {k: sorted((c for c in candidates if c["kind"] == k), key=lambda c: h(c["id"])) for k in kinds}
    staged = []
    for k in kinds:
        for j, c in enumerate(by_kind[k][: PER_KIND_CAP * 2]):  # 2x head-room for the token filter
            p = os.path.join(tmp, "staging", f"{k}-{j:04d}.txt")
            with open(p, "w", encoding="utf-8") as f:
                f.write(c["text"])
            c["staged"] = p
            staged.append(c)
    cmd = [a.kvtc, "tokens"] + ([] if not a.model else ["--model", a.model]) + [c["staged"] for c in staged]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"build_corpus: `kvtc tokens` failed: {r.stderr.strip()}")
    counts = {}
    for line in r.stdout.splitlines():
        j = json.loads(line)
        counts[j["path"]] = j["tokens"]

    docs = []
    kept = {k: 0 for k in kinds}
    for c in staged:
        n = counts[c["staged"]]
        if not (MIN_TOKENS <= n <= MAX_TOKENS) or kept[c["kind"]] >= PER_KIND_CAP:
            continue
        kept[c["kind"]] += 1
        # Split by source (a Bible book, a manual page), so that parts of one
        # source never sit on both sides.
        split = "eval" if int(h("split:" + c["source_id"])[:8], 16) % 100 < EVAL_SHARE else "calib"
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", c["id"]) + ".txt"
        rel = os.path.join(split, c["kind"], name)
        os.makedirs(os.path.join(tmp, split, c["kind"]), exist_ok=True)
        os.replace(c["staged"], os.path.join(tmp, rel))
        docs.append({"id": c["id"], "kind": c["kind"], "split": split, "file": rel, "package": c["package"],
                     "package_version": versions[c["package"]], "source": c["paths"],
                     "sha256": h(c["text"]), "chars": len(c["text"]), "tokens": n})
    shutil.rmtree(os.path.join(tmp, "staging"))
    for k in kinds:
        for s in ("calib", "eval"):
            if not any(d["kind"] == k and d["split"] == s for d in docs):
                sys.exit(f"build_corpus: no {k} document landed in the {s} split")
    manifest = {
        "corpus_version": CORPUS_VERSION,
        "tokenizer_model": a.model or "kvtc default",
        "token_range": [MIN_TOKENS, MAX_TOKENS],
        "eval_share_percent": EVAL_SHARE,
        "packages": {p: v for p, v in sorted(versions.items())},
        "documents": sorted(docs, key=lambda d: (d["split"], d["kind"], d["id"])),
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(a.out, ignore_errors=True)
    os.replace(tmp, a.out)
    for s in ("calib", "eval"):
        row = ", ".join(f"{k} {sum(1 for d in docs if d['split'] == s and d['kind'] == k)} docs/"
                        f"{sum(d['tokens'] for d in docs if d['split'] == s and d['kind'] == k)} tok" for k in kinds)
        print(f"[corpus] {s}: {row}")
    print(f"[corpus] wrote {a.out}/manifest.json ({len(docs)} documents)")


if __name__ == "__main__":
    main()
