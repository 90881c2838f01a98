// The chunk checksum on the CPU in one pass at memory speed (kvsum.h has the
// arithmetic; pdkv/checksum.py the definition and the torch path it must
// match bit for bit).
//
// Why native: the torch path reads the bytes once for the row sums, then
// writes and reads the sums and a weight tensor, with a few ops per piece;
// a fragmented block table is first copied together. Here the weights are
// computed per row on the fly, pieces are hashed where they are (a block
// list is read in place), and the work is shared over threads (workshare.h).
// The C ABI returns the accumulator; Python mixes in the length.
#include <cstdio>
#include <string>
#include <vector>

#include "kvcopy.h"
#include "kvsum.h"

namespace pdkv {

namespace {

typedef uint64_t u64x4 __attribute__((vector_size(32)));

template <bool Copy>
inline uint64_t sum_int64_impl(const char* src, char* dst, int64_t n) {
  u64x4 a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // 128 bytes a step; memcpy of a vector is an unaligned load or store
    u64x4 v0, v1, v2, v3;
    const char* p = src + i * 8;
    std::memcpy(&v0, p, 32);
    std::memcpy(&v1, p + 32, 32);
    std::memcpy(&v2, p + 64, 32);
    std::memcpy(&v3, p + 96, 32);
    if (Copy) {
      char* q = dst + i * 8;
      std::memcpy(q, &v0, 32);
      std::memcpy(q + 32, &v1, 32);
      std::memcpy(q + 64, &v2, 32);
      std::memcpy(q + 96, &v3, 32);
    }
    a0 += v0;
    a1 += v1;
    a2 += v2;
    a3 += v3;
  }
  const u64x4 a = (a0 + a1) + (a2 + a3);
  uint64_t s = a[0] + a[1] + a[2] + a[3];
  if (Copy && i < n) std::memcpy(dst + i * 8, src + i * 8, static_cast<size_t>(n - i) * 8);
  for (; i < n; ++i) s += load_word<int64_t>(src + i * 8);
  return s;
}

}  // namespace

__attribute__((target_clones("avx2", "default"))) uint64_t sum_int64(const char* src, char* dst, int64_t n) {
  return dst ? sum_int64_impl<true>(src, dst, n) : sum_int64_impl<false>(src, dst, n);
}

}  // namespace pdkv

namespace {

int fail(int code, const std::string& what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "pdkv checksum: %s", what.c_str());
  return code;
}

}  // namespace

PDKV_API int pdkv_checksum_cpu(const int64_t* ptrs, const int64_t* lens, int64_t n, int64_t unit, uint64_t first_unit,
                               int64_t threads, uint64_t* out, char* err, size_t err_len) {
  if (unit <= 0 || n < 0) return fail(PDKV_EVALUE, "unit must be positive and the piece count non-negative", err, err_len);
  std::vector<pdkv::Segment> segs;
  int64_t off = 0;
  try {
    segs.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (lens[i] < 0 || lens[i] % unit) {
        return fail(PDKV_EVALUE, "piece " + std::to_string(i) + " of " + std::to_string(lens[i]) + " bytes is not whole units of " + std::to_string(unit),
                    err, err_len);
      }
      if (lens[i] && !ptrs[i]) return fail(PDKV_EVALUE, "piece " + std::to_string(i) + " has a null address", err, err_len);
      segs.push_back(pdkv::Segment{reinterpret_cast<const char*>(ptrs[i]), off, lens[i]});
      off += lens[i];
    }
    *out = pdkv::hash_segments(pdkv::Cut(unit), first_unit, segs, threads);
  } catch (const std::exception& e) {  // std::bad_alloc: nothing may unwind through the C ABI
    return fail(PDKV_EVALUE, e.what(), err, err_len);
  }
  return PDKV_OK;
}

PDKV_API int pdkv_checksum_blocks_cpu(const int64_t* bases, int64_t n_bases, const int64_t* ids, int64_t n_ids, int64_t num_blocks,
                                      int64_t block_bytes, int64_t threads, uint64_t* out, char* err, size_t err_len) {
  if (block_bytes <= 0 || n_bases < 0 || n_ids < 0) {
    return fail(PDKV_EVALUE, "block bytes must be positive and the counts non-negative", err, err_len);
  }
  for (int64_t i = 0; i < n_ids; ++i) {
    if (ids[i] < 0 || ids[i] >= num_blocks) {
      return fail(PDKV_EINDEX, "block id " + std::to_string(ids[i]) + " is out of range [0, " + std::to_string(num_blocks) + ")", err, err_len);
    }
  }
  try {
    std::vector<pdkv::Segment> segs;
    segs.reserve(static_cast<size_t>(n_bases * n_ids));
    int64_t off = 0;
    for (int64_t t = 0; t < n_bases; ++t) {
      if (n_ids && !bases[t]) return fail(PDKV_EVALUE, "tensor " + std::to_string(t) + " has a null address", err, err_len);
      for (int64_t i = 0; i < n_ids; ++i, off += block_bytes) {
        segs.push_back(pdkv::Segment{reinterpret_cast<const char*>(bases[t]) + ids[i] * block_bytes, off, block_bytes});
      }
    }
    *out = pdkv::hash_segments(pdkv::Cut(block_bytes), 0, segs, threads);
  } catch (const std::exception& e) {
    return fail(PDKV_EVALUE, e.what(), err, err_len);
  }
  return PDKV_OK;
}
