// CUDA paged gather/scatter for pdkv (the device side of kvcopy.cpp).
//
// STATUS: written against the same KVGeometry as the CPU path but NOT yet
// compiled into the extension or run on a GPU: the machine this was written on
// has no GPU and a CPU-only torch. pdkv/native.py only adds this file to the
// build when torch reports a usable CUDA device and toolkit. Treat the first
// GPU run as its first test (tests/test_native.py runs the same bit-identity
// checks on CUDA tensors when a GPU is present).
//
// One thread block per (layer, kv, token) row of heads * head_dim elements;
// threads stride over the row in the widest aligned vector, so both the
// paged side and the chunk side see coalesced 16-byte accesses for common
// shapes (head_dim * element_size a multiple of 16). Block ids were bounds
// checked on the host before launch.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvcopy.h"

namespace pdkv {
namespace {

constexpr int kMaxThreads = 256;

template <typename Vec>
__global__ void kvcopy_kernel(KVGeometry g, const int64_t* __restrict__ layer_bases,
                              const int64_t* __restrict__ block_table, char* __restrict__ chunk, bool to_chunk) {
  const int64_t row = blockIdx.x;  // == (layer * kv + k) * tokens + t, the chunk's row index
  const int64_t t = row % g.tokens;
  const int64_t lk = row / g.tokens;
  const int64_t layer = lk / g.kv;
  const int64_t k = lk % g.kv;
  const int64_t pos = g.start + t;
  const int64_t block = block_table[pos / g.block_size];
  const int64_t off = pos % g.block_size;
  const int64_t E = g.element_size;

  char* buf_row = reinterpret_cast<char*>(layer_bases[layer]) +
                  (block * g.block_stride + k * g.kv_stride + off * g.token_stride) * E;
  char* chunk_row = chunk + row * g.heads * g.head_dim * E;
  const int64_t head_vecs = g.head_dim * E / static_cast<int64_t>(sizeof(Vec));
  for (int64_t i = threadIdx.x; i < g.heads * head_vecs; i += blockDim.x) {
    const int64_t h = i / head_vecs;
    const int64_t v = i % head_vecs;
    Vec* b = reinterpret_cast<Vec*>(buf_row + h * g.head_stride * E) + v;
    Vec* c = reinterpret_cast<Vec*>(chunk_row + h * g.head_dim * E) + v;
    if (to_chunk) {
      *c = *b;
    } else {
      *b = *c;
    }
  }
}

template <typename Vec>
cudaError_t launch(const KVGeometry& g, const int64_t* layer_bases, const int64_t* block_table, char* chunk,
                   bool to_chunk, cudaStream_t stream) {
  const int64_t rows = g.layers * g.kv * g.tokens;
  const int64_t vecs = g.heads * g.head_dim * g.element_size / static_cast<int64_t>(sizeof(Vec));
  // Round up to whole warps, cap at kMaxThreads; threads stride over longer rows.
  const int threads = static_cast<int>(vecs >= kMaxThreads ? kMaxThreads : ((vecs + 31) / 32) * 32);
  kvcopy_kernel<Vec><<<static_cast<unsigned int>(rows), threads, 0, stream>>>(g, layer_bases, block_table, chunk,
                                                                              to_chunk);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_kvcopy_cuda(const KVGeometry& g, const int64_t* layer_bases, const int64_t* block_table,
                               char* chunk, bool to_chunk, int vec_bytes, cudaStream_t stream) {
  if (g.layers * g.kv * g.tokens == 0) return cudaSuccess;
  switch (vec_bytes) {
    case 16:
      return launch<uint4>(g, layer_bases, block_table, chunk, to_chunk, stream);
    case 8:
      return launch<uint2>(g, layer_bases, block_table, chunk, to_chunk, stream);
    case 4:
      return launch<uint32_t>(g, layer_bases, block_table, chunk, to_chunk, stream);
    case 2:
      return launch<uint16_t>(g, layer_bases, block_table, chunk, to_chunk, stream);
    default:
      return launch<uint8_t>(g, layer_bases, block_table, chunk, to_chunk, stream);
  }
}

}  // namespace pdkv
