"""A module from this interpreter or from Debian's /usr/bin/python3.

bench scripts need numpy and matplotlib, which scripts/bootstrap.sh installs
as Debian packages (python3-numpy, python3-matplotlib). A pyenv or venv
python3 ahead of Debian's on PATH does not see them; then the calling script
runs itself again, once, with /usr/bin/python3.
"""
import importlib
import os
import sys

SYSTEM_PYTHON = "/usr/bin/python3"
REEXEC_ENV = "KVTC_PY_REEXEC"  # set in the second run: the interpreter of the first


class Missing(Exception):
    pass


def require(module, debian_package, script):
    """The module `module`, importing it here or running `script` (the caller's
    __file__, which must be the program being run) again under Debian's
    python3. Raises Missing, with what to install, when neither has it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        first = os.environ.get(REEXEC_ENV)
        as_script = os.path.abspath(sys.argv[0]) == os.path.abspath(script)
        if not first and as_script and os.path.exists(SYSTEM_PYTHON):
            env = dict(os.environ, **{REEXEC_ENV: sys.executable or "python3"})
            env.pop("PYTHONHOME", None)  # another interpreter's home would break Debian's
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(SYSTEM_PYTHON, [SYSTEM_PYTHON, os.path.abspath(script), *sys.argv[1:]], env)
        tried = f"{first} and {sys.executable}" if first else sys.executable
        raise Missing(f"{module} is not importable ({e}; tried {tried}). Install it: on Debian 12 "
                      f"`apt-get install {debian_package}` (scripts/bootstrap.sh does), elsewhere "
                      f"`python3 -m pip install {module}` for the python3 that runs {os.path.basename(script)}") from None
