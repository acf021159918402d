#!/usr/bin/env python3
"""Merge kvtc quality results of separate runs (one per context length) into
one pair: bench/results/NAME.md and NAME.json. Each input keeps its own
command, commit and machine lines; the JSON's "contexts" lists are joined.

Usage: bench/merge_quality.py NAME [--notes FILE] PART [PART ...]   (PART: bench/results/PART.{md,json})
--notes appends a hand-written reading of the tables (markdown) at the end.
"""
import json
import os
import sys

res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
name, parts, notes = sys.argv[1], sys.argv[2:], None
if parts[:1] == ["--notes"]:
    notes, parts = parts[1], parts[2:]
merged = None
md = [f"# kvtc quality: {name}", "", f"Merged from {', '.join(p + '.md' for p in parts)} (one run per context length; each part's command, commit and machine below).", ""]
for p in parts:
    with open(os.path.join(res, p + ".json")) as f:
        j = json.load(f)
    if merged is None:
        merged = dict(j)
        merged["runs"] = []
        merged["contexts"] = []
        merged["vanilla_equals_no_restore"] = True
    merged["contexts"] += j["contexts"]
    merged["vanilla_equals_no_restore"] = merged["vanilla_equals_no_restore"] and j["vanilla_equals_no_restore"]
    merged["runs"].append({"part": p, "seconds": j.get("seconds"), "samples": j.get("samples")})
    with open(os.path.join(res, p + ".md")) as f:
        lines = f.read().splitlines()
    md += [f"## part {p}", ""] + [l for l in lines[1:] if l.strip() or md[-1].strip()]
    md.append("")
if notes:
    with open(notes) as f:
        md += ["", f.read().rstrip()]
for ext, text in (("json", json.dumps(merged, indent=1) + "\n"), ("md", "\n".join(md) + "\n")):
    path = os.path.join(res, f"{name}.{ext}")
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)
print(f"wrote {os.path.join(res, name)}.md and .json")
