// Geometry shared by the CPU copy (kvcopy.cpp) and the CUDA kernel
// (kvcopy_cuda.cu). Deliberately free of torch headers so the CUDA file can be
// compiled by nvcc on its own and the struct means the same on both sides.
#pragma once

#include <cstdint>

namespace pdkv {

// Where one row of head_dim elements lives, in elements, for either side.
//
// Buffer: the row of (layer l, kv k, token at block b offset o, head h) starts
// at layer_base[l] + b*block_stride + k*kv_stride + o*token_stride + h*head_stride.
// Chunk: canonical [layers, kv, tokens, heads, head_dim], contiguous.
struct KVGeometry {
  int64_t layers;
  int64_t kv;
  int64_t tokens;
  int64_t heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t start;  // position of chunk token 0 in the request (indexes the block table)
  int64_t element_size;  // bytes; the copy never looks at values
  int64_t block_stride;
  int64_t kv_stride;
  int64_t token_stride;
  int64_t head_stride;
};

}  // namespace pdkv

#ifdef PDKV_WITH_CUDA
#include <cuda_runtime_api.h>

namespace pdkv {

// Launch the gather (to_chunk) or scatter on `stream`. All pointers are device
// pointers: layer_bases[l] is layer l's base address, block_table holds the
// request's block ids (already bounds checked on the host). vec_bytes (16, 8,
// 4, 2 or 1) is the widest load/store every row start is aligned to. Returns
// the launch status; the copy itself is asynchronous on the stream.
cudaError_t launch_kvcopy_cuda(const KVGeometry& g, const int64_t* layer_bases, const int64_t* block_table,
                               char* chunk, bool to_chunk, int vec_bytes, cudaStream_t stream);

}  // namespace pdkv
#endif
