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
//
// The chunk checksum (pdkv/checksum.py defines it, kvsum.h has its
// arithmetic, shared with the CPU kernels): pdkv_checksum_cuda hashes units
// given by their device addresses, one warp per 4 KiB row, weights computed
// on the fly; pdkv_kvcopy_sum_cuda is the gather/scatter above that also sums
// the chunk's words it moves, weighted by their row, in the same pass. Both
// add their part into one device uint64 (atomicAdd wraps mod 2**64 like the
// definition; one atomic per thread block or per warp), which Python reads once.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kvcopy.h"
#include "kvsum.h"

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
  unsigned long long* sum;  // not null: also add the chunk's checksum accumulator here (one unit, 8-byte words)
  int64_t sum_row_bytes;    // the checksum's row, in bytes (a multiple of the vector: none straddles two rows)
  int32_t sum_row_shift;    // log2 of sum_row_bytes where it is a power of two (4 KiB rows: any chunk >= 64 KiB), else -1
  Tables tables;
};

template <typename Vec>
__device__ inline uint64_t vec_words_sum(const Vec& v) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(&v);
  uint64_t s = 0;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec) / 8); ++i) s += w[i];
  return s;
}

// A block's checksum parts into *sum: warps by shuffle, then one atomicAdd for the block (called by every thread).
__device__ inline void add_block_part(uint64_t part, unsigned long long* sum) {
  __shared__ uint64_t warp_parts[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) part += __shfl_down_sync(0xffffffffu, part, o);
  if ((threadIdx.x & 31) == 0) warp_parts[threadIdx.x / 32] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_parts[w];
    if (total) atomicAdd(sum, static_cast<unsigned long long>(total));
  }
}

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
  const uint64_t chunk_off = static_cast<uint64_t>(row0) * a.row_vecs * sizeof(Vec);  // this block's first byte
  uint64_t part = 0;
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
      const uint32_t e = first + u * kThreads;
      if (e < total) {
        *dst[u] = v[u];
        if (a.sum != nullptr) {
          const uint64_t byte = chunk_off + static_cast<uint64_t>(e) * sizeof(Vec);
          const uint64_t row = a.sum_row_shift >= 0 ? byte >> a.sum_row_shift : byte / a.sum_row_bytes;
          part += row_weight(0, row) * vec_words_sum(v[u]);
        }
      }
    }
  }
  if (a.sum != nullptr) add_block_part(part, a.sum);  // uniform over the block: every thread calls it
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

namespace pdkv {
namespace {

// The gather/scatter's launch from host arrays (see the top of this file), with or without the fused checksum.
int32_t log2_or_minus1(int64_t n) {
  if (n <= 0 || (n & (n - 1))) return -1;
  int32_t shift = 0;
  while ((int64_t{1} << shift) < n) ++shift;
  return shift;
}

// Everything of a launch's arguments but its tables (the caller fills those in).
template <typename Tables>
Args<Tables> make_args(const KVGeometry& g, int64_t first, int64_t rows, char* chunk, bool to_chunk,
                       unsigned long long* sum, int64_t sum_row_bytes) {
  Args<Tables> a{};
  a.g = g;
  a.table_first = first;
  a.rows = rows;
  a.chunk = chunk;
  a.to_chunk = to_chunk;
  a.sum = sum;
  a.sum_row_bytes = sum_row_bytes;
  a.sum_row_shift = log2_or_minus1(sum_row_bytes);
  return a;
}

int kvcopy(const KVGeometry& g, const int64_t* layer_bases, const int64_t* block_table, int64_t table_len, char* chunk,
           bool to_chunk, int vec_bytes, cudaStream_t stream, unsigned long long* sum, int64_t sum_row_bytes) {
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
    auto a = make_args<InlineTables>(g, first, rows, chunk, to_chunk, sum, sum_row_bytes);
    for (int64_t l = 0; l < g.layers; ++l) a.tables.bases[l] = layer_bases[l];
    for (int64_t i = 0; i < used; ++i) a.tables.table[i] = static_cast<int32_t>(block_table[first + i]);
    return dispatch(a, vec_bytes, stream);
  }
  // Too many layers or blocks for the parameter space: stream-ordered device copies of both, freed in order.
  auto a = make_args<DeviceTables>(g, first, rows, chunk, to_chunk, sum, sum_row_bytes);
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

template <typename T>
cudaError_t launch_checksum(const int64_t* unit_ptrs, int64_t n_units, const Cut& c, uint64_t first_unit,
                            unsigned long long* sum, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t warps = n_units * c.rows();
  constexpr int kWarps = kThreads / 32;
  const int64_t blocks = std::min<int64_t>((warps + kWarps - 1) / kWarps, static_cast<int64_t>(sms) * 16);
  checksum_kernel<T><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(unit_ptrs, n_units, c, first_unit, sum);
  return cudaGetLastError();
}

}  // namespace
}  // namespace pdkv

PDKV_API int pdkv_kvcopy_cuda(const pdkv::KVGeometry* g_ptr, const int64_t* layer_bases, const int64_t* block_table,
                              int64_t table_len, char* chunk, int to_chunk_int, int vec_bytes, void* stream_ptr) {
  return pdkv::kvcopy(*g_ptr, layer_bases, block_table, table_len, chunk, to_chunk_int != 0, vec_bytes,
                      static_cast<cudaStream_t>(stream_ptr), nullptr, 0);
}

PDKV_API int pdkv_kvcopy_sum_cuda(const pdkv::KVGeometry* g_ptr, const int64_t* layer_bases, const int64_t* block_table,
                                  int64_t table_len, char* chunk, int to_chunk_int, int vec_bytes, void* stream_ptr,
                                  uint64_t* sum) {
  using namespace pdkv;
  const KVGeometry& g = *g_ptr;
  const Cut c(g.layers * g.kv * g.tokens * g.heads * g.head_dim * g.element_size);
  if ((vec_bytes != 8 && vec_bytes != 16) || c.word != 8 || (c.row * 8) % vec_bytes) return -1;  // not fusable here
  return kvcopy(g, layer_bases, block_table, table_len, chunk, to_chunk_int != 0, vec_bytes,
                static_cast<cudaStream_t>(stream_ptr), reinterpret_cast<unsigned long long*>(sum), c.row * 8);
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
