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
//
// The chunk checksum (pdkv/checksum.py defines it, kvsum.h has its
// arithmetic, shared with the CPU kernels): pdkv_checksum_cuda hashes units
// given by their device addresses, one warp per 4 KiB row, weights computed
// on the fly; pdkv_kvcopy_sum_cuda is the gather/scatter above that also sums
// the chunk's words it moves, weighted by their row, in the same pass. Both
// add their part into one device uint64 (atomicAdd wraps mod 2**64 like the
// definition), which Python reads once.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvcopy.h"
#include "kvsum.h"

namespace pdkv {
namespace {

constexpr int kMaxThreads = 256;

// The checksum's part of one thread's int64 words (each in the chunk's row of its byte offset); added into *sum by
// warp, lane 0 holding the warp's total.
__device__ inline void add_warp_part(uint64_t part, unsigned long long* sum) {
  for (int o = 16; o > 0; o >>= 1) part += __shfl_down_sync(0xffffffffu, part, o);
  if ((threadIdx.x & 31) == 0 && part) atomicAdd(sum, static_cast<unsigned long long>(part));
}

template <typename Vec>
__device__ inline uint64_t vec_words_sum(const Vec& v) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(&v);
  uint64_t s = 0;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec) / 8); ++i) s += w[i];
  return s;
}

// sum != nullptr: also the chunk checksum (one unit, 8-byte words, rows of row_bytes; the host checked that a Vec
// never straddles two rows) of the words moved.
template <typename Vec>
__global__ void kvcopy_kernel(KVGeometry g, const int64_t* __restrict__ layer_bases,
                              const int64_t* __restrict__ block_table, char* __restrict__ chunk, bool to_chunk,
                              unsigned long long* sum, int64_t row_bytes, int row_shift) {
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
  uint64_t part = 0;
  for (int64_t i = threadIdx.x; i < g.heads * head_vecs; i += blockDim.x) {
    const int64_t h = i / head_vecs;
    const int64_t v = i % head_vecs;
    Vec* b = reinterpret_cast<Vec*>(buf_row + h * g.head_stride * E) + v;
    Vec* c = reinterpret_cast<Vec*>(chunk_row + h * g.head_dim * E) + v;
    const Vec x = to_chunk ? *b : *c;
    if (to_chunk) {
      *c = x;
    } else {
      *b = x;
    }
    if (sum != nullptr) {
      const int64_t at = reinterpret_cast<char*>(c) - chunk;
      const int64_t r = row_shift >= 0 ? at >> row_shift : at / row_bytes;  // 4 KiB rows: a shift, not a division
      part += row_weight(0, static_cast<uint64_t>(r)) * vec_words_sum(x);
    }
  }
  if (sum != nullptr) add_warp_part(part, sum);
}

// One warp per row of the units at unit_ptrs[j] (row k of the stream: unit k / rows, row k % rows).
template <typename T>
__global__ void checksum_kernel(const int64_t* __restrict__ unit_ptrs, int64_t n_units, Cut c, uint64_t first_unit,
                                unsigned long long* sum) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t rows = c.rows();
  uint64_t part = 0;
  for (int64_t k = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; k < n_units * rows; k += warps) {
    const int64_t j = k / rows;
    const int64_t r = k % rows;
    const T* words = reinterpret_cast<const T*>(unit_ptrs[j]) + r * c.row;
    const int64_t n = (r + 1) * c.row < c.words ? c.row : c.words - r * c.row;
    uint64_t s = 0;
#pragma unroll 4
    for (int64_t i = lane; i < n; i += 32) s += static_cast<uint64_t>(static_cast<int64_t>(words[i]));
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    if (lane == 0) part += row_weight(first_unit + static_cast<uint64_t>(j), static_cast<uint64_t>(r)) * s;
  }
  if (lane == 0 && part) atomicAdd(sum, static_cast<unsigned long long>(part));
}

template <typename Vec>
cudaError_t launch(const KVGeometry& g, const int64_t* layer_bases, const int64_t* block_table, char* chunk,
                   bool to_chunk, cudaStream_t stream, unsigned long long* sum, int64_t row_bytes) {
  int row_shift = -1;  // log2(row_bytes) when it is a power of two
  for (int b = 0; b < 62 && row_shift < 0; ++b) {
    if (row_bytes == (int64_t{1} << b)) row_shift = b;
  }
  const int64_t rows = g.layers * g.kv * g.tokens;
  const int64_t vecs = g.heads * g.head_dim * g.element_size / static_cast<int64_t>(sizeof(Vec));
  // Round up to whole warps, cap at kMaxThreads; threads stride over longer rows.
  const int threads = static_cast<int>(vecs >= kMaxThreads ? kMaxThreads : ((vecs + 31) / 32) * 32);
  kvcopy_kernel<Vec><<<static_cast<unsigned int>(rows), threads, 0, stream>>>(g, layer_bases, block_table, chunk,
                                                                              to_chunk, sum, row_bytes, row_shift);
  return cudaGetLastError();
}

int kvcopy(const KVGeometry& g, const int64_t* layer_bases, const int64_t* block_table, char* chunk, bool to_chunk,
           int vec_bytes, cudaStream_t stream, unsigned long long* sum, int64_t row_bytes) {
  if (g.layers * g.kv * g.tokens == 0) return cudaSuccess;
  switch (vec_bytes) {
    case 16:
      return launch<uint4>(g, layer_bases, block_table, chunk, to_chunk, stream, sum, row_bytes);
    case 8:
      return launch<uint2>(g, layer_bases, block_table, chunk, to_chunk, stream, sum, row_bytes);
    case 4:
      return launch<uint32_t>(g, layer_bases, block_table, chunk, to_chunk, stream, nullptr, 0);
    case 2:
      return launch<uint16_t>(g, layer_bases, block_table, chunk, to_chunk, stream, nullptr, 0);
    default:
      return launch<uint8_t>(g, layer_bases, block_table, chunk, to_chunk, stream, nullptr, 0);
  }
}

template <typename T>
cudaError_t launch_checksum(const int64_t* unit_ptrs, int64_t n_units, const Cut& c, uint64_t first_unit,
                            unsigned long long* sum, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t warps = n_units * c.rows();
  constexpr int kWarps = kMaxThreads / 32;
  const int64_t blocks = std::min<int64_t>((warps + kWarps - 1) / kWarps, static_cast<int64_t>(sms) * 16);
  checksum_kernel<T><<<static_cast<unsigned int>(blocks), kMaxThreads, 0, stream>>>(unit_ptrs, n_units, c, first_unit, sum);
  return cudaGetLastError();
}

}  // namespace
}  // namespace pdkv

PDKV_API int pdkv_kvcopy_cuda(const pdkv::KVGeometry* g_ptr, const int64_t* layer_bases, const int64_t* block_table, char* chunk, int to_chunk_int,
                              int vec_bytes, void* stream_ptr) {
  return pdkv::kvcopy(*g_ptr, layer_bases, block_table, chunk, to_chunk_int != 0, vec_bytes, static_cast<cudaStream_t>(stream_ptr), nullptr, 0);
}

PDKV_API int pdkv_kvcopy_sum_cuda(const pdkv::KVGeometry* g_ptr, const int64_t* layer_bases, const int64_t* block_table, char* chunk,
                                  int to_chunk_int, int vec_bytes, void* stream_ptr, uint64_t* sum) {
  using namespace pdkv;
  const KVGeometry& g = *g_ptr;
  const Cut c(g.layers * g.kv * g.tokens * g.heads * g.head_dim * g.element_size);
  if ((vec_bytes != 8 && vec_bytes != 16) || c.word != 8 || (c.row * 8) % vec_bytes) return -1;  // not fusable here
  return kvcopy(g, layer_bases, block_table, chunk, to_chunk_int != 0, vec_bytes, static_cast<cudaStream_t>(stream_ptr),
                reinterpret_cast<unsigned long long*>(sum), c.row * 8);
}

PDKV_API int pdkv_checksum_cuda(const int64_t* unit_ptrs, int64_t n_units, int64_t unit, uint64_t first_unit, uint64_t* sum,
                                void* stream_ptr) {
  using namespace pdkv;
  if (unit <= 0 || n_units <= 0) return n_units == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const Cut c(unit);
  auto* out = reinterpret_cast<unsigned long long*>(sum);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (c.word) {
    case 8:
      return launch_checksum<int64_t>(unit_ptrs, n_units, c, first_unit, out, stream);
    case 4:
      return launch_checksum<int32_t>(unit_ptrs, n_units, c, first_unit, out, stream);
    case 2:
      return launch_checksum<int16_t>(unit_ptrs, n_units, c, first_unit, out, stream);
    default:
      return launch_checksum<uint8_t>(unit_ptrs, n_units, c, first_unit, out, stream);
  }
}

PDKV_API const char* pdkv_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// How many CUDA devices the runtime linked in here sees, or -(its error code) when it cannot start (a driver older than its toolkit).
PDKV_API int pdkv_cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  return err == cudaSuccess ? count : -static_cast<int>(err);
}
