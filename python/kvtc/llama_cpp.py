"""KvtcCache: a compressed prompt cache for llama-cpp-python.

A drop-in for llama_cpp.LlamaRAMCache (llama-cpp-python 0.3.35):

    from llama_cpp import Llama
    from kvtc.llama_cpp import KvtcCache

    llm = Llama(model_path=..., n_ctx=4096)
    llm.set_cache(KvtcCache("calibration.safetensors", llm, capacity_bytes=256 << 20))
    # or, with no calibration step: learned from the prompts it stores
    llm.set_cache(KvtcCache("auto", llm, capacity_bytes=256 << 20, disk_dir="kvtc-cache"))

Where LlamaRAMCache keeps every state raw (the whole f16 KV cache of each
prompt), KvtcCache keeps it compressed by kvtc's prompt store
(kvtc.PromptStore, docs/store.md): ~16x smaller at the default ratio, so the
same budget holds ~16x more conversations; states can also go to a disk
directory that survives restarts (disk_dir) and to Redis (redis_url) for
other processes or machines. Shared openings (a system prompt) are stored
once. Compression runs on a worker thread after the completion returns.

What differs from LlamaRAMCache, and why:
- capacity_bytes counts compressed bytes held in RAM (LlamaRAMCache counts
  raw state bytes).
- A lookup follows llama-server's rules: a stored prompt is used when it
  keeps at least 25% of the new prompt (LlamaRAMCache takes any prefix).
- A restored state holds no per-token logits: its `scores` are NaN. Generation
  never reads them (llama-cpp-python decodes the last prompt token again
  after a restore); prompt logprobs would, so a Llama with logits_all=True
  is refused.
- The restored cache is kvtc's reconstruction, not the original bytes
  (raw=True stores them exactly: the baseline to compare with).
- The store's keys name the model file (its SHA-256, computed once per file
  and remembered by path, size and modification time) and the context's
  RoPE as llama.cpp resolved it (rope_freq_base, YaRN, ...): another model
  file, or the same one run with other RoPE settings, never shares a state
  (docs/store.md "Keys"). Both are read from `llm`, which is why it must be
  given; a calibration of another model file is refused.
- cache_salt (kvtc-server's and vLLM's request field, here per cache):
  the cache's tenant. Its states are stored on a key chain of their own
  (docs/store.md "Tenants"): a KvtcCache with another salt, or none, never
  restores them, even through a shared disk directory or Redis, and a
  kvtc-server request with the same cache_salt does. llama-cpp-python's
  cache interface has no per-request field, hence one cache per tenant.
  The Llama's own context is not the cache's: it keeps its last prompt and
  reuses its prefix for the next call whatever cache is set, so a Llama
  shared between tenants needs llm.reset() between them.

Thread safety: as llama-cpp-python's caches, one Llama at a time; the store
underneath is thread-safe.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import llama_cpp
import llama_cpp.llama
from llama_cpp.llama_cache import BaseLlamaCache, LlamaRAMCache

from . import Calibration, Error, Learner, PromptStore, state_layout

log = logging.getLogger("kvtc")


# ---- what the store's keys name: the model file and the context's settings -------------

_SHA_CACHE: Dict[Tuple[str, int, int], str] = {}


def _sha_cache_file() -> str:
    base = os.environ.get("KVTC_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvtc")
    return os.path.join(base, "model-sha256.json")


def model_sha256(path: Union[str, os.PathLike]) -> str:
    """SHA-256 of a model file, as kvtc-server and the calibration name it.

    Hashing reads the whole file (~0.3 s per 100 MB), so the result is kept
    by (real path, size, modification time in ns): in this process, and in
    $KVTC_CACHE_DIR/model-sha256.json (default ~/.cache/kvtc) for the next
    one; a file changed in place gets a new mtime and is hashed again.
    """
    real = os.path.realpath(os.fspath(path))
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    if key in _SHA_CACHE:
        return _SHA_CACHE[key]
    cache_path, known = _sha_cache_file(), {}
    try:
        with open(cache_path) as f:
            known = json.load(f)
        hit = known.get(real)
        if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns and len(hit.get("sha256", "")) == 64:
            _SHA_CACHE[key] = hit["sha256"]
            return hit["sha256"]
    except (OSError, ValueError, AttributeError):
        known = {}
    h = hashlib.sha256()
    with open(real, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    _SHA_CACHE[key] = digest
    try:  # best effort: a cache that cannot be written costs a hash next time
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        known[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cache_path), prefix=".model-sha256.")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return digest


class _CParamsHead(ctypes.Structure):
    """The leading fields of llama.cpp's llama_cparams at the pinned commit
    (src/llama-cparams.h of 4df29be4f): what a context resolved its RoPE to.
    The first ones are checked against llama.h's getters before use."""

    _fields_ = [
        ("n_ctx", ctypes.c_uint32),
        ("n_ctx_seq", ctypes.c_uint32),
        ("n_batch", ctypes.c_uint32),
        ("n_ubatch", ctypes.c_uint32),
        ("n_seq_max", ctypes.c_uint32),
        ("n_rs_seq", ctypes.c_uint32),
        ("n_outputs_max", ctypes.c_uint32),
        ("n_outputs_max_per_seq", ctypes.c_uint32),
        ("n_threads", ctypes.c_int32),
        ("n_threads_batch", ctypes.c_int32),
        ("nextn_layer_offset", ctypes.c_int32),
        ("rope_freq_base", ctypes.c_float),
        ("rope_freq_scale", ctypes.c_float),
        ("n_ctx_orig_yarn", ctypes.c_uint32),
        ("yarn_ext_factor", ctypes.c_float),
        ("yarn_attn_factor", ctypes.c_float),
        ("yarn_beta_fast", ctypes.c_float),
        ("yarn_beta_slow", ctypes.c_float),
    ]


def context_kv_settings(llm: llama_cpp.Llama) -> Dict[str, float]:
    """The RoPE settings `llm`'s context resolved (what kvtc-server reads with
    kvtc::context_kv_settings): read from the context itself through
    llama.cpp's exported llama_context::get_cparams, so a rope_freq_base,
    rope_scaling_type or YaRN argument, the GGUF's defaults and llama.cpp's
    own derivations all count. Error for a llama.cpp other than the pinned one."""
    lib = llama_cpp.llama_cpp._lib
    try:
        fn = getattr(lib, "_ZNK13llama_context11get_cparamsEv")
    except AttributeError:
        raise Error("KvtcCache: this libllama does not export llama_context::get_cparams (not the pinned llama.cpp "
                    "4df29be4f, which kvtc's LLAMA_CPP_LIB_PATH provides)") from None
    fn.restype = ctypes.POINTER(_CParamsHead)
    fn.argtypes = [ctypes.c_void_p]
    ctx = llm.ctx
    c = fn(ctypes.cast(ctx, ctypes.c_void_p)).contents
    if (c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max) != (llama_cpp.llama_n_ctx(ctx), llama_cpp.llama_n_batch(ctx),
                                                         llama_cpp.llama_n_ubatch(ctx), llama_cpp.llama_n_seq_max(ctx)):
        raise Error("KvtcCache: llama.cpp's context parameters are not laid out as at 4df29be4f (another llama.cpp?)")
    return {name: getattr(c, name) for name in ("rope_freq_base", "rope_freq_scale", "n_ctx_orig_yarn", "yarn_ext_factor",
                                                "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")}


# ---- what KvtcCache("auto") learns for: the model's cache geometry ----------------------

# GGUF value types (ggml's gguf.h) and the getters of the numbers among them.
_GGUF_NUMBER_GETTERS = {0: ("gguf_get_val_u8", ctypes.c_uint8), 1: ("gguf_get_val_i8", ctypes.c_int8),
                        2: ("gguf_get_val_u16", ctypes.c_uint16), 3: ("gguf_get_val_i16", ctypes.c_int16),
                        4: ("gguf_get_val_u32", ctypes.c_uint32), 5: ("gguf_get_val_i32", ctypes.c_int32),
                        6: ("gguf_get_val_f32", ctypes.c_float), 10: ("gguf_get_val_u64", ctypes.c_uint64),
                        11: ("gguf_get_val_i64", ctypes.c_int64), 12: ("gguf_get_val_f64", ctypes.c_double)}
_GGUF_TYPE_STRING, _GGML_TYPE_F32 = 8, 0


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _gguf_facts(path: str, arch: str) -> Dict[str, object]:
    """What kvtc's own llama integration reads from a GGUF header for the
    cache geometry (read_gguf_info in src/llama/llama_session.cpp), read
    with the same parser: ggml's gguf functions in the pinned libllama.
    Numbers come back exactly (an f32 as the float it is); absent keys are
    left out."""
    lib = llama_cpp.llama_cpp._lib

    def fn(name, restype, *argtypes):
        try:
            f = getattr(lib, name)
        except AttributeError:
            raise Error(f"KvtcCache('auto'): this libllama does not export {name} (not the pinned llama.cpp 4df29be4f)") from None
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    init = fn("gguf_init_from_file", ctypes.c_void_p, ctypes.c_char_p, _GgufInitParams)
    free = fn("gguf_free", None, ctypes.c_void_p)
    find_key = fn("gguf_find_key", ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p)
    kv_type = fn("gguf_get_kv_type", ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)
    get_str = fn("gguf_get_val_str", ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64)
    find_tensor = fn("gguf_find_tensor", ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p)
    tensor_type = fn("gguf_get_tensor_type", ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)
    tensor_size = fn("gguf_get_tensor_size", ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int64)
    data_offset = fn("gguf_get_data_offset", ctypes.c_size_t, ctypes.c_void_p)
    tensor_offset = fn("gguf_get_tensor_offset", ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int64)
    g = init(os.fsencode(path), _GgufInitParams(True, None))
    if not g:
        raise Error(f"{path}: the GGUF header could not be parsed")
    out: Dict[str, object] = {}
    try:
        for name in ("rope.dimension_count", "rope.freq_base", "rope.scaling.type", "attention.key_length", "attention.value_length"):
            i = find_key(g, f"{arch}.{name}".encode())
            if i < 0:
                continue
            t = kv_type(g, i)
            if t == _GGUF_TYPE_STRING:
                out[name] = get_str(g, i).decode()
            elif t in _GGUF_NUMBER_GETTERS:
                getter, ctype = _GGUF_NUMBER_GETTERS[t]
                out[name] = fn(getter, ctype, ctypes.c_void_p, ctypes.c_int64)(g, i)
        t = find_tensor(g, b"rope_freqs.weight")
        if t >= 0:
            if tensor_type(g, t) != _GGML_TYPE_F32:
                raise Error(f"{path}: tensor rope_freqs.weight is not F32")
            n = tensor_size(g, t) // 4
            if not 0 < n <= 65536:
                raise Error(f"{path}: tensor rope_freqs.weight has an implausible length")
            with open(path, "rb") as f:
                f.seek(data_offset(g) + tensor_offset(g, t))
                raw = f.read(n * 4)
            if len(raw) != n * 4:
                raise Error(f"{path}: cannot read tensor rope_freqs.weight")
            out["rope_freqs"] = np.frombuffer(raw, dtype="<f4").tolist()
    finally:
        free(g)
    return out


def model_facts(llm: llama_cpp.Llama) -> Dict[str, str]:
    """The facts kvtc.Learner takes for `llm`'s model (kvtc::geometry_from_facts):
    what kvtc's own model_geometry() reads, from the same places: the GGUF
    header through ggml's parser, the rest from llama.cpp's model getters,
    so a calibration learned here fits kvtc-server's model and the reverse."""
    model = llm.model
    arch = (llm.metadata or {}).get("general.architecture", "")
    g = _gguf_facts(llm.model_path, arch)
    n_head = llama_cpp.llama_model_n_head(model)
    n_embd = llama_cpp.llama_model_n_embd(model)
    head_k = int(g.get("attention.key_length") or (n_embd // n_head if n_head else 0))
    head_v = int(g.get("attention.value_length") or (n_embd // n_head if n_head else 0))
    if head_k != head_v:
        raise Error(f"{llm.model_path}: K head_dim {head_k} differs from V head_dim {head_v}; kvtc does not code such caches")
    rope_names = {llama_cpp.LLAMA_ROPE_TYPE_NONE: "none", llama_cpp.LLAMA_ROPE_TYPE_NORM: "norm", llama_cpp.LLAMA_ROPE_TYPE_NEOX: "neox"}
    rope = llama_cpp.llama_model_rope_type(model)
    factors = g.get("rope_freqs", [])
    return {
        "model_sha256": model_sha256(llm.model_path),
        "n_layer": str(llama_cpp.llama_model_n_layer(model)),
        "n_head_kv": str(llama_cpp.llama_model_n_head_kv(model)),
        "head_dim": str(head_k),
        "n_swa": str(max(0, llama_cpp.llama_model_n_swa(model))),
        "rope_type": rope_names.get(rope, f"llama.cpp rope type {rope}"),
        "n_rot": str(int(g.get("rope.dimension_count") or head_k)),
        "rope_freq_base": "%.9g" % float(g.get("rope.freq_base", 10000.0)),
        "rope_freq_scale": "%.9g" % llama_cpp.llama_model_rope_freq_scale_train(model),
        "rope_scaling_type": str(g.get("rope.scaling.type") or "none"),
        "rope_freq_factors": "[" + ",".join("%.9g" % x for x in factors) + "]",
    }


class KvtcCache(BaseLlamaCache):
    """LlamaRAMCache's interface over kvtc's compressed prompt store.

    calibration: a kvtc.Calibration or the path of one, of the Llama's model;
      or "auto": learned from the prompts this cache stores, as kvtc-server's
      --kvtc-calib auto (docs/server.md "A calibration learned from the
      prompts served"). Until it is fitted, states are kept raw in a
      LlamaRAMCache of capacity_bytes (raw bytes) and handed to a learner
      thread (nice 19) that gathers calib_tokens tokens of their keys and
      values (held out: 1/16 more), every stride-th new token so that its
      CPU time stays within calib_share of the prefill time of the tokens it
      learns from (llama_perf_context; a prefix seen before is not learned
      again). Then it fits in the background (seconds for SmolLM2 at 1K
      tokens; ~4 min at the default 32,768 on 2 cores), writes the file
      into disk_dir (calibration-auto-<model sha256[:16]>.safetensors,
      found at the next start), publishes it to Redis when redis_url and
      secret_file are given (every process with the same Redis and secret
      then shares one calibration, so one store), and the compressed store
      takes over at the next call, with the raw states moved into it.
      calibration_status() and wait_calibrated() follow it. Sliding-window
      models are refused in "auto" (the model facts carry no layer pattern
      yet); with a calibration file they are stored (docs/store.md
      "Sliding-window models": restored whole).
    llm: the Llama this cache serves (optional but recommended): its
      attention layout, architecture, context and vocabulary sizes are read
      from it, so that stored states (disk, Redis) can be restored before the
      first completion stores one; without it they are learned from the
      first stored state.
    capacity_bytes: RAM budget of compressed bytes (least recently used
      prompts go first).
    ratio: kvtc's nominal compression of the coded tokens (16: ~12-15x on the
      whole cache, docs/method.md). raw=True: store f16, uncompressed.
      entropy_coded: the entropy-coded pieces (the default: ~20% fewer bytes
      than the DP at equal error, as fast to restore); False: the paper's DP
      allocation with DEFLATE (a sliding-window model's pieces are DP-coded
      either way). window_bits: the last `window` tokens as int8 with f16
      scales (8, the default: about half their bytes, container version 3)
      or f16 (16).
    disk_dir, disk_capacity_bytes: a disk tier (0: no limit); redis_url: a
      shared tier (redis://[[user]:password@]host:port/db), or redis_cluster:
      a Redis Cluster's host:port seeds; redis_user, redis_password_file:
      AUTH (the file's first line), on every node; redis_ttl_s: every key
      expires this long after the last hit or put that used it (0: never);
      redis_lookup_timeout_ms: the most a lookup waits on Redis (then a
      miss: the prompt is recomputed); redis_timeout_ms: a write's
      deadline, on the store's worker thread. docs/store.md "Redis".
    global_ratio: a sliding-window model's (Gemma 3's) global layers' ratio
      (0: min(ratio, 4), their long-range memory; bench/results/swa.md).
    secret_file: a file of at least 32 bytes (openssl rand 32 > F; chmod
      600) shared by every process of the store: every value on disk and in
      Redis is authenticated and bound to its key, one written without the
      secret is dropped, never restored, and the keys cannot be computed
      without it; encrypt=True (needs secret_file) encrypts them at rest too
      (AES-256-GCM). docs/store.md "Secrets".
    threads: coding threads (0: all).
    cache_salt: the tenant of every state this cache stores and restores
      (str or bytes, 1 to 256 bytes as kvtc-server's field; None: none).
    calib_tokens, calib_share: calibration="auto" only (above).
    """

    def __init__(
        self,
        calibration: Union[Calibration, str, os.PathLike],
        llm: Optional[llama_cpp.Llama] = None,
        capacity_bytes: int = (2 << 30),
        *,
        ratio: float = 16.0,
        global_ratio: float = 0.0,
        raw: bool = False,
        entropy_coded: bool = True,
        disk_dir: Optional[Union[str, os.PathLike]] = None,
        disk_capacity_bytes: int = 0,
        redis_url: Optional[str] = None,
        redis_cluster: Sequence[str] = (),
        redis_user: str = "",
        redis_password_file: Optional[Union[str, os.PathLike]] = None,
        redis_ttl_s: int = 86400,
        redis_lookup_timeout_ms: int = 100,
        redis_timeout_ms: int = 2000,
        secret_file: Optional[Union[str, os.PathLike]] = None,
        encrypt: bool = False,
        sink: int = 4,
        window: int = 128,
        window_bits: int = 8,
        chunk_tokens: int = 256,
        threads: int = 0,
        async_puts: bool = True,
        cache_salt: Optional[Union[str, bytes]] = None,
        calib_tokens: int = 32768,
        calib_share: float = 0.05,
    ):
        super().__init__(capacity_bytes)
        if cache_salt is not None:
            if not isinstance(cache_salt, (str, bytes)):
                raise Error(f"KvtcCache: cache_salt: a str or bytes is expected, got {type(cache_salt).__name__}")
            n = len(cache_salt.encode() if isinstance(cache_salt, str) else cache_salt)
            if not 1 <= n <= 256:  # kvtc-server's bounds for the same field
                raise Error(f"KvtcCache: cache_salt: 1 to 256 bytes are expected, got {n}")
        self._tenant = cache_salt
        if llm is None:
            raise Error("KvtcCache: give the Llama it serves (KvtcCache(calibration, llm, ...)): the store's keys name its "
                        "model file and its context's RoPE settings")
        kv_settings = context_kv_settings(llm)
        fleet = dict(
            kv_settings=kv_settings,
            redis_url=redis_url or "",
            redis_cluster=list(redis_cluster),
            redis_user=redis_user,
            redis_password_file=os.fspath(redis_password_file) if redis_password_file is not None else "",
            redis_ttl_s=redis_ttl_s,
            redis_lookup_timeout_ms=redis_lookup_timeout_ms,
            redis_timeout_ms=redis_timeout_ms,
            secret_file=os.fspath(secret_file) if secret_file is not None else "",
            encrypt=encrypt,
        )
        self._store_args = dict(
            fleet,
            model_sha256=model_sha256(llm.model_path),
            ratio=ratio,
            global_ratio=global_ratio,
            raw=raw,
            entropy_coded=entropy_coded,
            chunk_tokens=chunk_tokens,
            sink=sink,
            window=window,
            window_bits=window_bits,
            ram_bytes=capacity_bytes,
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else "",
            disk_bytes=disk_capacity_bytes,
            async_puts=async_puts,
            threads=threads,
        )
        self._store: Optional[PromptStore] = None
        self._learner: Optional[Learner] = None
        self._raw: Optional[LlamaRAMCache] = None  # while learning: llama-cpp-python's own cache, raw states
        self._llm = llm
        self.calibration: Optional[Calibration] = None
        if isinstance(calibration, str) and calibration == "auto":
            if raw:
                raise Error("KvtcCache('auto'): raw=True stores f16 and needs no calibration; give any calibration of the model")
            self._learner = Learner(model_facts(llm), tokens=calib_tokens, share=calib_share, ratio=ratio,
                                    disk_dir=self._store_args["disk_dir"], **fleet)
            found = self._learner.find()
            self._forward_messages()
            if found is not None:
                log.info("kvtc: the calibration learned before, from %s (%.16s)", found.path, found.id)
                self._open_store(found)
            else:
                self._learner.start()
                self._raw = LlamaRAMCache(capacity_bytes)
                log.info("kvtc: no calibration yet: prompts are kept raw (LlamaRAMCache, %d bytes) while %d tokens of them are learned%s",
                         capacity_bytes, calib_tokens, "; then written to " + self._learner.file if self._learner.file else "")
        else:
            if not isinstance(calibration, Calibration):
                calibration = Calibration.load(os.fspath(calibration))
            self._open_store(calibration)
        # The context a restored state is written for: V layout (1: no flash
        # attention), architecture name, n_ctx (input_ids' length), n_vocab.
        self._v_trans: Optional[int] = None
        self._arch: Optional[str] = None
        self._n_ctx: Optional[int] = None
        self._n_vocab: Optional[int] = None
        self._seed = 0
        self._found: Optional[tuple] = None  # (key, state): a __contains__ hit for the __getitem__ that follows
        self.bind(llm)

    def _open_store(self, calibration: Calibration) -> None:
        self._store = PromptStore(calibration, **self._store_args)
        self.calibration = calibration

    # ---- KvtcCache("auto"): learning, then the switch to the compressed store ------------

    def _learned(self) -> bool:
        """True when states go to the compressed store (a calibration was
        given, found, or has just been learned: then the store opens and the
        raw states kept meanwhile move into it, compressed by its worker)."""
        if self._store is not None:
            return True
        if self._learner is None:
            raise Error("KvtcCache: closed")
        cal = self._learner.calibration()
        self._forward_messages()
        if cal is None:
            return False
        self._open_store(cal)
        moved = 0
        for _key, state in list(self._raw.cache_state.items()):
            n = int(state.n_tokens)
            tokens = np.ascontiguousarray(state.input_ids[:n], dtype=np.int32)
            if n > 0 and self._store.wants(tokens, tenant=self._tenant):
                self._store.put_state(tokens, state.llama_state, tenant=self._tenant)
                moved += 1
        self._raw = None
        self._learner.mark_live(moved)
        log.info("kvtc: calibration %.16s learned (%s); the compressed store is in place, %d raw prompts moved into it", cal.id, cal.path, moved)
        return True

    def calibration_status(self) -> dict:
        """KvtcCache('auto'): the learner's state ('learning', 'fitting', 'ready', 'live' or 'failed'), tokens learned and
        targets, samples, stride, CPU and fit times; {'state': 'given'} for a cache made with a calibration."""
        if self._learner is None:
            return {"state": "given"}
        self._learned()
        st = self._learner.status()
        if st["state"] == "not started":  # found at start: nothing to learn
            st["state"] = "live"
        return st

    def wait_calibrated(self, timeout_s: float = 60.0) -> bool:
        """Waits until the compressed store is in place (True), the learner failed, or timeout_s passed (False).
        Learning needs prompts: while the learner still wants tokens, only a Llama that is used makes progress."""
        deadline = time.monotonic() + timeout_s
        while not self._learned():
            if self._learner.status()["state"] == "failed" or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _prefill_ms_per_token(self) -> float:
        """llama.cpp's prompt processing per token in this Llama's context so
        far (llama_perf_context; 0 before any): what the learner's stride follows."""
        try:
            p = llama_cpp.llama_perf_context(self._llm.ctx)
            return float(p.t_p_eval_ms) / p.n_p_eval if p.n_p_eval > 0 else 0.0
        except Exception:  # a Llama made with no_perf, say: every token is learned
            return 0.0

    # ---- the context states are written for ----------------------------------------------

    def bind(self, llm: llama_cpp.Llama) -> None:
        """Reads what a restored state must match from the Llama it is for."""
        if getattr(llm, "_logits_all", False):
            raise Error("KvtcCache: this Llama keeps every token's logits (logits_all=True), which a compressed state does "
                        "not hold (prompt logprobs of a restored prefix would be lost); use logits_all=False or LlamaRAMCache")
        fa = llm.context_params.flash_attn_type
        if fa == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED:
            self._v_trans = 0
        elif fa == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED:
            self._v_trans = 1
        arch = llm.metadata.get("general.architecture") if llm.metadata else None
        if arch:
            self._arch = arch
        self._n_ctx = llm.n_ctx()
        self._n_vocab = llm.n_vocab()
        self._seed = llm._seed

    def _ready(self) -> bool:
        return None not in (self._v_trans, self._arch, self._n_ctx, self._n_vocab)

    # ---- BaseLlamaCache -----------------------------------------------------------------

    @property
    def cache_size(self) -> int:
        """Compressed bytes held in RAM, with raw states still queued for compression (while learning: the raw states' bytes)."""
        if not self._learned():
            return self._raw.cache_size
        s = self._store.stats()
        self._forward_messages()
        return int(s["ram_bytes"] + s["pending_bytes"])

    def __setitem__(self, key: Sequence[int], value: "llama_cpp.llama.LlamaState") -> None:
        n = int(value.n_tokens)
        if n <= 0:
            return
        if not self._learned():
            # Kept raw, and handed to the learner (a copy, when it is not busy
            # with the previous state; the statistics run on its thread).
            self._raw[key] = value
            tokens = np.ascontiguousarray(value.input_ids[:n], dtype=np.int32)
            self._learner.offer(tokens, value.llama_state, self._prefill_ms_per_token())
            self._forward_messages()
            return
        blob = value.llama_state
        if self._v_trans is None or self._arch is None:
            lay = state_layout(blob)  # Error for bytes that are not a llama.cpp state
            self._v_trans = int(lay["v_trans"])
            self._arch = lay["arch"] or self._arch
        self._n_ctx = self._n_ctx or int(len(value.input_ids))
        self._n_vocab = self._n_vocab or int(value.scores.shape[-1])
        self._seed = value.seed
        # The state holds the cache of its first n_tokens ids (positions
        # 0..n-1); the key may carry one more token, sampled but not decoded.
        tokens = np.ascontiguousarray(value.input_ids[:n], dtype=np.int32)
        self._store.put_state(tokens, blob, tenant=self._tenant)
        self._found = None
        self._forward_messages()

    def __getitem__(self, key: Sequence[int]) -> "llama_cpp.llama.LlamaState":
        if self._raw is not None and not self._learned():
            return self._raw[key]
        found, self._found = self._found, None
        if found is not None and found[0] == tuple(key):
            return found[1]
        state = self._take(key)
        if state is None:
            raise KeyError("Key not found")
        return state

    def __contains__(self, key: Sequence[int]) -> bool:
        if not self._learned():
            return key in self._raw
        state = self._take(key)
        self._found = (tuple(key), state) if state is not None else None
        return state is not None

    def _take(self, key: Sequence[int]) -> Optional["llama_cpp.llama.LlamaState"]:
        if not self._ready():
            return None  # nothing to write a state for yet (no Llama bound, nothing stored)
        m = self._store.take(np.zeros(0, dtype=np.int32), np.asarray(key, dtype=np.int32), v_trans=self._v_trans, arch=self._arch,
                             tenant=self._tenant)
        self._forward_messages()
        if m is None:
            return None
        ids = m["tokens"]
        n = len(ids)
        if n > self._n_ctx:
            log.warning("kvtc: a stored prompt of %d tokens does not fit this context (%d); not restored", n, self._n_ctx)
            return None
        input_ids = np.zeros(self._n_ctx, dtype=np.intc)
        input_ids[:n] = ids
        state = m["state"]
        return llama_cpp.llama.LlamaState(
            input_ids=input_ids,
            scores=np.full((1, self._n_vocab), np.nan, dtype=np.single),
            n_tokens=n,
            llama_state=state,
            llama_state_size=len(state),
            seed=self._seed,
        )

    # ---- beyond LlamaRAMCache ---------------------------------------------------------

    def stats(self) -> dict:
        """The store's counters: entries, bytes per tier, hits per tier, misses, coding time ({} while learning:
        calibration_status() says how far)."""
        return self._store.stats() if self._learned() else {}

    def flush(self) -> None:
        """Waits until every stored state is compressed (and the disk tier's files, read back in the background at start, are).
        Nothing to wait for while learning."""
        if self._learned():
            self._store.flush()
        self._forward_messages()

    def close(self) -> None:
        """Finishes queued compressions and releases the store (disk and Redis tiers keep their data); a learner under way
        stops (a fit under way finishes first)."""
        if self._store is not None:
            self._store.close()
        self._learner = None

    def __enter__(self) -> "KvtcCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _forward_messages(self) -> None:
        if self._store is not None:
            for line in self._store.messages():
                log.warning("kvtc: %s", line)
        if self._learner is not None:
            for line in self._learner.messages():
                if line.startswith("warning: "):
                    log.warning("%s", line[9:])
                else:
                    log.info("%s", line)
