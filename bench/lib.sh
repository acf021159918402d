# Shared by the bench/*.sh wrappers: what every committed result names.
# Source it after setting $top (repository root); it sets $kvtc and $lab
# (the binaries) and $res (bench/results).
kvtc="$top/build/kvtc"
lab="$top/build/kvtc-lab"
res="$top/bench/results"
mkdir -p "$res"

# The commit, marked when tracked files outside bench/results/ differ from it
# (a long evaluation appends its records there while other results are made).
result_commit() {
  local c
  c=$(git -C "$top" rev-parse --short HEAD)
  [ -z "$(git -C "$top" status --porcelain --untracked-files=no -- . ":(exclude)bench/results")" ] || c="$c (with uncommitted changes)"
  echo "$c"
}

# The CPU brand (with its feature list when $1 is "features").
result_cpu() {
  "$kvtc" info --json | python3 -c '
import json, sys
c = json.load(sys.stdin)["cpu"]
print(c["brand"] + (" (" + " ".join(c.get("features", [])) + ")" if sys.argv[1:] == ["features"] else ""))' "$@"
}

# What `kvtc-lab eval --record-tag` stores in each record as "run": the
# commit and machine that made it.
record_tag() {
  echo "commit $(result_commit), $(result_cpu), $(nproc) threads, $(uname -sr)"
}

# lab_result NAME SUBCOMMAND [options…]: runs `kvtc-lab SUBCOMMAND options…`
# with its JSON and markdown body written beside bench/results/NAME, as
# NAME.json.part and NAME.body.part; finish_result NAME moves them into
# place once the caller wrote NAME.md.part around the body.
lab_result() {
  local name=$1 sub=$2
  shift 2
  "$lab" "$sub" "$@" --out-json "$res/$name.json.part" --out-md "$res/$name.body.part" >/dev/null
}
finish_result() {
  local name=$1
  mv "$res/$name.md.part" "$res/$name.md"
  mv "$res/$name.json.part" "$res/$name.json"
  rm -f "$res/$name.body.part"
  echo "wrote $res/$name.md"
}

# server_bench SCRIPT NAME [options…]: runs bench/SCRIPT (a kvtc-server
# benchmark: bench/faults.py, bench/restore_stall.py) on build/kvtc-server,
# SmolLM2 and the default calibration (set as $cal, for the report), in
# out/bench-NAME (emptied first), its JSON written as NAME.json.part; the
# caller writes NAME.md.part, then finish_result NAME.
server_bench() {
  local script=$1 name=$2
  shift 2
  cal=$("$top/scripts/default_calib.sh" "$kvtc")
  local work="$top/out/bench-$name"
  rm -rf "$work" && mkdir -p "$work"
  PYTHONPATH="$top/.deps/py" python3 "$top/bench/$script" --server "$top/build/kvtc-server" \
    --model "$top/.deps/models/SmolLM2-135M-Instruct.Q4_1.gguf" --calib "$cal" --corpus "$top/.deps/corpus" --work "$work" \
    --out-json "$res/$name.json.part" "$@"
}
