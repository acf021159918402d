#!/usr/bin/env python3
"""The figures of bench/results, drawn with matplotlib from the JSON the
tools write.

    python3 bench/plots.py analyze DIR
        DIR/analyze.json (`kvtc-lab analyze`) -> the PNGs it names, in DIR:
        procrustes.png, calib_size.png, position.png, domain.png (those of
        the analyses the JSON holds)
    python3 bench/plots.py bits RATIO_JSON OUT_DIR
        ratio.json (bench/ratio.py) -> OUT_DIR/bits_per_component_keys.png
        and OUT_DIR/bits_per_component_values.png (the paper's Figure 6)
    python3 bench/plots.py tradeoff OUT_PNG LABEL=JSON@CONTEXT ...
        quality JSONs (kvtc-lab eval, bench/quality_records.py) -> OUT_PNG:
        whole-cache ratio (log) against KL and each task's score, one line
        per method family, one row per JSON
    python3 bench/plots.py entropy OUT_PNG LABEL=JSON ...
        bench/entropy.py JSONs -> OUT_PNG: relative error against ratio on
        coded tokens, DP + DEFLATE and the entropy-coded mode, per kind

Each PNG is written to a temporary file beside it and renamed into place;
the paths written are printed. A missing JSON file, or one without what a
figure needs, is an error (exit status 1) naming what is missing.

Needs matplotlib (Debian 12: python3-matplotlib, which scripts/bootstrap.sh
installs). When the interpreter running this script cannot import it, as a
pyenv or venv python3 ahead of Debian's on PATH, the script runs itself again
with /usr/bin/python3, where the Debian package lives.
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import debian_python  # noqa: E402

DPI = 100
KEY_COLOR, VALUE_COLOR = "C0", "C1"


class PlotError(Exception):
    pass


# ---- matplotlib, from this interpreter or Debian's -------------------------------


def import_matplotlib():
    """matplotlib with the Agg backend, from this interpreter or Debian's
    (bench/debian_python.py)."""
    try:
        matplotlib = debian_python.require("matplotlib", "python3-matplotlib", __file__)
    except debian_python.Missing as e:
        raise PlotError(str(e)) from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib import ticker
    return Figure, ticker


# ---- JSON access with errors that say what is missing ------------------------------


def load_json(path):
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise PlotError(f"{path}: not readable JSON ({e})") from None


def need(obj, path, where):
    """obj[k1][k2]... for path 'k1.k2', or PlotError naming the missing key."""
    cur = obj
    done = []
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            raise PlotError(f"{where}: no '{'.'.join(done + [k])}'")
        cur = cur[k]
        done.append(k)
    return cur


def number(x, what):
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise PlotError(f"{what}: not a number: {x!r}") from None
    if not math.isfinite(v):
        raise PlotError(f"{what}: not finite: {x!r}")
    return v


def matrix(m, what):
    if not isinstance(m, list) or not m or not all(isinstance(r, list) and len(r) == len(m[0]) for r in m):
        raise PlotError(f"{what}: not a non-empty rectangular matrix")
    return [[number(v, what) for v in r] for r in m]


def ratio_label(r):
    return f"{r:g}x"


def tokens_label(n):
    if n >= 1000:
        return f"{n / 1000:.0f}K" if n % 1000 == 0 else f"{n / 1000:.1f}K"
    return f"{n:.0f}"


# ---- output ----------------------------------------------------------------------


def check_name(name, where):
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise PlotError(f"{where}: image {name!r} is not a plain file name")
    return name


def save(fig, out_dir, name):
    check_name(name, out_dir)
    path = os.path.join(out_dir, name)
    tmp = os.path.join(out_dir, f".{name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(path)
    return path


def heatmap(fig, ax, m, vmin, vmax, cmap="viridis"):
    im = ax.imshow(m, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest", aspect="equal")
    fig.colorbar(im, ax=ax, shrink=0.9, pad=0.02)
    return im


# ---- analyze.json -------------------------------------------------------------------


def fig_procrustes(mpl, res, where):
    Figure, ticker = mpl
    p = need(res, "procrustes", where)
    w = where + ": procrustes"
    mats = {(kind, when): matrix(need(p, f"{kind}.{when}", w), f"{w}.{kind}.{when}")
            for kind in ("keys", "values") for when in ("before", "after")}
    n = len(mats[("keys", "before")])
    if any(len(m) != n or len(m[0]) != n for m in mats.values()):
        raise PlotError(f"{w}: the four matrices are not all {n} x {n}")
    n_head_kv = int(number(p.get("n_head_kv", 1), f"{w}.n_head_kv")) or 1
    n_layer = int(number(p.get("n_layer", n // n_head_kv), f"{w}.n_layer"))
    if n_layer * n_head_kv != n:  # geometry unknown or inconsistent: number the heads
        n_head_kv, n_layer = 1, n
    every = 5 if n_layer > 12 else 1
    ticks = [l * n_head_kv for l in range(0, n_layer, every)]
    labels = [f"L{l}" for l in range(0, n_layer, every)]
    lo = min(0.0, min(min(r) for m in mats.values() for r in m))
    lo = math.floor(lo * 10) / 10
    tokens = p.get("tokens")
    fig = Figure(figsize=(13, 11.6), layout="constrained")
    fig.suptitle("Head-pair cosine similarity" + (f" ({tokens} tokens)" if tokens else "")
                 + ", before and after orthogonal Procrustes alignment", fontsize=15)
    axes = fig.subplots(2, 2)
    panels = [("keys", "before", "keys (RoPE removed), before"), ("keys", "after", "keys (RoPE removed), after"),
              ("values", "before", "values, before"), ("values", "after", "values, after")]
    for ax, (kind, when, title) in zip(axes.flat, panels):
        mean = p[kind].get(f"mean_offdiag_{when}")
        sub = f"\nmean over pairs of different heads: {mean:.4f}" if isinstance(mean, (int, float)) else ""
        heatmap(fig, ax, mats[(kind, when)], lo, 1.0)
        ax.set_title(title + sub, fontsize=12)
        ax.set_xticks(ticks, labels)
        ax.set_yticks(ticks, labels)
        ax.set_xlabel(f"head (layer-major, {n_head_kv} per layer)" if n_head_kv > 1 else "head")
        ax.set_ylabel(f"head (layer-major, {n_head_kv} per layer)" if n_head_kv > 1 else "head")
    return fig


def fig_calib_size(mpl, res, where):
    Figure, ticker = mpl
    w = where + ": calib_size"
    pts = need(res, "calib_size.points", where)
    if not isinstance(pts, list) or not pts:
        raise PlotError(f"{w}.points: empty")
    rows = []
    for i, pt in enumerate(pts):
        if not isinstance(pt, dict):
            raise PlotError(f"{w}.points[{i}]: not an object")
        tokens = number(need(pt, "calib_tokens", f"{w}.points[{i}]"), f"{w}.points[{i}].calib_tokens")
        if tokens <= 0:
            raise PlotError(f"{w}.points[{i}].calib_tokens: {tokens:g}, not a token count for a log axis")
        k = number(need(pt, "k", f"{w}.points[{i}]"), f"{w}.points[{i}].k")
        v = number(need(pt, "v", f"{w}.points[{i}]"), f"{w}.points[{i}].v")
        if k <= 0 or v <= 0:
            raise PlotError(f"{w}.points[{i}]: errors must be positive for a log axis")
        rows.append((tokens, k, v))
    rows.sort()
    x = [r[0] for r in rows]
    fig = Figure(figsize=(9, 6), layout="constrained")
    ax = fig.subplots()
    ax.plot(x, [r[1] for r in rows], "s-", color=KEY_COLOR, label="keys")
    ax.plot(x, [r[2] for r in rows], "s-", color=VALUE_COLOR, label="values")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(ticker.FixedLocator(x))
    ax.xaxis.set_major_formatter(ticker.FixedFormatter([tokens_label(t) for t in x]))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    if len(x) == 1:
        ax.set_xlim(x[0] / 2, x[0] * 2)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
        lambda y, _: f"{y:g}" if f"{y:.0e}"[0] in "25" else ""))
    ax.set_title(f"Reconstruction error at {ratio_label(res.get('ratio', 16))} vs calibration tokens")
    ax.set_xlabel("calibration tokens (log scale)")
    ax.set_ylabel("relative squared error (log scale)")
    ax.grid(True, which="both", color="0.9")
    ax.legend()
    return fig


def fig_position(mpl, res, where):
    Figure, ticker = mpl
    w = where + ": position"
    p = need(res, "position", where)
    buckets = need(p, "buckets", w)
    if not isinstance(buckets, list) or not buckets:
        raise PlotError(f"{w}.buckets: empty")
    x, k, v = [], [], []
    for i, b in enumerate(buckets):
        wb = f"{w}.buckets[{i}]"
        x.append(0.5 * (number(need(b, "from", wb), wb + ".from") + number(need(b, "to", wb), wb + ".to")))
        k.append(number(need(b, "k", wb), wb + ".k"))
        v.append(number(need(b, "v", wb), wb + ".v"))
    context = p.get("context")
    bucket = p.get("bucket")
    fig = Figure(figsize=(9, 6), layout="constrained")
    ax = fig.subplots()
    ax.plot(x, k, "s-", color=KEY_COLOR, markersize=4, label="keys")
    ax.plot(x, v, "s-", color=VALUE_COLOR, markersize=4, label="values")
    window = res.get("window")
    if isinstance(context, (int, float)) and isinstance(window, (int, float)) and 0 < window < context:
        ax.axvspan(context - window, context, color="0.92", zorder=0, label=f"last {window:g} tokens, stored raw")
    ax.set_xlim(0, context if isinstance(context, (int, float)) and context > 0 else None)
    ax.set_ylim(bottom=0, top=max(k + v) * 1.25 or 1)
    ax.set_title(f"Reconstruction error at {ratio_label(res.get('ratio', 16))} vs token position")
    ax.set_xlabel("token position (bucket centre" + (f"; {bucket}-token buckets)" if bucket else ")"))
    ax.set_ylabel("relative squared error")
    ax.grid(True, color="0.9")
    ax.legend(loc="upper left")
    return fig


def fig_domain(mpl, res, where):
    Figure, ticker = mpl
    w = where + ": domain"
    d = need(res, "domain", where)
    kinds = need(d, "eval_kinds", w)
    rows = need(d, "rows", w)
    if not isinstance(kinds, list) or not kinds or not isinstance(rows, list) or not rows:
        raise PlotError(f"{w}: empty eval_kinds or rows")
    names = [str(need(r, "calib", f"{w}.rows[{i}]")) for i, r in enumerate(rows)]
    fig = Figure(figsize=(13, 2.0 + 0.62 * len(rows)), layout="constrained")
    fig.suptitle(f"Relative squared error at {ratio_label(res.get('ratio', 16))}: "
                 "calibration kind (rows) x evaluation kind (columns)", fontsize=14)
    axes = fig.subplots(1, 2)
    for ax, (key, title) in zip(axes, (("k", "keys"), ("v", "values"))):
        m = matrix([need(r, key, f"{w}.rows[{i}]") for i, r in enumerate(rows)], f"{w}.rows[].{key}")
        if len(m[0]) != len(kinds):
            raise PlotError(f"{w}.rows[].{key}: {len(m[0])} columns for {len(kinds)} eval_kinds")
        lo, hi = min(min(r) for r in m), max(max(r) for r in m)
        im = heatmap(fig, ax, m, lo, hi if hi > lo else lo + 1)
        ax.set_aspect("auto")
        for i, r in enumerate(m):
            for j, val in enumerate(r):
                rgb = im.cmap(im.norm(val))[:3]
                lum = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
                ax.text(j, i, f"{val:.4f}", ha="center", va="center", fontsize=11, color="black" if lum > 0.5 else "white")
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("evaluation")
        ax.set_ylabel("calibration")
        ax.set_title(title, fontsize=13)
    return fig


ANALYZE_FIGURES = (  # JSON section, default image name, drawer
    ("procrustes", "procrustes.png", fig_procrustes),
    ("calib_size", "calib_size.png", fig_calib_size),
    ("position", "position.png", fig_position),
    ("domain", "domain.png", fig_domain),
)


def cmd_analyze(out_dir):
    path = os.path.join(out_dir, "analyze.json")
    res = load_json(path)
    if not isinstance(res, dict):
        raise PlotError(f"{path}: not a JSON object")
    analyses = need(res, "analyses", path)
    if not isinstance(analyses, list):
        raise PlotError(f"{path}: 'analyses' is not a list")
    for sec, _, _ in ANALYZE_FIGURES:  # an analysis that ran has its section
        if sec.replace("_", "-") in analyses and sec not in res:
            raise PlotError(f"{path}: no '{sec}', though 'analyses' names {sec.replace('_', '-')}")
    todo = [(sec, check_name(res[sec].get("image", name) if isinstance(res[sec], dict) else name, f"{path}: {sec}"), draw)
            for sec, name, draw in ANALYZE_FIGURES if sec in res]
    if not todo:
        print(f"{path}: no figure to draw (analyses: {', '.join(map(str, analyses)) or 'none'})", file=sys.stderr)
        return []
    mpl = import_matplotlib()
    figs = [(name, draw(mpl, res, path)) for sec, name, draw in todo]  # check all before writing any
    return [save(fig, out_dir, name) for name, fig in figs]


# ---- ratio.json: bits per component --------------------------------------------------


def bit_steps(runs, what):
    """[(from, to, bits)] of a ratio's runs, sorted."""
    if not isinstance(runs, list):
        raise PlotError(f"{what}: not a list of runs")
    out = []
    for i, r in enumerate(runs):
        wr = f"{what}[{i}]"
        a, b = int(number(need(r, "from", wr), wr + ".from")), int(number(need(r, "to", wr), wr + ".to"))
        bits = number(need(r, "bits_per_component", wr), wr + ".bits_per_component")
        if not 0 <= a < b:
            raise PlotError(f"{wr}: from {a} to {b} is not a run of components")
        out.append((a, b, bits))
    return sorted(out)


def fig_bits(mpl, res, kind, where):
    Figure, ticker = mpl
    w = f"{where}: bits_per_component.{kind}"
    b = need(res, f"bits_per_component.{kind}", where)
    ratios = need(b, "ratios", w)
    if not isinstance(ratios, dict) or not ratios:
        raise PlotError(f"{w}.ratios: empty")
    series = sorted(((number(r, f"{w}.ratios key"), bit_steps(runs, f"{w}.ratios.{r}")) for r, runs in ratios.items()))
    components = b.get("components")
    used = max((s[-1][1] for _, s in series if s), default=1)
    x_max = max(64, int(used * 1.1))
    if isinstance(components, int) and components > 0:
        x_max = min(x_max, components)
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    # Thicker lines under thinner ones, so that runs two ratios share stay visible.
    widths = [1.4 + 0.9 * (len(series) - 1 - i) for i in range(len(series))]
    for i, ((r, steps), lw) in enumerate(zip(series, widths)):
        xs, ys, pos = [], [], 0
        for a, e, bits in steps:
            if a > pos:
                xs += [pos, a]
                ys += [0, 0]
            xs += [a, e]
            ys += [bits, bits]
            pos = e
        if pos < x_max:
            xs += [pos, x_max]
            ys += [0, 0]
        coded = sum(e - a for a, e, bits in steps if bits > 0)
        ax.plot(xs, ys, color=f"C{i}", lw=lw, solid_joinstyle="miter",
                label=f"{ratio_label(r)}: {coded} components coded")
    ax.set_xlim(0, x_max)
    ax.set_ylim(-0.3, 8.6)
    ax.set_yticks([0, 2, 4, 8], ["0 (dropped)", "2 (int2)", "4 (int4)", "8 (fp8)"])
    ax.set_xlabel("principal component (by decreasing variance)")
    ax.set_ylabel("code bits per component")
    ax.set_title(f"Bits per component, {kind} (the calibration's DP tables)")
    ax.grid(True, color="0.9")
    ax.legend(title="nominal ratio", loc="upper right")
    return fig


def cmd_bits(ratio_json, out_dir):
    res = load_json(ratio_json)
    if not isinstance(res, dict):
        raise PlotError(f"{ratio_json}: not a JSON object")
    if "bits_per_component" not in res:
        raise PlotError(f"{ratio_json}: no 'bits_per_component' (the calibration's DP tables; "
                        "bench/ratio.py writes them: rerun it)")
    if not os.path.isdir(out_dir):
        raise PlotError(f"{out_dir}: no such directory")
    mpl = import_matplotlib()
    figs = [(f"bits_per_component_{kind}.png", fig_bits(mpl, res, kind, ratio_json)) for kind in ("keys", "values")]
    return [save(fig, out_dir, name) for name, fig in figs]


# ---- quality JSON: ratio against quality, one line per method family ---------------

# Method families of `kvtc-lab eval` (lab/methods.cpp) drawn as lines;
# ablations (kvtc-16x@name, -all, -joint, one-sided q4_0) and the lossless
# codecs (no scores) are left out.
FAMILIES = [
    ("kvtc", r"kvtc-\d+(\.\d+)?x", "C0", "o"),
    ("KIVI", r"kivi-\d", "C1", "s"),
    ("fp8 (E4M3)", r"fp8", "C2", "D"),
    ("llama.cpp cache q8_0 / q4_0", r"q(8|4)_0", "C3", "^"),
    ("StreamingLLM", r"streaming-.*", "C4", "v"),
    ("per-prompt SVD", r"svd-.*", "C5", "P"),
]
TRADEOFF_METRICS = [("kld", "KL from vanilla (nats/token)"), ("niah", "needle (%)"), ("vt", "variable tracking (%)"),
                    ("kvr", "key-value retrieval (%)"), ("code", "code next line, exact (%)"), ("code_es", "code next line, edit sim. (%)")]


def tradeoff_series(res, ctx, where):
    """{metric: {"vanilla": (y, n), family: [(ratio, y, n, half_width)]}} of one context of a quality JSON."""
    import re
    cs = [c for c in need(res, "contexts", where) if c.get("context") == ctx]
    if not cs:
        raise PlotError(f"{where}: no context {ctx} (has {[c.get('context') for c in res['contexts']]})")
    out = {}
    methods = need(cs[0], "methods", f"{where}: context {ctx}")
    vanilla = next((m.get("scores") or {} for m in methods if m.get("name") == "vanilla"), {})
    for m in methods:
        name, ratio, scores = m.get("name"), m.get("ratio"), m.get("scores") or {}
        for metric, _ in TRADEOFF_METRICS:
            if metric not in scores:
                continue
            y = number(scores[metric], f"{where}: {name}.scores.{metric}")
            n = (m.get("n") or {}).get(metric, cs[0].get("samples"))  # eval JSON: one count per task
            h = (m.get("half_width") or {}).get(metric) or 0
            pd = (m.get("paired_diff") or {}).get(metric)
            if metric != "kld" and pd and metric in vanilla:
                # Records with prompt counts that differ by method (100 for
                # some, 2 for others): a method's own mean is over its own
                # prompts, so plot vanilla's mean plus the paired difference
                # on the prompts both have, with that difference's half-width.
                # Clamped to the score's 0-100 range (vanilla 94 and every prompt lost: 0, not -6).
                y = min(100.0, max(0.0, number(vanilla[metric], f"{where}: vanilla.scores.{metric}") + number(pd["mean"], f"{where}: {name}.paired_diff")))
                h = pd.get("half_width") or 0
            d = out.setdefault(metric, {})
            if name == "vanilla":
                d["vanilla"] = (y, n)
                continue
            for fam, pat, _, _ in FAMILIES:
                if re.fullmatch(pat, name):
                    d.setdefault(fam, []).append((number(ratio, f"{where}: {name}.ratio"), y, n, h))
    return out


def fig_tradeoff(mpl, panels):
    """panels: [(label, series)] (one row per model); columns: the metrics any has."""
    Figure, ticker = mpl
    metrics = [(k, t) for k, t in TRADEOFF_METRICS if any(k in s for _, s in panels)]
    fig = Figure(figsize=(3.3 * len(metrics), 3.0 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), len(metrics), squeeze=False)
    for r, (label, series) in enumerate(panels):
        for c, (metric, title) in enumerate(metrics):
            ax = axes[r][c]
            ax.set_xscale("log")
            ax.grid(True, color="0.9")
            d = series.get(metric)
            if not d:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="0.5")
            else:
                if "vanilla" in d and metric != "kld":
                    ax.axhline(d["vanilla"][0], color="k", ls="--", lw=1, label="vanilla (1x)")
                for fam, _, color, marker in FAMILIES:
                    pts = sorted(d.get(fam, []))
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, ms=5, lw=1.5, label=fam)
                        if metric != "kld":  # 95% half-widths: of the paired difference where records give one, else over prompts
                            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[3] for p in pts], fmt="none", ecolor=color,
                                        elinewidth=0.8, capsize=2, alpha=0.6)
                if metric == "kld":
                    ax.set_yscale("log")
                else:  # the whole percent scale: small differences look small
                    ax.set_ylim(-3, 105)
                ns = sorted({p[2] for v in d.values() if isinstance(v, list) for p in v if p[2]})
                if ns:
                    ax.text(0.02, 0.02, "n = " + (f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}–{ns[-1]}") + " prompts",
                            transform=ax.transAxes, fontsize=7, color="0.4")
            ax.set_xlim(1.5, 80)
            ax.xaxis.set_major_locator(ticker.FixedLocator([2, 4, 8, 16, 32, 64]))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_title(title, fontsize=9)
            if c == 0:
                ax.set_ylabel(label, fontsize=9)
            if r == len(panels) - 1:
                ax.set_xlabel("whole-cache ratio (log)", fontsize=8)
    handles = {}
    for row in axes:
        for ax in row:
            for h, l in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(l, h)
    # Beside the top-right panel (Debian 12's matplotlib 3.6 has no "outside" figure legends).
    axes[0][-1].legend(list(handles.values()), list(handles.keys()), loc="upper left", bbox_to_anchor=(1.03, 1.0), fontsize=8)
    return fig


def cmd_tradeoff(out_png, specs):
    """specs: LABEL=JSON@CONTEXT, one row each."""
    panels = []
    for spec in specs:
        if "=" not in spec or "@" not in spec.split("=", 1)[1]:
            raise PlotError(f"{spec}: expected LABEL=JSON@CONTEXT")
        label, rest = spec.split("=", 1)
        path, ctx = rest.rsplit("@", 1)
        res = load_json(path)
        panels.append((f"{label}\n{int(ctx) // 1024}K context", tradeoff_series(res, int(ctx), path)))
    out_dir, name = os.path.split(out_png)
    check_name(name, out_png)
    mpl = import_matplotlib()
    return [save(fig_tradeoff(mpl, panels), out_dir or ".", name)]


def fig_entropy(mpl, runs):
    """runs: [(label, entropy JSON)]; one row per model, columns keys and
    values: relative error (log) against the ratio on coded tokens (log),
    DP + DEFLATE and each ecsq variant."""
    Figure, ticker = mpl
    fig = Figure(figsize=(7.2, 3.0 * len(runs) + 0.4), layout="constrained")
    axes = fig.subplots(len(runs), 2, squeeze=False)
    styles = {"dp": ("tab:blue", "o", "DP + DEFLATE (v1)"), "ecsq": ("tab:red", "s", "ecsq + rANS (v2), rounding 0.35")}
    extra = ["tab:orange", "tab:green", "tab:purple"]
    for r, (label, res) in enumerate(runs):
        pooled = need(res, "pooled", label)
        variants = sorted({p["variant"] for p in pooled}, key=lambda v: (v not in ("dp", "ecsq"), v != "dp", v))
        for kv, title in ((0, "keys"), (1, "values")):
            ax = axes[r][kv]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, color="0.9")
            for i, v in enumerate(variants):
                label_v = "ecsq, rounding 0.5" if v == "r50" else f"ecsq {v}"
                color, marker, name = styles.get(v, (extra[i % len(extra)], "^", label_v))
                pts = sorted((number(p["ratio"][kv], f"{label}: ratio"), number(p["err"][kv], f"{label}: err")) for p in pooled if p["variant"] == v)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, ms=4, lw=1.3, label=name)
            ax.xaxis.set_major_locator(ticker.FixedLocator([8, 16, 32, 64, 128]))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_title(f"{label}: {title}", fontsize=9)
            ax.set_xlabel("ratio on coded tokens (log)", fontsize=8)
            if kv == 0:
                ax.set_ylabel("relative squared error (log)", fontsize=8)
    axes[0][1].legend(fontsize=7, loc="lower right")
    return fig


def cmd_entropy(out_png, specs):
    """specs: LABEL=JSON (bench/entropy.py), one row each."""
    runs = []
    for spec in specs:
        if "=" not in spec:
            raise PlotError(f"{spec}: expected LABEL=JSON")
        label, path = spec.split("=", 1)
        runs.append((label, load_json(path)))
    out_dir, name = os.path.split(out_png)
    check_name(name, out_png)
    return [save(fig_entropy(import_matplotlib(), runs), out_dir or ".", name)]


USAGE = """usage: plots.py analyze DIR                 figures of DIR/analyze.json, into DIR
       plots.py bits RATIO_JSON OUT_DIR      bits_per_component_{keys,values}.png from ratio.json
       plots.py tradeoff OUT_PNG LABEL=JSON@CONTEXT ...
                                             whole-cache ratio against KL and task scores, one line per
                                             method family, one row per quality JSON (eval or
                                             quality_records.py) at that context
       plots.py entropy OUT_PNG LABEL=JSON ...
                                             error against ratio, DP + DEFLATE and the entropy-coded
                                             mode, keys and values, one row per bench/entropy.py JSON"""


def main(argv):
    if len(argv) >= 1 and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        if len(argv) == 2 and argv[0] == "analyze":
            if not os.path.isdir(argv[1]):
                raise PlotError(f"{argv[1]}: no such directory")
            cmd_analyze(argv[1])
        elif len(argv) == 3 and argv[0] == "bits":
            cmd_bits(argv[1], argv[2])
        elif len(argv) >= 3 and argv[0] == "tradeoff":
            cmd_tradeoff(argv[1], argv[2:])
        elif len(argv) >= 3 and argv[0] == "entropy":
            cmd_entropy(argv[1], argv[2:])
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except PlotError as e:
        print(f"plots.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
