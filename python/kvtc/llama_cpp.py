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

Thread safety: as llama-cpp-python's caches, one Llama at a time; the store
underneath is thread-safe.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence, Union

import numpy as np
import llama_cpp
import llama_cpp.llama
from llama_cpp.llama_cache import BaseLlamaCache

from . import Calibration, Error, PromptStore, state_layout

log = logging.getLogger("kvtc")


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
      shared tier (redis://host:port/db).
    threads: coding threads (0: all).
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
        sink: int = 4,
        window: int = 128,
        chunk_tokens: int = 256,
        threads: int = 0,
        async_puts: bool = True,
    ):
        super().__init__(capacity_bytes)
        if not isinstance(calibration, Calibration):
            calibration = Calibration.load(os.fspath(calibration))
        self.calibration = calibration
        self._store = PromptStore(
            calibration,
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
        self._store.put_state(tokens, blob)
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
        m = self._store.take(np.zeros(0, dtype=np.int32), np.asarray(key, dtype=np.int32), v_trans=self._v_trans, arch=self._arch)
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
