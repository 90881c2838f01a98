// Geometry and C ABI of the paged gather/scatter: the CPU copy (kvcopy.cpp,
// in libpdkv_kernels.so) and the CUDA kernel (kvcopy_cuda.cu, in
// libpdkv_kernels_cuda.so). No torch headers: both libraries are plain
// shared objects built at install time (setup.py) and loaded with ctypes by
// pdkv/native.py, which passes data pointers, sizes and strides taken from
// the tensors. The struct is mirrored field by field there (KVGeometry).
// The tcp channel's socket and landing functions, in the same library, have
// their own header: kvnet.h.
#pragma once

#include <cstddef>
#include <cstdint>

#define PDKV_API extern "C" __attribute__((visibility("default")))

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

// Return codes of the C ABI; on an error the message is written to `err`.
#define PDKV_OK 0
#define PDKV_EINDEX 1  // a block id or the block table's length (Python: IndexError)
#define PDKV_EVALUE 2  // any other bad argument (Python: ValueError)

// CPU gather (to_chunk != 0: buffer -> chunk) or scatter. layer_bases[l] is
// layer l's base address (cross-layer buffers: the one tensor's base plus l
// layers); block_table holds table_len block ids, each used one is checked
// against [0, num_blocks). Runs on up to `threads` threads.
PDKV_API int pdkv_kvcopy_cpu(const pdkv::KVGeometry* g, char* const* layer_bases, const int64_t* block_table, int64_t table_len,
                             int64_t num_blocks, char* chunk, int to_chunk, int64_t threads, char* err, size_t err_len);

// The same copy, also hashing the chunk (one unit: the staged frame's
// checksum, pdkv/checksum.py) in the same pass; *sum gets the checksum's
// accumulator (before the length is mixed in).
PDKV_API int pdkv_kvcopy_sum_cpu(const pdkv::KVGeometry* g, char* const* layer_bases, const int64_t* block_table, int64_t table_len,
                                 int64_t num_blocks, char* chunk, int to_chunk, int64_t threads, uint64_t* sum, char* err, size_t err_len);

// The checksum's accumulator (kvsum.cpp) of n pieces (addresses, lengths in
// bytes, each whole units of `unit` bytes) hashed as one stream whose unit 0
// has unit index first_unit; and of the blocks ids[] (each checked against
// [0, num_blocks)) of every tensor base in turn, units of block_bytes.
PDKV_API int pdkv_checksum_cpu(const int64_t* ptrs, const int64_t* lens, int64_t n, int64_t unit, uint64_t first_unit, int64_t threads,
                               uint64_t* out, char* err, size_t err_len);
PDKV_API int pdkv_checksum_blocks_cpu(const int64_t* bases, int64_t n_bases, const int64_t* ids, int64_t n_ids, int64_t num_blocks,
                                      int64_t block_bytes, int64_t threads, uint64_t* out, char* err, size_t err_len);

// CUDA: launch the same copy on `stream` (a cudaStream_t). layer_bases and
// block_table are host arrays (table_len ids, already checked by
// pdkv_kvcopy_check); the kernel gets the chunk's slice of them in its
// parameters, or in stream-ordered device memory when they do not fit.
// vec_bytes (16, 8, 4, 2 or 1) is the widest load/store every row start is
// aligned to. Returns the cudaError_t of the launch; the copy itself is
// asynchronous on the stream.
PDKV_API int pdkv_kvcopy_cuda(const pdkv::KVGeometry* g, const int64_t* layer_bases, const int64_t* block_table,
                              int64_t table_len, char* chunk, int to_chunk, int vec_bytes, void* stream);
// The same copy, also adding the chunk's checksum accumulator (one unit) into
// *sum, a device uint64 the caller zeroed; -1 (launching nothing) where the
// chunk's words are not 8 bytes or a vector of vec_bytes could straddle two
// of its rows: the caller hashes after the copy then.
PDKV_API int pdkv_kvcopy_sum_cuda(const pdkv::KVGeometry* g, const int64_t* layer_bases, const int64_t* block_table,
                                  int64_t table_len, char* chunk, int to_chunk, int vec_bytes, void* stream,
                                  uint64_t* sum);
// The checksum accumulator of n_units units of `unit` bytes at the device
// addresses unit_ptrs[] (a device array; each aligned to the unit's word
// size), unit index first_unit + j, added into *sum on `stream`.
PDKV_API int pdkv_checksum_cuda(const int64_t* unit_ptrs, int64_t n_units, int64_t unit, uint64_t first_unit, uint64_t* sum,
                                void* stream);
PDKV_API const char* pdkv_cuda_error_string(int code);
PDKV_API int pdkv_cuda_device_count();  // or -(the cudaError_t) when the runtime cannot start here

// The host-side checks of pdkv_kvcopy_cpu without the copy (the CUDA path's guard).
PDKV_API int pdkv_kvcopy_check(const pdkv::KVGeometry* g, const int64_t* block_table, int64_t table_len, int64_t num_blocks, char* err,
                               size_t err_len);
