// Internal: the calibration file's bytes (docs/calibration-format.md), for
// the loaders and the fuzz targets.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvtc/calibration.h"

namespace kvtc {

std::vector<uint8_t> calibration_serialize(const Calibration& c);
Calibration calibration_parse(std::span<const uint8_t> bytes, const std::string& origin, bool decoder_only);

}  // namespace kvtc
