"""Fixtures of the Python package's tests: the repository's binaries, model,
corpus and golden files (from the environment ctest sets, else from the
repository's default locations), and a small real SmolLM2 calibration
fitted once per session."""
import json
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVTC = os.environ.get("KVTC_BIN", os.path.join(TOP, "build", "kvtc"))
SMOL = os.environ.get("KVTC_MODEL_SMOL", os.path.join(TOP, ".deps", "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
GEMMA = os.environ.get("KVTC_MODEL_GEMMA", os.path.join(TOP, ".deps", "models", "gemma-3-270m-q4_k_m.gguf"))
CORPUS = os.environ.get("KVTC_CORPUS", os.path.join(TOP, ".deps", "corpus"))
GOLDEN = os.path.join(TOP, "tests", "golden", "v1")
os.environ.setdefault("LLAMA_CPP_LIB_PATH", os.path.join(TOP, ".deps", "llama-shared"))


def run(*args):
    p = subprocess.run([KVTC, *args], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"kvtc {' '.join(args)} -> {p.returncode}\n{p.stderr}"
    return p.stdout


def read_capture(path):
    """k, v (float16 [layers, kv_heads, tokens, head_dim]), positions, tokens
    (int32) and the metadata of a capture file, read with numpy alone."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    data = raw[8 + n:]

    def tensor(name, dtype):
        t = head[name]
        b, e = t["data_offsets"]
        return np.frombuffer(data[b:e], dtype=dtype).reshape(t["shape"])

    tokens = tensor("tokens", np.int32) if "tokens" in head else None
    return tensor("k", np.float16), tensor("v", np.float16), tensor("pos", np.int32), tokens, head.get("__metadata__", {})


def eval_text(kind="prose", min_tokens=2048):
    with open(os.path.join(CORPUS, "manifest.json")) as f:
        m = json.load(f)
    d = next(d for d in m["documents"] if d["split"] == "eval" and d["kind"] == kind and d["tokens"] >= min_tokens)
    return os.path.join(CORPUS, d["file"])


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("kvtc-python")


@pytest.fixture(scope="session")
def smol_calibration(work):
    """A small real calibration of SmolLM2 at 16x (these tests are about
    the binding, not quality): a copy of the one ctest makes once per run
    for every test (KVTC_TEST_CALIB, tests/kvtc_testlib.py), or, run
    alone, its settings here (3,000 tokens, 512 components, ~18 s)."""
    path = str(work / "smol-small.safetensors")
    shared = os.environ.get("KVTC_TEST_CALIB")
    if shared and os.path.isfile(shared):
        shutil.copyfile(shared, path)
    else:
        run("calibrate", "-m", SMOL, "--tokens", "3000", "--heldout", "512", "--doc-tokens", "1024", "--rank-max", "512", "--ratios", "16",
            "-o", path)
    return path


@pytest.fixture(scope="session")
def smol_capture(work):
    """A real 600-token SmolLM2 cache of an evaluation text (kvtc capture)."""
    path = str(work / "smol-600.safetensors")
    run("capture", "-m", SMOL, "--text", eval_text(), "--max-tokens", "600", "--ctx", "1024", "-o", path)
    return path
