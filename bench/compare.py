#!/usr/bin/env python3
"""Compares a re-run of `kvtc-lab bench` or `kvtc-lab eval` with a committed
result, row by row, to check that a change kept the numbers (bit for bit
where the computation is deterministic, within noise for times).

    python3 bench/compare.py bench/results/speed.json NEW.json [--md OUT.md]
    python3 bench/compare.py bench/results/quality-2k.json NEW.json [--md OUT.md]
    python3 bench/compare.py OLD.json NEW.json --same kvtc-16x-bf16=kvtc-16x   (a method named otherwise)

Only the rows present in both are compared (a re-run may take a subset).
Ratios, errors and scores are deterministic for a given machine and
calibration: they must agree to 1e-9 (relative; sums of squares may be
added in another order). An eval's ratio pools all its prompts, so it is
compared only when both runs had the same tasks. Exit status 1 when a
figure differs.
"""
import argparse
import json
import sys


def close(a, b):
    return a == b or (a is not None and b is not None and abs(a - b) <= 1e-9 * max(abs(a), abs(b)))


def speed_rows(j):
    rows = {}
    for c in j["contexts"]:
        for x in c["ratios"]:
            rows[(c["tokens"], x["nominal_ratio"], x["precision"])] = (c, x)
    return rows


def quality_rows(j):
    rows = {}
    for c in j["contexts"]:
        for m in c["methods"]:
            rows[(c["context"], m["name"])] = m
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--md", help="write the table here as markdown too")
    ap.add_argument("--same", nargs="*", default=[], metavar="OLD=NEW", help="an old method name that is a new one's")
    a = ap.parse_args()
    old, new = json.load(open(a.old)), json.load(open(a.new))
    lines, differ = [], 0
    if "baselines" in old:  # kvtc-lab bench
        ro, rn = speed_rows(old), speed_rows(new)
        lines.append("| tokens | nominal | proj | ratio old / new | rel. err K old / new | rel. err V old / new | compress ms old / new | "
                     "decompress ms old / new | restore ms old / new |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for k in sorted(set(ro) & set(rn)):
            (_, o), (_, n) = ro[k], rn[k]
            same = all(close(o[f], n[f]) for f in ("ratio", "rel_error_k", "rel_error_v"))
            differ += not same
            rest = f"{o['restore_ms']:.0f} / {n['restore_ms']:.0f}" if "restore_ms" in o and "restore_ms" in n else "—"
            lines.append(f"| {k[0]} | {k[1]:g}x | {k[2]} | {o['ratio']:.4f} / {n['ratio']:.4f} | {o['rel_error_k']:.6f} / {n['rel_error_k']:.6f} | "
                         f"{o['rel_error_v']:.6f} / {n['rel_error_v']:.6f} | {o['compress_ms']:.0f} / {n['compress_ms']:.0f} | "
                         f"{o['decompress_ms']:.0f} / {n['decompress_ms']:.0f} | {rest} |" + ("" if same else " **differs**"))
    else:  # kvtc-lab eval
        ro, rn = quality_rows(old), quality_rows(new)
        alias = dict(x.split("=", 1) for x in a.same)
        ro = {(c, alias.get(m, m)): v for (c, m), v in ro.items()}
        tasks = [t for t in new["tasks"] if t in old["tasks"]]
        lines.append("| context | method | ratio old / new | " + " | ".join(f"{t} old / new" for t in tasks) + " |")
        lines.append("|---|---|---|" + "---|" * len(tasks))
        for k in sorted(set(ro) & set(rn), key=lambda k: (k[0], list(rn).index(k))):
            o, n = ro[k], rn[k]
            cells = []
            # The ratio pools every prompt of the run: comparable only over the same tasks.
            same = close(o["ratio"], n["ratio"]) or old["tasks"] != new["tasks"]
            for t in tasks:
                so, sn = o["scores"].get(t), n["scores"].get(t)
                same = same and close(so, sn)
                cells.append("—" if so is None else f"{so:.6g} / {sn:.6g}")
            differ += not same
            lines.append(f"| {k[0]} | {k[1]} | {o['ratio']:.4f} / {n['ratio']:.4f} | " + " | ".join(cells) + " |" + ("" if same else " **differs**"))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    print(f"{differ} row(s) differ in a deterministic figure" if differ else "every ratio, error and score agrees (to 1e-9)")
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
