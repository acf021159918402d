"""KvtcCache: a compressed prompt cache for llama-cpp-python.

A drop-in for llama_cpp.LlamaRAMCache (llama-cpp-python 0.3.35):

    from llama_cpp import Llama
    from kvtc.llama_cpp import KvtcCache

    llm = Llama(model_path=..., n_ctx=4096)
    llm.set_cache(KvtcCache("calibration.safetensors", llm, capacity_bytes=256 << 20))

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
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import llama_cpp
import llama_cpp.llama
from llama_cpp.llama_cache import BaseLlamaCache

from . import Calibration, Error, PromptStore, state_layout

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


class KvtcCache(BaseLlamaCache):
    """LlamaRAMCache's interface over kvtc's compressed prompt store.

    calibration: a kvtc.Calibration or the path of one, of the Llama's model.
    llm: the Llama this cache serves (optional but recommended): its
      attention layout, architecture, context and vocabulary sizes are read
      from it, so that stored states (disk, Redis) can be restored before the
      first completion stores one; without it they are learned from the
      first stored state.
    capacity_bytes: RAM budget of compressed bytes (least recently used
      prompts go first).
    ratio: kvtc's nominal compression of the coded tokens (16: ~12-15x on the
      whole cache, docs/method.md). raw=True: store f16, uncompressed.
    disk_dir, disk_capacity_bytes: a disk tier (0: no limit); redis_url: a
      shared tier (redis://[[user]:password@]host:port/db), or redis_cluster:
      a Redis Cluster's host:port seeds; redis_user, redis_password_file:
      AUTH (the file's first line), on every node; redis_ttl_s: every key
      expires this long after the last hit or put that used it (0: never);
      redis_lookup_timeout_ms: the most a lookup waits on Redis (then a
      miss: the prompt is recomputed); redis_timeout_ms: a write's
      deadline, on the store's worker thread. docs/store.md "Redis".
    secret_file: a file of at least 32 bytes (openssl rand 32 > F; chmod
      600) shared by every process of the store: every value on disk and in
      Redis is authenticated and bound to its key, one written without the
      secret is dropped, never restored, and the keys cannot be computed
      without it; encrypt=True (needs secret_file) encrypts them at rest too
      (AES-256-GCM). docs/store.md "Secrets".
    threads: coding threads (0: all).
    cache_salt: the tenant of every state this cache stores and restores
      (str or bytes, 1 to 256 bytes as kvtc-server's field; None: none).
    """

    def __init__(
        self,
        calibration: Union[Calibration, str, os.PathLike],
        llm: Optional[llama_cpp.Llama] = None,
        capacity_bytes: int = (2 << 30),
        *,
        ratio: float = 16.0,
        raw: bool = False,
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
        chunk_tokens: int = 256,
        threads: int = 0,
        async_puts: bool = True,
        cache_salt: Optional[Union[str, bytes]] = None,
    ):
        super().__init__(capacity_bytes)
        if cache_salt is not None:
            if not isinstance(cache_salt, (str, bytes)):
                raise Error(f"KvtcCache: cache_salt: a str or bytes is expected, got {type(cache_salt).__name__}")
            n = len(cache_salt.encode() if isinstance(cache_salt, str) else cache_salt)
            if not 1 <= n <= 256:  # kvtc-server's bounds for the same field
                raise Error(f"KvtcCache: cache_salt: 1 to 256 bytes are expected, got {n}")
        self._tenant = cache_salt
        if not isinstance(calibration, Calibration):
            calibration = Calibration.load(os.fspath(calibration))
        self.calibration = calibration
        if llm is None:
            raise Error("KvtcCache: give the Llama it serves (KvtcCache(calibration, llm, ...)): the store's keys name its "
                        "model file and its context's RoPE settings")
        self._store = PromptStore(
            calibration,
            model_sha256=model_sha256(llm.model_path),
            kv_settings=context_kv_settings(llm),
            ratio=ratio,
            raw=raw,
            chunk_tokens=chunk_tokens,
            sink=sink,
            window=window,
            ram_bytes=capacity_bytes,
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else "",
            disk_bytes=disk_capacity_bytes,
            async_puts=async_puts,
            threads=threads,
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
        # The context a restored state is written for: V layout (1: no flash
        # attention), architecture name, n_ctx (input_ids' length), n_vocab.
        self._v_trans: Optional[int] = None
        self._arch: Optional[str] = None
        self._n_ctx: Optional[int] = None
        self._n_vocab: Optional[int] = None
        self._seed = 0
        self._found: Optional[tuple] = None  # (key, state): a __contains__ hit for the __getitem__ that follows
        if llm is not None:
            self.bind(llm)

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
        """Compressed bytes held in RAM, with raw states still queued for compression."""
        s = self._store.stats()
        self._forward_messages()
        return int(s["ram_bytes"] + s["pending_bytes"])

    def __setitem__(self, key: Sequence[int], value: "llama_cpp.llama.LlamaState") -> None:
        n = int(value.n_tokens)
        if n <= 0:
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
        found, self._found = self._found, None
        if found is not None and found[0] == tuple(key):
            return found[1]
        state = self._take(key)
        if state is None:
            raise KeyError("Key not found")
        return state

    def __contains__(self, key: Sequence[int]) -> bool:
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
        """The store's counters: entries, bytes per tier, hits per tier, misses, coding time."""
        return self._store.stats()

    def flush(self) -> None:
        """Waits until every stored state is compressed (and the disk tier's files, read back in the background at start, are)."""
        self._store.flush()
        self._forward_messages()

    def close(self) -> None:
        """Finishes queued compressions and releases the store (disk and Redis tiers keep their data)."""
        self._store.close()

    def __enter__(self) -> "KvtcCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _forward_messages(self) -> None:
        for line in self._store.messages():
            log.warning("kvtc: %s", line)
