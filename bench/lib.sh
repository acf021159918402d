# Shared by the bench/*.sh wrappers: what every committed result names.
# Source it after setting $top (repository root) and $kvtc (the kvtc binary).

# The commit, marked when tracked files differ from it.
result_commit() {
  local c
  c=$(git -C "$top" rev-parse --short HEAD)
  [ -z "$(git -C "$top" status --porcelain --untracked-files=no)" ] || c="$c (with uncommitted changes)"
  echo "$c"
}

# The CPU brand (with its feature list when $1 is "features").
result_cpu() {
  "$kvtc" info --json | python3 -c '
import json, sys
c = json.load(sys.stdin)["cpu"]
print(c["brand"] + (" (" + " ".join(c.get("features", [])) + ")" if sys.argv[1:] == ["features"] else ""))' "$@"
}
