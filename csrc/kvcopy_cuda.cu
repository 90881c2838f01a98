// CUDA paged gather/scatter for pdkv (the device side of kvcopy.cpp).
//
// Built at install time into its own library, libpdkv_kernels_cuda.so, when
// nvcc is found (setup.py; PDKV_BUILD_CUDA=0 skips it). It is a plain C ABI
// (kvcopy.h) with the CUDA runtime linked in statically: pdkv/native.py loads
// it with ctypes, uploads the layer bases and block table with torch, checks
// the block ids on the host (pdkv_kvcopy_check) and launches on torch's
// current stream with the tensor's device current. tests/test_native.py runs
// the same bit-identity checks on CUDA tensors when a GPU is present.
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
}  // namespace pdkv

PDKV_API int pdkv_kvcopy_cuda(const pdkv::KVGeometry* g_ptr, const int64_t* layer_bases, const int64_t* block_table, char* chunk, int to_chunk_int,
                              int vec_bytes, void* stream_ptr) {
  using namespace pdkv;
  const KVGeometry& g = *g_ptr;
  const bool to_chunk = to_chunk_int != 0;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
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

PDKV_API const char* pdkv_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// How many CUDA devices the runtime linked in here sees, or -(its error code) when it cannot start (a driver older than its toolkit).
PDKV_API int pdkv_cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  return err == cudaSuccess ? count : -static_cast<int>(err);
}
