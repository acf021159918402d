#!/usr/bin/env python3
"""Tables from `kvtc-lab eval --records` files: every (prompt, method)
result of every run that wrote to them, so an evaluation spread over
sessions reads as one.

    python3 bench/quality_records.py NAME RECORDS.jsonl [...] [--header FILE] [--notes FILE]

Writes bench/results/NAME.md and NAME.json. The JSON has the shape of
`kvtc-lab eval --out-json` (contexts -> methods -> ratio, scores,
half_width, paired_diff), plus per method and task the prompt count `n`,
so bench/plots.py reads both. --header is markdown put under the title
(command, commit, machine of the runs), --notes markdown put at the end.
--pair A:B (repeatable) adds, per context, the paired difference B − A of
every score over the prompts both methods have (e.g. one option on and off
at the same ratio): what a difference from vanilla cannot resolve when both
sit near it.

Records are grouped by model, calibration, seed, continuation and greedy
settings, which must agree (one evaluation per file set); a record written
twice (an interrupted run resumed) counts once. Scores: mean and 95%
half-width over prompts (normal approximation, as kvtc-lab eval); a
method's paired difference from vanilla uses only the prompts both have.
The whole-cache ratio of a method is the f16 bytes over the stored bytes
summed over all its prompts at that context. For the pass/fail tasks the
report also counts the prompts made worse and better, bounds the share made
worse (per task, and pooled over the tasks), bounds the pooled net change
in the share answered right from below (pooled_pass_fail.net_lower95, in
points), and lists the prompts that differ with each answer.
"""
import argparse
import json
import math
import os
import struct
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import safetensors_meta  # noqa: E402

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(TOP, "bench", "results")
# Columns in this order; a task's scores (code has two).
COLUMNS = [("text", "ppl"), ("text", "kld"), ("text", "agree"), ("niah", "niah"), ("vt", "vt"), ("kvr", "kvr"), ("code", "code"), ("code", "code_es")]
LABEL = {"code": "code (exact)", "code_es": "code (edit sim.)"}


def mean_half(xs):
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, 1.96 * math.sqrt(var / len(xs))


def binom_cdf(k, n, p):
    """P(X <= k), X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def upper95(k, n):
    """One-sided 95% Clopper-Pearson upper bound on a rate seen k times in n:
    the p with P(X <= k | p) = 0.05 (k = 0: 1 - 0.05^(1/n), the rule of three)."""
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if binom_cdf(k, n, mid) > 0.05 else (lo, mid)
    return hi


def wilson(k, n, z):
    """Wilson score interval for a rate seen k times in n, at normal quantile z."""
    p, z2 = k / n, z * z
    c, h = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return c - h, c + h


def paired_lower95(both, worse, better, n):
    """One-sided 95% lower bound on a method's pass rate minus vanilla's over
    n paired prompts (both passed, vanilla only, the method only): Newcombe's
    hybrid score interval for paired proportions (Stat. Med. 17:2635, 1998,
    method 10) at z = 1.645. It stays sensible with few discordant prompts,
    where the normal half-width of (better - worse) / n does not; it bounds
    the net change, which the share made worse (upper95) bounds from above."""
    z = 1.6448536269514722
    neither = n - both - worse - better
    p1, p2 = (both + better) / n, (both + worse) / n  # the method's rate, vanilla's
    l1, _ = wilson(both + better, n, z)
    _, u2 = wilson(both + worse, n, z)
    margins = (both + better) * (worse + neither) * (both + worse) * (better + neither)
    phi = (both * neither - worse * better) / math.sqrt(margins) if margins else 0.0
    d = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    return (p1 - p2) - d


# Pass/fail scores (0 or 100 per prompt): their paired difference also gets
# an exact bound, since a normal half-width is 0 when no prompt differs.
BINARY = {"niah", "kvr", "code"}


def load(paths):
    recs, settings, dup, bad = {}, set(), 0, 0
    for p in paths:
        with open(p) as f:
            for ln, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                    key = (r["method"], r["task"], r["context"], r["index"])
                    setting = (r["model_sha256"], r["calibration_id"], r["seed"], r["continuation"], r["greedy"])
                except (ValueError, KeyError) as e:
                    bad += 1
                    print(f"{p}:{ln}: not a record ({e}); skipped", file=sys.stderr)
                    continue
                settings.add(setting)
                if key in recs:
                    dup += 1
                    continue
                recs[key] = r
    if len(settings) > 1:
        sys.exit("records mix settings (model, calibration, seed, continuation, greedy): " + "; ".join(map(str, sorted(settings))))
    if not recs:
        sys.exit("no records in " + ", ".join(paths))
    return recs, dup, bad


def summarize(recs):
    by_ctx = defaultdict(list)
    for r in recs.values():
        by_ctx[r["context"]].append(r)
    out = []
    for ctx in sorted(by_ctx):
        rs = by_ctx[ctx]
        methods = []
        for r in rs:  # first-seen order, vanilla first
            if r["method"] not in methods:
                methods.append(r["method"])
        # vanilla, kvtc by ratio, then the others as first seen
        seen = list(methods)

        def order(m):
            if m == "vanilla":
                return (0, 0.0)
            if m.startswith("kvtc-") and m[5:-1].replace(".", "", 1).isdigit() and m.endswith("x"):
                return (1, float(m[5:-1]))
            return (2, float(seen.index(m)))
        methods.sort(key=order)
        # scores[method][(task, score)][index] = value
        scores = defaultdict(lambda: defaultdict(dict))
        f16, stored, runs = defaultdict(int), defaultdict(int), set()
        for r in rs:
            f16[r["method"]] += r["f16_bytes"]
            stored[r["method"]] += r["stored_bytes"]
            if "run" in r:
                runs.add(r["run"])
            for s, v in r["scores"].items():
                scores[r["method"]][(r["task"], s)][r["index"]] = v
        prompts = {t: len({r["index"] for r in rs if r["task"] == t}) for t in sorted({r["task"] for r in rs})}  # sorted: a stable JSON
        by_prompt = {(r["method"], r["task"], r["index"]): r for r in rs}
        cj = {"context": ctx, "prompts_per_task": prompts, "runs": sorted(runs), "methods": []}
        ref = scores.get("vanilla", {})
        for m in methods:
            mj = {"name": m, "ratio": f16[m] / stored[m] if stored[m] else None, "scores": {}, "half_width": {}, "paired_diff": {}, "n": {}}
            for task, s in COLUMNS + [("text", "agree_all")]:
                vals = scores[m].get((task, s))
                if not vals:
                    continue
                mean, half = mean_half(list(vals.values()))
                mj["scores"][s], mj["half_width"][s], mj["n"][s] = mean, half, len(vals)
                rv = ref.get((task, s), {})
                common = sorted(set(vals) & set(rv))
                if m != "vanilla" and common:
                    dm, dh = mean_half([vals[i] - rv[i] for i in common])
                    mj["paired_diff"][s] = {"mean": dm, "half_width": dh, "n": len(common)}
                    if s in BINARY:
                        worse = sum(1 for i in common if vals[i] < rv[i])
                        better = sum(1 for i in common if vals[i] > rv[i])
                        both = sum(1 for i in common if vals[i] > 0 and rv[i] > 0)
                        # The loss (worse - better) / n is at most the share made worse.
                        mj["paired_diff"][s].update(worse=worse, better=better, both=both, worse_upper95=100 * upper95(worse, len(common)))
                        # Which prompts differ, with what each answered: what
                        # "find out why" starts from.
                        mj.setdefault("differs", [])
                        for i in common:
                            if vals[i] != rv[i]:
                                mr, vr = by_prompt[(m, task, i)], by_prompt[("vanilla", task, i)]
                                mj["differs"].append({"task": s, "index": i, "id": mr.get("id", ""), "expected": (mr.get("expected") or [""])[0],
                                                      "vanilla": vr.get("output", ""), "method": mr.get("output", ""), "worse": vals[i] < rv[i]})
            # Pooled over the pass/fail tasks: every prompt one trial. A
            # bound on the share of prompts made worse over this task mix,
            # tighter than any one task's (3 x 100 prompts, none worse: 1.0
            # point where each task alone says 3.0).
            tasks = [s for s in ("niah", "kvr", "code") if "worse" in mj["paired_diff"].get(s, {})]  # BINARY, in column order
            ds = [mj["paired_diff"][s] for s in tasks]
            if len(ds) > 1:
                n, worse, better = sum(d["n"] for d in ds), sum(d["worse"] for d in ds), sum(d["better"] for d in ds)
                both = sum(d["both"] for d in ds)
                mj["pooled_pass_fail"] = {"tasks": tasks, "n": n, "worse": worse, "better": better, "both": both, "mean": 100 * (better - worse) / n,
                                          "worse_upper95": 100 * upper95(worse, n), "net_lower95": 100 * paired_lower95(both, worse, better, n)}
            cj["methods"].append(mj)
        out.append(cj)
    return out


def paired(recs, pairs):
    """Per context (and pooled over contexts: key "all"), for each (a, b)
    of pairs: b − a per score over the prompts both have (mean, 95%
    half-width, n; pass/fail: worse / better counts and the bound on the
    share b made worse), plus for kld the mean of b / a − 1 (relative)."""
    out = defaultdict(list)
    for a, b in pairs:
        for ctx in sorted({r["context"] for r in recs.values()}) + ["all"]:
            va, vb = defaultdict(dict), defaultdict(dict)
            for r in recs.values():
                if (ctx == "all" or r["context"] == ctx) and r["method"] in (a, b):
                    for s, v in r["scores"].items():
                        (va if r["method"] == a else vb)[(r["task"], s)][(r["context"], r["index"])] = v
            pj = {"a": a, "b": b, "diff": {}}
            for task, s in COLUMNS + [("text", "agree_all")]:
                common = sorted(set(va.get((task, s), {})) & set(vb.get((task, s), {})))
                if not common:
                    continue
                d = [vb[(task, s)][i] - va[(task, s)][i] for i in common]
                m, h = mean_half(d)
                pj["diff"][s] = {"mean": m, "half_width": h, "n": len(common)}
                if s == "kld" and all(va[(task, s)][i] > 0 for i in common):
                    rm, rh = mean_half([vb[(task, s)][i] / va[(task, s)][i] - 1 for i in common])
                    pj["diff"][s].update(relative_mean=rm, relative_half_width=rh, higher=sum(1 for x in d if x > 0))
                if s in BINARY:
                    worse = sum(1 for x in d if x < 0)
                    pj["diff"][s].update(worse=worse, better=sum(1 for x in d if x > 0), worse_upper95=100 * upper95(worse, len(common)))
            if pj["diff"]:
                out[ctx].append(pj)
    return out


def pair_markdown(cj):
    L = []
    for pj in cj.get("pairs", []):
        if not L:
            where = "pooled over every context" if cj["context"] == "all" else f"at {cj['context']} tokens"
            L += [f"Paired differences {where} (second method minus first, prompt by prompt; ± 95% half-width):", ""]
        cells = []
        for s, d in pj["diff"].items():
            if s == "agree_all":
                continue
            c = f"{LABEL.get(s, s)} {d['mean']:+.3g}" + (f" ± {d['half_width']:.2g}" if d["half_width"] is not None else "") + f" (n {d['n']}"
            if "worse" in d:
                c += f"; worse on {d['worse']}, better on {d['better']}; loss ≤ {d['worse_upper95']:.1f}"
            if "relative_mean" in d:
                rh = d["relative_half_width"]
                c += f"; {100 * d['relative_mean']:+.1f}%" + (f" ± {100 * rh:.1f}%" if rh is not None else "") + f" of the first's, higher on {d['higher']}"
            cells.append(c + ")")
        L.append(f"- {pj['b']} − {pj['a']}: " + "; ".join(cells))
    return L + [""] if L else []


def fmt(v, h, s):
    if v is None:
        return "–"
    if s in ("ppl", "kld"):
        return f"{v:.4g}" + (f" ± {h:.2g}" if h is not None else "")
    return f"{v:.1f}" + (f" ± {h:.1f}" if h is not None else "")


def markdown(name, contexts, header, notes, dup, pooled_pairs=None):
    L = [f"# kvtc quality: {name}", ""]
    if header:
        L += [header.rstrip(), ""]
    L += ["Each cell: mean ± 95% half-width over the prompts (n), and for every method but vanilla",
          "[Δ paired difference from vanilla ± its half-width]. Scores in percent except ppl (perplexity of",
          "the continuation) and kld (nats per token); agree = greedy tokens equal to vanilla's before the first difference.",
          "For pass/fail tasks (niah, kvr, code exact) the bracket also counts the prompts the method got wrong where vanilla",
          "was right (worse) and the reverse (better), and bounds the loss by the one-sided 95% Clopper-Pearson upper bound",
          "on the share made worse (with none worse: 1 − 0.05^(1/n), about 300/n points) — a normal half-width is 0 when no prompt differs.",
          f"Ratio: f16 K+V bytes of the whole cache over the bytes at rest, summed over every prompt of the method."
          + (f" {dup} duplicate records (resumed runs) counted once." if dup else ""), ""]
    for cj in contexts:
        cols = [s for _, s in COLUMNS if any(s in m["scores"] for m in cj["methods"])]
        counts = ", ".join(f"{t}: {n}" for t, n in sorted(cj["prompts_per_task"].items()))
        runs = "; ".join(cj["runs"]) or "not recorded"
        L += [f"## context {cj['context']} tokens", "", f"Prompts per task: {counts}. Written by: {runs}.", "",
              "| method | ratio (whole cache) | " + " | ".join(LABEL.get(c, c) for c in cols) + " |",
              "|---|---|" + "---|" * len(cols)]
        for m in cj["methods"]:
            cells = []
            for c in cols:
                if c not in m["scores"]:
                    cells.append("(lossless)" if not m["scores"] else "–")
                    continue
                cell = fmt(m["scores"][c], m["half_width"][c], c) + f" (n {m['n'][c]})"
                if c == "agree" and "agree_all" in m["scores"]:
                    cell += f" (all: {100 * m['scores']['agree_all']:.0f}%)"
                d = m["paired_diff"].get(c)
                if d and c != "kld":
                    cell += f" [Δ {d['mean']:+.3g}" + (f" ± {d['half_width']:.2g}" if d["half_width"] is not None else "")
                    if "worse" in d:
                        cell += f"; worse on {d['worse']}, better on {d['better']}; loss ≤ {d['worse_upper95']:.1f} (95%)"
                    cell += "]"
                cells.append(cell)
            ratio = f"{m['ratio']:.2f}x" if m["ratio"] else "–"
            L.append(f"| {m['name']} | {ratio} | " + " | ".join(cells) + " |")
        L.append("")
        pooled = [m for m in cj["methods"] if "pooled_pass_fail" in m]
        if pooled:
            L += [f"Pooled over the pass/fail tasks at {cj['context']} tokens (each prompt of each task one trial; bounds on the share of",
                  "prompts made worse and on the net change in the share answered right, over this mix of tasks, not on any one task;",
                  "both one-sided 95%: Clopper-Pearson for the first, Newcombe's paired score interval for the second):", ""]
            for m in pooled:
                d = m["pooled_pass_fail"]
                L.append(f"- {m['name']} ({'+'.join(d['tasks'])}): {d['n']} prompts, worse on {d['worse']}, better on {d['better']} "
                         f"(Δ {d['mean']:+.2f} points); share made worse ≤ {d['worse_upper95']:.1f} points, net change ≥ {d['net_lower95']:+.1f} points")
            L.append("")
        L += pair_markdown(cj)
        L += differences(cj)
    if pooled_pairs:
        L += pair_markdown({"context": "all", "pairs": pooled_pairs})
    if notes:
        L += [notes.rstrip(), ""]
    return "\n".join(L)


# A method whose pass/fail differs from vanilla on more prompts than this
# (q4_0 on Qwen: all of them) gets a count, not a list.
MAX_LISTED = 12


def differences(cj):
    """Markdown: for pass/fail tasks, each prompt a method answered
    differently from vanilla (right where vanilla was wrong, or the reverse)."""
    def q(text):
        text = text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'")
        return "`" + (text[:60] + "…" if len(text) > 60 else text) + "`"
    rows, skipped = [], []
    for m in cj["methods"]:
        d = m.get("differs", [])
        if len(d) > MAX_LISTED:
            skipped.append(f"{m['name']} ({len(d)})")
            continue
        for x in d:
            rows.append(f"| {m['name']} | {x['task']} {x['index']}: {x['id']} | {'worse' if x['worse'] else 'better'} | {q(x['expected'])} | {q(x['vanilla'])} | {q(x['method'])} |")
    if not rows and not skipped:
        return []
    L = [f"Prompts where a method's pass/fail differs from vanilla's at {cj['context']} tokens (outputs cut at 60 characters; ⏎ = newline):", ""]
    if rows:
        L += ["| method | prompt | | expected | vanilla | method |", "|---|---|---|---|---|---|"] + rows + [""]
    if skipped:
        L += [f"Not listed (more than {MAX_LISTED} prompts differ): " + ", ".join(skipped) + ".", ""]
    return L


def check_calib(cal, recs):
    """Exits naming both ids when the records (one setting, as load checked)
    were made with another calibration than the file cal."""
    try:
        cid = safetensors_meta(cal)["calibration_id"]
    except (OSError, ValueError, KeyError, struct.error) as e:
        sys.exit(f"{cal}: no calibration_id in its header ({e})")
    rid = next(iter(recs.values()))["calibration_id"]
    if cid != rid:
        sys.exit(f"{cal} has calibration_id {cid[:16]}…, but the records were made with {rid[:16]}…: a run would start a second "
                 "set the report cannot merge. Use the calibration they were made with (KVTC_QWEN_CALIB=FILE), or move the "
                 "records aside to start anew.")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("records", nargs="+")
    ap.add_argument("--header")
    ap.add_argument("--notes")
    ap.add_argument("--results", default=RES)
    ap.add_argument("--pair", action="append", default=[], metavar="A:B", help="also the paired difference B - A per context")
    ap.add_argument("--check-calib", metavar="CAL", help="only check that the records were made with calibration CAL (exit 1 if not)")
    a = ap.parse_args()
    recs, dup, bad = load(a.records)
    if a.check_calib:
        check_calib(a.check_calib, recs)
        return
    contexts = summarize(recs)
    pairs = []
    for x in a.pair:
        if x.count(":") != 1 or "" in x.split(":"):
            sys.exit(f"--pair {x}: METHOD_A:METHOD_B expected")
        pairs.append(tuple(x.split(":")))
    pooled_pairs = []
    for ctx, pjs in paired(recs, pairs).items():
        if ctx == "all":
            pooled_pairs = pjs if len(contexts) > 1 else []
        for cj in contexts:
            if cj["context"] == ctx:
                cj["pairs"] = pjs
    any_rec = next(iter(recs.values()))
    result = {"records": [os.path.relpath(p, TOP) for p in a.records], "model_sha256": any_rec["model_sha256"],
              "calibration_id": any_rec["calibration_id"], "seed": any_rec["seed"], "continuation_tokens": any_rec["continuation"],
              "greedy_tokens": any_rec["greedy"], "records_counted": len(recs), "duplicates": dup, "unreadable_lines": bad, "contexts": contexts}
    if pooled_pairs:
        result["pairs_pooled"] = pooled_pairs
    header = open(a.header).read() if a.header else ""
    notes = open(a.notes).read() if a.notes else ""
    os.makedirs(a.results, exist_ok=True)
    for ext, text in (("json", json.dumps(result, indent=1) + "\n"), ("md", markdown(a.name, contexts, header, notes, dup, pooled_pairs) + "\n")):
        path = os.path.join(a.results, f"{a.name}.{ext}")
        with open(path + ".part", "w") as f:
            f.write(text)
        os.replace(path + ".part", path)
    print(f"wrote {os.path.join(a.results, a.name)}.md and .json ({len(recs)} records)")


if __name__ == "__main__":
    main()
