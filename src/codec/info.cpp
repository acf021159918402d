// library_info (kvtc/codec.h): what this build and CPU run.
#include "codec/project.h"
#include "core/util.h"
#include "kvtc/codec.h"

namespace kvtc {

LibraryInfo library_info() {
  LibraryInfo li;
  li.version = KVTC_VERSION;
  const CpuFeatures& f = cpu_features();
  li.cpu = f.brand;
  li.cpu_features = cpu_feature_names(f);
  li.f16c = f.f16c && f.avx;
  li.bf16 = bf16_projection_available(&li.bf16_projection);
  li.int8 = int8_projection_available(&li.int8_projection);
  li.auto_decode = detail::resolve_precision(Precision::kAuto, "library_info");
  li.auto_encode = detail::float_precision(li.auto_decode);
  return li;
}

}  // namespace kvtc
