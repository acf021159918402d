"""What every committed result names: the commit it was measured at.

Files under bench/results/ do not mark a commit as changed: a long
evaluation appends its records there while other results are made.
Mirrors result_commit in bench/lib.sh. Also the metadata of a
safetensors file (a calibration's id, tokens, held-out errors).
"""
import json
import struct
import subprocess


def safetensors_meta(path):
    """The __metadata__ of a safetensors file's header ({} when it has none)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


def result_commit(top):
    """The short commit of HEAD, with "+dirty" when tracked files outside
    bench/results/ differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", top, *args], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
