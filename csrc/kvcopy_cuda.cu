// CUDA paged gather/scatter for pdkv (the device side of kvcopy.cpp).
//
// Built at install time into its own library, libpdkv_kernels_cuda.so, when
// nvcc is found (setup.py; PDKV_BUILD_CUDA=0 skips it). It is a plain C ABI
// (kvcopy.h) with the CUDA runtime linked in statically: pdkv/native.py loads
// it with ctypes, checks the block ids on the host (pdkv_kvcopy_check) and
// launches on torch's current stream with the tensor's device current.
// tests/gpu/check.py runs it against the torch path on a GPU, bit for bit.
//
// Each thread block copies a few whole (layer, kv, token) rows of heads *
// head_dim elements (enough for 8 vectors per thread), in the widest aligned
// vector, so the paged side and the chunk side see coalesced 16-byte accesses
// for common shapes (head_dim * element_size a multiple of 16). Where a row
// starts is worked out once per row (64-bit), by one thread, into shared
// memory; the per-vector index math is 32-bit, and each thread has all its
// loads in flight before its first store. The layer bases and the chunk's
// slice of the block table travel inside the kernel's parameters (no upload,
// no device allocation) when they fit, which they do for any chunk of up to
// kInlineTable blocks of up to kInlineLayers layers; otherwise they are copied
// to stream-ordered device memory first. Block ids were bounds checked on the
// host (pdkv_kvcopy_check) before launch.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kvcopy.h"

namespace pdkv {
namespace {

constexpr int kThreads = 256;
constexpr int kVecsPerThread = 8;  // per block: kThreads * kVecsPerThread vectors, in whole rows
constexpr int kMaxRowsPerBlock = 64;
constexpr int kInlineLayers = 128;
constexpr int kInlineTable = 512;

// The layer bases and block table inside the kernel's parameter space (about 3 KiB, under the 4 KiB limit).
struct InlineTables {
  int64_t bases[kInlineLayers];
  int32_t table[kInlineTable];
  __device__ int64_t base(int64_t layer) const { return bases[layer]; }
  __device__ int64_t block(int64_t index) const { return table[index]; }
};

// The same in device memory, for the rare chunk that does not fit inline.
struct DeviceTables {
  const int64_t* bases;
  const int64_t* table;
  __device__ int64_t base(int64_t layer) const { return bases[layer]; }
  __device__ int64_t block(int64_t index) const { return table[index]; }
};

template <typename Tables>
struct Args {
  KVGeometry g;
  int64_t table_first;  // block-table index of tables.table[0]
  int64_t rows;         // layers * kv * tokens
  int32_t rows_per_block;
  int32_t row_vecs;   // vectors in one row (heads * head_vecs)
  int32_t head_vecs;  // vectors in one head's head_dim elements
  char* chunk;
  bool to_chunk;
  Tables tables;
};

template <typename Vec, typename Tables>
__global__ void __launch_bounds__(kThreads) kvcopy_kernel(const __grid_constant__ Args<Tables> a) {
  __shared__ char* row_buf[kMaxRowsPerBlock];
  const KVGeometry& g = a.g;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * a.rows_per_block;
  const int rows_here = static_cast<int>(a.rows - row0 < a.rows_per_block ? a.rows - row0 : a.rows_per_block);
  if (threadIdx.x < rows_here) {
    const int64_t row = row0 + threadIdx.x;  // == (layer * kv + k) * tokens + t, the chunk's row index
    const int64_t t = row % g.tokens;
    const int64_t lk = row / g.tokens;
    const int64_t pos = g.start + t;
    const int64_t block = a.tables.block(pos / g.block_size - a.table_first);
    row_buf[threadIdx.x] = reinterpret_cast<char*>(a.tables.base(lk / g.kv)) +
                           (block * g.block_stride + (lk % g.kv) * g.kv_stride + (pos % g.block_size) * g.token_stride) *
                               g.element_size;
  }
  __syncthreads();
  Vec* chunk = reinterpret_cast<Vec*>(a.chunk) + row0 * a.row_vecs;  // the chunk side is contiguous
  const uint32_t total = static_cast<uint32_t>(rows_here) * static_cast<uint32_t>(a.row_vecs);
  const int64_t head_bytes = g.head_stride * g.element_size;
  for (uint32_t first = threadIdx.x; first < total; first += kThreads * kVecsPerThread) {
    Vec v[kVecsPerThread];
    Vec* dst[kVecsPerThread];
#pragma unroll
    for (int u = 0; u < kVecsPerThread; ++u) {
      const uint32_t e = first + u * kThreads;
      if (e < total) {
        const uint32_t r = e / a.row_vecs;
        const uint32_t j = e - r * a.row_vecs;
        const uint32_t h = j / a.head_vecs;
        Vec* paged = reinterpret_cast<Vec*>(row_buf[r] + h * head_bytes) + (j - h * a.head_vecs);
        Vec* flat = chunk + e;
        v[u] = a.to_chunk ? *paged : *flat;
        dst[u] = a.to_chunk ? flat : paged;
      }
    }
#pragma unroll
    for (int u = 0; u < kVecsPerThread; ++u) {
      if (first + u * kThreads < total) *dst[u] = v[u];
    }
  }
}

template <typename Vec, typename Tables>
cudaError_t launch(Args<Tables>& a, cudaStream_t stream) {
  a.head_vecs = static_cast<int32_t>(a.g.head_dim * a.g.element_size / static_cast<int64_t>(sizeof(Vec)));
  a.row_vecs = static_cast<int32_t>(a.g.heads) * a.head_vecs;
  const int64_t want = kThreads * kVecsPerThread / (a.row_vecs > 0 ? a.row_vecs : 1);
  a.rows_per_block = static_cast<int32_t>(want < 1 ? 1 : (want > kMaxRowsPerBlock ? kMaxRowsPerBlock : want));
  const int64_t blocks = (a.rows + a.rows_per_block - 1) / a.rows_per_block;
  kvcopy_kernel<Vec, Tables><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename Tables>
cudaError_t dispatch(Args<Tables>& a, int vec_bytes, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      return launch<uint4>(a, stream);
    case 8:
      return launch<uint2>(a, stream);
    case 4:
      return launch<uint32_t>(a, stream);
    case 2:
      return launch<uint16_t>(a, stream);
    default:
      return launch<uint8_t>(a, stream);
  }
}

}  // namespace
}  // namespace pdkv

PDKV_API int pdkv_kvcopy_cuda(const pdkv::KVGeometry* g_ptr, const int64_t* layer_bases, const int64_t* block_table,
                              int64_t table_len, char* chunk, int to_chunk_int, int vec_bytes, void* stream_ptr) {
  using namespace pdkv;
  const KVGeometry& g = *g_ptr;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t rows = g.layers * g.kv * g.tokens;
  if (rows == 0) return cudaSuccess;
  const int64_t first = g.start / g.block_size;
  const int64_t used = (g.start + g.tokens - 1) / g.block_size - first + 1;
  // The per-block index math is 32-bit: a block's rows hold far fewer vectors, and a row's count must fit.
  if (g.heads * g.head_dim * g.element_size > (int64_t{1} << 30) || first + used > table_len) {
    return cudaErrorInvalidValue;
  }
  bool inline_fits = g.layers <= kInlineLayers && used <= kInlineTable;
  for (int64_t i = 0; inline_fits && i < used; ++i) inline_fits = block_table[first + i] <= INT32_MAX;
  if (inline_fits) {
    Args<InlineTables> a{};
    a.g = g;
    a.table_first = first;
    a.rows = rows;
    a.chunk = chunk;
    a.to_chunk = to_chunk_int != 0;
    for (int64_t l = 0; l < g.layers; ++l) a.tables.bases[l] = layer_bases[l];
    for (int64_t i = 0; i < used; ++i) a.tables.table[i] = static_cast<int32_t>(block_table[first + i]);
    return dispatch(a, vec_bytes, stream);
  }
  // Too many layers or blocks for the parameter space: stream-ordered device copies of both, freed in order.
  Args<DeviceTables> a{};
  a.g = g;
  a.table_first = first;
  a.rows = rows;
  a.chunk = chunk;
  a.to_chunk = to_chunk_int != 0;
  int64_t* dev = nullptr;
  const size_t bytes = static_cast<size_t>(g.layers + used) * sizeof(int64_t);
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes, stream);
  if (err != cudaSuccess) return err;
  // From pageable host memory: the copies are staged before they return, so the caller's arrays may go.
  err = cudaMemcpyAsync(dev, layer_bases, g.layers * sizeof(int64_t), cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(dev + g.layers, block_table + first, used * sizeof(int64_t), cudaMemcpyHostToDevice, stream);
  }
  if (err == cudaSuccess) {
    a.tables.bases = dev;
    a.tables.table = dev + g.layers;
    err = dispatch(a, vec_bytes, stream);
  }
  const cudaError_t freed = cudaFreeAsync(dev, stream);
  return err != cudaSuccess ? err : freed;
}

PDKV_API const char* pdkv_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// How many CUDA devices the runtime linked in here sees, or -(its error code) when it cannot start (a driver older than its toolkit).
PDKV_API int pdkv_cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  return err == cudaSuccess ? count : -static_cast<int>(err);
}
