// kvtc-lab: the ways of storing a cache that `kvtc-lab eval` compares — kvtc
// and every baseline behind one interface (docs/eval.md lists them).
// Thread safety: a Method is used by one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "kvtc/kvtc.h"

namespace kvtc::lab {

class Method {
 public:
  virtual ~Method() = default;
  const std::string& name() const { return name_; }
  // The cache the model continues from after `c` was stored this way, and
  // *bytes: what it takes at rest (codes, scales and offsets counted).
  virtual KvCapture apply(const KvCapture& c, uint64_t* bytes) const = 0;
  // Lossless coders: only the size is measured (the cache would come back
  // bit for bit, so running the model again would repeat vanilla).
  virtual bool ratio_only() const { return false; }
  // llama.cpp's own quantized caches ("q8_0", "q4_0"; "-k" / "-v": keys or
  // values only, the other f16) run natively in a context of those cache
  // types (K, V), prefilled from the prompt; apply() then only reports
  // their size. Empty for methods that restore apply()'s cache.
  virtual std::pair<std::string, std::string> native_cache_types() const { return {}; }
  // The vanilla reference (no compression).
  bool is_reference() const { return name_ == "vanilla"; }

 protected:
  explicit Method(std::string name) : name_(std::move(name)) {}

 private:
  std::string name_;
};

// What a method name asks for, checked before any model is loaded: names
// are vanilla, fp8, kivi-2, kivi-4, zstd, deflate, q8_0[-k|-v], q4_0[-k|-v],
// streaming-<R>x, svd-<R>x, kvtc-<R>x[-ecsq|-joint][-w8][-all][-global|-window][-f32|-bf16|-int8][@NAME].
struct MethodSpec {
  std::string name;
  bool needs_calibration = false;
  std::string calibration;  // "" = --calib, else a --calib-extra NAME
};
MethodSpec parse_method(const std::string& name);  // Error naming the accepted forms
extern const char* const kMethodHelp;

// The method of a spec; kvtc and svd methods take their calibration from
// `cals` (key "" = --calib), which must outlive the method. `precision`:
// the projection's, for kvtc methods without a -f32/-bf16/-int8 suffix
// (eval --precision; kAuto picks by CPU, so a record set continued on
// other CPUs can pin it).
std::unique_ptr<Method> make_method(const MethodSpec& spec, const std::map<std::string, Calibration>& cals, Precision precision = Precision::kAuto);

}  // namespace kvtc::lab
