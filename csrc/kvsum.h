// The chunk checksum's arithmetic (pdkv/checksum.py's docstring is the
// definition), for the CPU kernels: the standalone checksum (kvsum.cpp) and
// the gather/scatter that hash the chunk while copying it (kvcopy.cpp).
//
// A stream of bytes is cut into units of `unit` bytes, each unit into words
// (8 bytes, or the largest of 4, 2, 1 dividing the unit: int64, int32, int16
// signed, uint8 unsigned) and the words into rows of min(512, max(1, words/16)).
// The checksum's accumulator is sum over rows of weight(unit j, row r) *
// rowsum, all mod 2**64, with weight = f(j) * g(r), f(j) = (j*golden + salt1)|1,
// g(r) = (r*golden + salt2)|1. It is linear in the rows, so any word-aligned
// byte range of the stream can be hashed on its own (given its offset in the
// stream) and the parts added: that is what lets threads split the work and
// the copy kernels hash each run of the chunk as they move it.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "workshare.h"

// The weights and the cut are shared with the CUDA kernels (kvcopy_cuda.cu): host and device functions there.
#ifdef __CUDACC__
#define PDKV_HD __host__ __device__
#else
#define PDKV_HD
#endif

namespace pdkv {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kUnitSalt = 0x2545F4914F6CDD1Dull;
constexpr uint64_t kRowSalt = 0x7F4A7C159E3779B9ull;
constexpr int64_t kRowWords = 512;

// How a unit is cut (checksum.py's _cut).
struct Cut {
  PDKV_HD explicit Cut(int64_t unit_) : unit(unit_) {
    word = unit % 8 == 0 ? 8 : unit % 4 == 0 ? 4 : unit % 2 == 0 ? 2 : 1;
    words = unit / word;
    const int64_t r = words / 16;
    row = r < 1 ? 1 : (r > kRowWords ? kRowWords : r);
  }
  PDKV_HD int64_t rows() const { return (words + row - 1) / row; }  // a unit's, its last one shorter when they do not divide
  int64_t unit, word, words, row;
};

PDKV_HD inline uint64_t row_weight(uint64_t j, uint64_t r) { return ((j * kGolden + kUnitSalt) | 1) * ((r * kGolden + kRowSalt) | 1); }

// A word's value as the torch path sums it: int64 of the signed int64/32/16 word, or of the unsigned byte.
template <typename T>
inline uint64_t load_word(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return static_cast<uint64_t>(static_cast<int64_t>(v));
}

// Sum of n int64 words at src (unsigned: wraps mod 2**64 like torch's int64 sum), copied to dst too when dst is
// not null: 32-byte vectors, four accumulators, AVX2 where the CPU has it (target_clones picks at load time; the
// build targets baseline x86-64). Defined in kvsum.cpp.
uint64_t sum_int64(const char* src, char* dst, int64_t n);

// The same for narrower words (a unit whose size is not a multiple of 8: rare, so plain loops).
template <typename T, bool Copy>
inline uint64_t sum_words(const char* src, char* dst, int64_t n) {
  if (sizeof(T) == 8) return sum_int64(src, Copy ? dst : nullptr, n);
  uint64_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += load_word<T>(src + i * sizeof(T));
  if (Copy) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
  return s;
}

// The accumulator's part from the bytes [src, src+len) that sit at byte `off` of the stream, unit `first_unit`
// of the stream being its unit 0; copies them to dst as well when Copy (dst may alias nothing of src).
// off and len are multiples of the word size (callers check).
template <typename T, bool Copy>
uint64_t hash_range_t(const Cut& c, uint64_t first_unit, int64_t off, const char* src, char* dst, int64_t len) {
  constexpr int64_t W = static_cast<int64_t>(sizeof(T));
  const int64_t rows = c.rows();
  const int64_t word = off % c.unit / W;
  uint64_t j = first_unit + static_cast<uint64_t>(off / c.unit);
  int64_t r = word / c.row;
  int64_t in_row = word - r * c.row;
  uint64_t acc = 0;
  // Row by row with no division in the loop: a row is at most 4 KiB, so per-row work must stay a few cycles.
  for (int64_t left = len / W; left > 0;) {
    const int64_t row_len = r + 1 < rows ? c.row : c.words - r * c.row;
    const int64_t n = row_len - in_row < left ? row_len - in_row : left;
    acc += row_weight(j, static_cast<uint64_t>(r)) * sum_words<T, Copy>(src, dst, n);
    src += n * W;
    if (Copy) dst += n * W;
    left -= n;
    in_row += n;
    if (in_row == row_len) {
      in_row = 0;
      if (++r == rows) {
        r = 0;
        ++j;
      }
    }
  }
  return acc;
}

template <bool Copy>
inline uint64_t hash_range(const Cut& c, uint64_t first_unit, int64_t off, const char* src, char* dst, int64_t len) {
  switch (c.word) {
    case 8:
      return hash_range_t<int64_t, Copy>(c, first_unit, off, src, dst, len);
    case 4:
      return hash_range_t<int32_t, Copy>(c, first_unit, off, src, dst, len);
    case 2:
      return hash_range_t<int16_t, Copy>(c, first_unit, off, src, dst, len);
    default:
      return hash_range_t<uint8_t, Copy>(c, first_unit, off, src, dst, len);
  }
}

// A word-aligned piece of the stream: its bytes and where they sit in it.
struct Segment {
  const char* data;
  int64_t off;
  int64_t len;
};

// The accumulator of a stream given as segments, on up to `threads` threads: segments longer than grain bytes
// are cut (at multiples of grain, which every word size divides) so one big piece still spreads over threads.
inline uint64_t hash_segments(const Cut& c, uint64_t first_unit, const std::vector<Segment>& pieces, int64_t threads) {
  constexpr int64_t kGrain = 256 * 1024;
  auto segs = std::make_shared<std::vector<Segment>>();
  int64_t total = 0;
  for (const Segment& s : pieces) {
    for (int64_t at = 0; at < s.len; at += kGrain) {
      segs->push_back(Segment{s.data + at, s.off + at, s.len - at < kGrain ? s.len - at : kGrain});
    }
    total += s.len;
  }
  if (segs->empty()) return 0;
  const int64_t n = static_cast<int64_t>(segs->size());
  const int64_t batch = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, total / n));
  auto acc = std::make_shared<std::atomic<uint64_t>>(0);
  share_work(n, batch, threads, [segs, acc, c, first_unit](int64_t begin, int64_t end) {
    uint64_t part = 0;
    for (int64_t i = begin; i < end; ++i) {
      const Segment& s = (*segs)[i];
      part += hash_range<false>(c, first_unit, s.off, s.data, nullptr, s.len);
    }
    acc->fetch_add(part, std::memory_order_relaxed);  // unsigned: wraps mod 2**64, in any order
  });
  return acc->load();
}

}  // namespace pdkv
