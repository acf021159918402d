"""kvtc — KV Cache Transform Coding.

Compresses an LLM's idle KV cache (16x and more) for storage and transfer,
and restores it before the next turn. This package binds the C++ library
(<kvtc/kvtc.h>): the same codec and container as the `kvtc` command line.

    import kvtc
    cal = kvtc.Calibration.load("smollm2-160k.safetensors")
    data = cal.compress(k, v, positions, ratio=16)   # k, v: [layers, kv_heads, tokens, head_dim]
    k2, v2, pos2 = cal.decompress(data)
    kvtc.inspect(data)["ratio_whole_cache"]

llama.cpp states (llama_state_seq_get_data, llama_state_get_data and
llama-cpp-python's LlamaState) go through cal.compress_state /
cal.decompress_state; kvtc.llama_cpp.KvtcCache is a compressed prompt
cache for llama-cpp-python. Errors raise kvtc.Error (a ValueError) with
the library's message.
"""
from ._kvtc import (  # noqa: F401
    CONTAINER_VERSION,
    Calibration,
    Error,
    Learner,
    PromptStore,
    __version__,
    inspect,
    library_info,
    state_layout,
)

__all__ = ["CONTAINER_VERSION", "Calibration", "Error", "Learner", "PromptStore", "__version__", "inspect", "library_info", "state_layout"]
