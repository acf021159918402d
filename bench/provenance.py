"""What every committed result names: the commit it was measured at.

Files under bench/results/ do not mark a commit as changed: a long
evaluation appends its records there while other results are made.
Mirrors result_commit in bench/lib.sh.
"""
import subprocess


def result_commit(top):
    """The short commit of HEAD, with "+dirty" when tracked files outside
    bench/results/ differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", top, *args], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
