// libFuzzer target: llama.cpp state parsers — sequence states
// (llama_state_seq_get_data) and context states (llama_state_get_data: an
// architecture name before the same cache) — the capture mapping, and the
// way back to a state as restore writes it.
#include <algorithm>
#include <cstdlib>
#include <span>
#include <vector>

#include "core/capture_io.h"
#include "core/state_blob.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The seeds' geometry (make_seeds.cpp), so a valid state reaches the
  // capture mapping and the writer instead of stopping at a shape check.
  static const kvtc::CacheGeometry g = kvtc::fuzz::small_geometry();
  const std::span<const uint8_t> in(data, size);
  try {
    const kvtc::SeqBlob b = kvtc::seq_blob_parse(in, size > 0 && (data[0] & 1), "fuzz");
    (void)kvtc::capture_from_blob(b, g, "fuzz");
  } catch (const kvtc::Error&) {
  }
  try {
    if (kvtc::is_context_state(in)) {
      // join undoes split byte for byte (docs/llama-state.md): anything else
      // would restore a different state than the one saved.
      const kvtc::ContextState cs = kvtc::context_state_split(in, "fuzz");
      const std::vector<uint8_t> back = kvtc::context_state_join(cs.arch, cs.seq_blob, "fuzz");
      if (back.size() != size || !std::equal(back.begin(), back.end(), data)) std::abort();
    }
    const kvtc::KvCapture c = kvtc::capture_from_any_state(in, g, "fuzz");
    (void)kvtc::state_as_recorded(c, nullptr, "fuzz");
  } catch (const kvtc::Error&) {
  }
  return 0;
}
