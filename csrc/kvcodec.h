// The codec kernels (kvcodec.cpp) join the one pdkv extension module.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace pdkv {

// Adds split_planes, merge_planes, fp8_encode, fp8_decode, group_minmax,
// u8_quantize and u8_dequantize to the extension module `m`.
void register_codec_ops(pybind11::module_& m);

}  // namespace pdkv
