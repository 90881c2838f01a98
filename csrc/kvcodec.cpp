// Native kernels of the KV codecs (pdkv/codec): byte planes, and the fp8 and
// uint8 quantizers, one pass over the chunk each.
//
// Why native: the torch path (pdkv/codec/kernels.py) takes several passes and
// temporaries per step (abs, max, scale, convert), and torch's CPU
// float8 -> float32 conversion is scalar: together 0.2-0.5 GB/s on one core
// against the 1.25 GB/s a 10 Gbit link needs. Each kernel here produces the
// same bytes as its torch twin (same float operations in the same order; the
// build passes -ffp-contract=off so no product and sum fuse into one rounding,
// and -fno-trapping-math so the selects below become vector blends, not branches),
// so either side of a transfer may run either path; tests/test_codec.py
// checks both give identical frames and identical decoded values.
//
// Safety: pdkv/codec/kernels.py validates the tensors (dtype, device,
// contiguity, shapes) and passes pointers, sizes and strides; the sizes that
// decide an address are checked again here.
//
// A plain C ABI (PDKV_API below), no torch headers: the element types are
// this file's own bfloat16 and float16, converting exactly as c10's (round to
// nearest even; a NaN becomes the canonical quiet NaN), and the fp8 table
// comes from torch itself (the caller passes it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvcopy.h"
#include "workshare.h"

// The loops below are compiled for AVX-512, AVX2 and the baseline, picked at
// load time by the CPU (GCC/Clang function multiversioning): the extension is
// built without -march, so this is how the wider vectors get used. The
// arithmetic is the same IEEE float math on every path: identical results.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PDKV_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PDKV_VECTOR_CLONES
#endif

namespace pdkv {
namespace {

constexpr int64_t kGrainElements = 64 * 1024;
constexpr int kExpMin = -126;  // 2^e stays a normal float
constexpr int kExpMax = 119;   // 448 * 2^e stays finite
constexpr float kFp8Max = 448.0f;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bfloat16: the top half of a float32, rounded to nearest even (c10::BFloat16's rule).
struct BFloat16 {
  uint16_t x;
  BFloat16() = default;
  explicit BFloat16(float f) {
    const uint32_t u = bits_of(f);
    const uint16_t rounded = static_cast<uint16_t>((u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16);
    x = f != f ? UINT16_C(0x7FC0) : rounded;
  }
  operator float() const { return float_of(static_cast<uint32_t>(x) << 16); }
};

// IEEE float16, converted without branches (the scheme of the FP16 library that c10::Half uses).
struct Half {
  uint16_t x;
  Half() = default;
  explicit Half(float f) {
    const float scale_to_inf = float_of(UINT32_C(0x77800000));   // 2^112
    const float scale_to_zero = float_of(UINT32_C(0x08800000));  // 2^-110
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = bits_of(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    bias = bias < UINT32_C(0x71000000) ? UINT32_C(0x71000000) : bias;
    base = float_of((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t b = bits_of(base);
    const uint32_t nonsign = ((b >> 13) & UINT32_C(0x00007C00)) + (b & UINT32_C(0x00000FFF));
    x = static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
  }
  operator float() const {
    const uint32_t w = static_cast<uint32_t>(x) << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (UINT32_C(0xE0) << 23)) * float_of(UINT32_C(0x7800000));  // * 2^-112
    const float denormalized = float_of((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
    return float_of(sign | (two_w < (UINT32_C(1) << 27) ? bits_of(denormalized) : bits_of(normalized)));
  }
};

// Element types of the values, as pdkv/codec/kernels.py numbers them.
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Runs fn(T{}) with T the element type of `dtype`; false for an unknown code.
template <class F>
bool dispatch(int dtype, F fn) {
  switch (dtype) {
    case kFloat32: fn(float{}); return true;
    case kBFloat16: fn(BFloat16{}); return true;
    case kFloat16: fn(Half{}); return true;
    default: return false;
  }
}

// 2^e as a float, exactly, for e in [kExpMin, kExpMax + 9].
inline float pow2(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> e4m3fn bits, round to nearest even, exactly as c10's
// fp8e4m3fn_from_fp32_value (torch's own conversion) but without branches, so
// the compiler vectorizes the loop: both candidate results are computed and
// one is selected. Beyond the range: saturate to 448 (0x7e), NaN to NaN.
inline uint8_t to_e4m3(float f) {
  constexpr uint32_t kMaxBits = UINT32_C(1087) << 20;     // 480.0f: first value e4m3fn cannot hold
  constexpr uint32_t kNormalBits = UINT32_C(121) << 23;   // 2^-6: smallest e4m3fn normal
  constexpr uint32_t kDenormMagic = UINT32_C(141) << 23;  // ((127 - 7) + (23 - 3) + 1) << 23
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t sign = bits & UINT32_C(0x80000000);
  const uint32_t mag = bits ^ sign;
  uint32_t normal = ((mag + (static_cast<uint32_t>(7 - 127) << 23) + UINT32_C(0x7FFFF) + ((mag >> 20) & 1)) >> 20) & 0xFF;
  normal = normal == 0x7f ? 0x7e : normal;  // rounding carried into the NaN pattern: saturate
  float magic, shifted;
  std::memcpy(&magic, &kDenormMagic, sizeof magic);
  float m;
  std::memcpy(&m, &mag, sizeof m);
  shifted = m + magic;
  uint32_t denorm;
  std::memcpy(&denorm, &shifted, sizeof denorm);
  denorm = (denorm - kDenormMagic) & 0xFF;
  uint32_t out = mag < kNormalBits ? denorm : normal;
  out = mag >= kMaxBits ? (mag > UINT32_C(0x7F800000) ? 0x7f : 0x7e) : out;
  return static_cast<uint8_t>(out | (sign >> 24));
}

// Round half to even for 0 <= v (after the clamp below 2^22): adding and
// removing 1.5 * 2^23 leaves the nearest integer under the default rounding
// mode, like torch.round, without a libm call per element.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;
  const float up = v + kMagic;
  return up - kMagic;
}

// -- byte planes ----------------------------------------------------------------
//
// Each plane is its own loop with __restrict pointers and a compile-time
// element width, so the strided side vectorizes; all planes of 2- and 4-byte
// elements at once (a chunk's decode, a full split) read or write each
// element once.

template <int W>
PDKV_VECTOR_CLONES void split_plane(const uint8_t* __restrict src, int64_t width, uint8_t* __restrict dst, int64_t begin, int64_t end) {
  const int64_t w = W > 0 ? W : width;
  for (int64_t i = begin; i < end; ++i) dst[i] = src[i * w];
}

PDKV_VECTOR_CLONES void split4(const uint8_t* __restrict src, uint8_t* __restrict d0, uint8_t* __restrict d1, uint8_t* __restrict d2,
                               uint8_t* __restrict d3, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    d0[i] = src[4 * i];
    d1[i] = src[4 * i + 1];
    d2[i] = src[4 * i + 2];
    d3[i] = src[4 * i + 3];
  }
}

PDKV_VECTOR_CLONES void split2(const uint8_t* __restrict src, uint8_t* __restrict d0, uint8_t* __restrict d1, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    d0[i] = src[2 * i];
    d1[i] = src[2 * i + 1];
  }
}

void split_range(const uint8_t* src, int64_t width, const std::vector<int64_t>& planes, const std::vector<uint8_t*>& dst, int64_t begin, int64_t end) {
  const bool all = static_cast<int64_t>(planes.size()) == width && std::is_sorted(planes.begin(), planes.end());
  if (all && width == 4) return split4(src, dst[0], dst[1], dst[2], dst[3], begin, end);
  if (all && width == 2) return split2(src, dst[0], dst[1], begin, end);
  for (size_t j = 0; j < planes.size(); ++j) {
    switch (width) {
      case 2: split_plane<2>(src + planes[j], width, dst[j], begin, end); break;
      case 4: split_plane<4>(src + planes[j], width, dst[j], begin, end); break;
      default: split_plane<0>(src + planes[j], width, dst[j], begin, end);
    }
  }
}

// An argument error, reported through the C ABI's err buffer.
struct ArgError {
  std::string what;
};

// dsts[j][i] = src[i * width + planes[j]]: the chosen byte planes of `src` (n elements), each its own contiguous run.
void split_planes(const uint8_t* src, int64_t n, int64_t width, const int64_t* planes, uint8_t* const* dsts, int64_t count, int64_t threads) {
  if (width <= 0 || n < 0) throw ArgError{"element width must be positive"};
  std::vector<int64_t> chosen(planes, planes + count);
  for (int64_t j = 0; j < count; ++j) {
    if (chosen[j] < 0 || chosen[j] >= width) throw ArgError{"plane " + std::to_string(chosen[j]) + " out of range [0, " + std::to_string(width) + ")"};
    if (j > 0 && chosen[j] <= chosen[j - 1]) throw ArgError{"planes must be given in increasing order"};
  }
  if (count == 0) return;
  const std::vector<uint8_t*> out(dsts, dsts + count);
  share_work(n, kGrainElements, threads, [&](int64_t begin, int64_t end) { split_range(src, width, chosen, out, begin, end); });
}

PDKV_VECTOR_CLONES void merge4(const uint8_t* __restrict s0, const uint8_t* __restrict s1, const uint8_t* __restrict s2,
                               const uint8_t* __restrict s3, uint8_t* __restrict dst, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    dst[4 * i] = s0[i];
    dst[4 * i + 1] = s1[i];
    dst[4 * i + 2] = s2[i];
    dst[4 * i + 3] = s3[i];
  }
}

PDKV_VECTOR_CLONES void merge2(const uint8_t* __restrict s0, const uint8_t* __restrict s1, uint8_t* __restrict dst, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    dst[2 * i] = s0[i];
    dst[2 * i + 1] = s1[i];
  }
}

PDKV_VECTOR_CLONES void merge_plane(const uint8_t* __restrict src, int64_t width, uint8_t* __restrict dst, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) dst[i * width] = src[i];
}

// dst[i * width + k] = srcs[k][i]: byte planes back into n elements.
void merge_planes(const uint8_t* const* srcs, int64_t width, uint8_t* d, int64_t n, int64_t threads) {
  if (width <= 0 || n < 0) throw ArgError{"element width must be positive"};
  const std::vector<const uint8_t*> in(srcs, srcs + width);
  share_work(n, kGrainElements, threads, [&](int64_t begin, int64_t end) {
    if (width == 4) return merge4(in[0], in[1], in[2], in[3], d, begin, end);
    if (width == 2) return merge2(in[0], in[1], d, begin, end);
    for (int64_t k = 0; k < width; ++k) merge_plane(in[k], width, d + k, begin, end);
  });
}

// Values are [a, b, c] tensors whose [b, c] part is contiguous (any stride over a): a
// chunk's keys or values alone, chunk[:, 0] or chunk[:, 1], need no copy first.
// The caller (kernels.py) derives it from the tensor; the layout is mirrored there.
struct Rows {
  int64_t a, b, c, stride_a;
};

void check_rows(const Rows& r) {
  if (r.a < 0 || r.b < 0 || r.c < 0 || r.stride_a < 0) throw ArgError{"negative size or stride"};
}

void check_same_rows(const Rows& x, const Rows& y, const char* what) {
  check_rows(x);
  check_rows(y);
  if (x.a != y.a || x.b != y.b || x.c != y.c) throw ArgError{std::string(what) + " must be shaped like the values"};
}

int64_t grain_rows(int64_t c) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, c)); }

// Runs fn(n, i, j, value offset, code offset) for every row n = (i, j) of values r and codes rc, shared over threads.
template <class F>
void each_row(const Rows& r, const Rows& rc, int64_t threads, F fn) {
  share_work(r.a * r.b, grain_rows(r.c), threads, [=](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t i = n / r.b, j = n % r.b;
      fn(n, i, j, i * r.stride_a + j * r.c, i * rc.stride_a + j * r.c);
    }
  });
}

// One row each. Raw __restrict pointers and sizes by value: the uint8 stores
// may otherwise alias everything (char aliasing) and pin every load in the loop.

template <class T>
PDKV_VECTOR_CLONES int8_t fp8_encode_row(const T* __restrict row, uint8_t* __restrict out, int64_t n) {
  // max |x| over the bits of |x|: ordered like the values for non-negative floats (a NaN
  // wins, as in torch's amax), and an integer max reduction vectorizes where a float one does not
  uint32_t top = 0;
  for (int64_t k = 0; k < n; ++k) {
    const float v = static_cast<float>(row[k]);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits &= UINT32_C(0x7FFFFFFF);
    top = bits > top ? bits : top;
  }
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  int exponent = 0;
  const float m = std::frexp(amax, &exponent);
  const int ex = std::min(std::max(exponent - 9 + (m > kFp8Max / 512.0f ? 1 : 0), kExpMin), kExpMax);
  const float scale = pow2(-ex);
  for (int64_t k = 0; k < n; ++k) out[k] = to_e4m3(static_cast<float>(row[k]) * scale);
  return static_cast<int8_t>(ex);
}

template <class T>
PDKV_VECTOR_CLONES void fp8_decode_row(const uint8_t* __restrict codes, T* __restrict out, int64_t n, float scale, const float* __restrict lut) {
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<T>(lut[codes[k]] * scale);
}

// PerColumn: lo/inv hold one value per element of the row; else one for the whole row.
template <bool PerColumn, class T>
PDKV_VECTOR_CLONES void u8_quantize_row(const T* __restrict row, uint8_t* __restrict out, int64_t n, const float* __restrict lo,
                     const float* __restrict inv) {
  for (int64_t k = 0; k < n; ++k) {
    // clamp, then round: the same as torch's round-then-clamp for every value in [0, 255]
    const float scaled = (static_cast<float>(row[k]) - lo[PerColumn ? k : 0]) * inv[PerColumn ? k : 0];
    float level = scaled < 0.0f ? 0.0f : scaled;
    level = level > 255.0f ? 255.0f : level;
    out[k] = static_cast<uint8_t>(static_cast<int32_t>(round_even(level)));
  }
}

template <bool PerColumn, class T>
PDKV_VECTOR_CLONES void u8_dequantize_row(const uint8_t* __restrict codes, T* __restrict out, int64_t n, const float* __restrict lo,
                       const float* __restrict step) {
  for (int64_t k = 0; k < n; ++k) {
    out[k] = static_cast<T>(static_cast<float>(codes[k]) * step[PerColumn ? k : 0] + lo[PerColumn ? k : 0]);
  }
}

// -- fp8 (e4m3fn) with a power-of-two scale per row ---------------------------------------

// Each row x[i, j, :]: e with max|row| / 2^e in (224, 448], codes = e4m3(row * 2^-e); exps [a, b].
void fp8_encode(int dtype, const void* x, const Rows& r, uint8_t* c, const Rows& rc, int8_t* e, int64_t threads) {
  check_same_rows(r, rc, "fp8_encode codes");
  const bool known = dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    const T* in = static_cast<const T*>(x);
    each_row(r, rc, threads, [=](int64_t n, int64_t, int64_t, int64_t at, int64_t code_at) { e[n] = fp8_encode_row(in + at, c + code_at, r.c); });
  });
  if (!known) throw ArgError{"unknown value dtype code " + std::to_string(dtype)};
}

// out[i, j, :] = e4m3(codes[i, j, :]) * 2^exps[i, j] (the caller checked the exponents' range); lut: the 256 e4m3 values.
void fp8_decode(const uint8_t* c, const Rows& rc, const int8_t* e, const float* lut, int dtype, void* out, const Rows& r, int64_t threads) {
  check_same_rows(r, rc, "fp8_decode codes");
  const bool known = dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    T* o = static_cast<T*>(out);
    each_row(r, rc, threads, [=](int64_t n, int64_t, int64_t, int64_t at, int64_t code_at) {
      fp8_decode_row(c + code_at, o + at, r.c, pow2(std::min(std::max(static_cast<int>(e[n]), kExpMin), kExpMax)), lut);
    });
  });
  if (!known) throw ArgError{"unknown value dtype code " + std::to_string(dtype)};
}

// -- uint8 with one (min, step) per group -----------------------------------------------

// Parameters [a, 1 or b, 1 or c] (contiguous float32): per row (pc == 1) or per column (pb == 1) groups.
struct Params {
  int64_t pb, pc;
  int64_t at(int64_t i, int64_t j, int64_t k) const { return (i * pb + (pb == 1 ? 0 : j)) * pc + (pc == 1 ? 0 : k); }
};

Params params_of(const Rows& r, int64_t pb, int64_t pc) {
  if (!((pb == 1 || pb == r.b) && (pc == 1 || pc == r.c))) {
    throw ArgError{"parameters [" + std::to_string(r.a) + ", " + std::to_string(pb) + ", " + std::to_string(pc) + "] do not broadcast over [" +
                   std::to_string(r.a) + ", " + std::to_string(r.b) + ", " + std::to_string(r.c) + "]"};
  }
  return Params{pb, pc};
}

// lo/hi [a, pb, pc] = min/max of x [a, b, c] over each group: a row (pc == 1) or a column (pb == 1).
void group_minmax(int dtype, const void* x, const Rows& r, float* l, float* h, int64_t pb, int64_t pc, int64_t threads) {
  check_rows(r);
  const Params p = params_of(r, pb, pc);
  if (!(p.pb == 1 || p.pc == 1)) throw ArgError{"group_minmax groups are rows or columns"};
  const bool known = dispatch(dtype, [&](auto t) {
    using scalar_t = decltype(t);
    const scalar_t* in = static_cast<const scalar_t*>(x);
    if (p.pc == 1) {  // one group per row
      share_work(r.a * r.b, grain_rows(r.c), threads, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const scalar_t* row = in + (n / r.b) * r.stride_a + (n % r.b) * r.c;
          float mn = INFINITY, mx = -INFINITY;
          for (int64_t k = 0; k < r.c; ++k) {
            const float v = static_cast<float>(row[k]);
            mn = std::min(mn, v);
            mx = std::max(mx, v);
          }
          l[n] = r.c ? mn : 0.0f;
          h[n] = r.c ? mx : 0.0f;
        }
      });
      return;
    }
    share_work(r.a, 1, threads, [&](int64_t begin, int64_t end) {  // one group per column: rows of one i accumulate together
      for (int64_t i = begin; i < end; ++i) {
        float* mn = l + i * r.c;
        float* mx = h + i * r.c;
        for (int64_t k = 0; k < r.c; ++k) {
          mn[k] = r.b ? INFINITY : 0.0f;
          mx[k] = r.b ? -INFINITY : 0.0f;
        }
        for (int64_t j = 0; j < r.b; ++j) {
          const scalar_t* row = in + i * r.stride_a + j * r.c;
          for (int64_t k = 0; k < r.c; ++k) {
            const float v = static_cast<float>(row[k]);
            mn[k] = std::min(mn[k], v);
            mx[k] = std::max(mx[k], v);
          }
        }
      }
    });
  });
  if (!known) throw ArgError{"unknown value dtype code " + std::to_string(dtype)};
}

// codes = clamp(round_half_even((x - lo) * inv), 0, 255).
void u8_quantize(int dtype, const void* x, const Rows& r, const float* l, const float* v, int64_t pb, int64_t pc, uint8_t* q, const Rows& rc, int64_t threads) {
  check_same_rows(r, rc, "u8_quantize codes");
  const Params p = params_of(r, pb, pc);
  const bool known = dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    const T* in = static_cast<const T*>(x);
    each_row(r, rc, threads, [=](int64_t, int64_t i, int64_t j, int64_t at, int64_t code_at) {
      const int64_t g = p.at(i, j, 0);
      if (p.pc == 1) {
        u8_quantize_row<false>(in + at, q + code_at, r.c, l + g, v + g);
      } else {
        u8_quantize_row<true>(in + at, q + code_at, r.c, l + g, v + g);
      }
    });
  });
  if (!known) throw ArgError{"unknown value dtype code " + std::to_string(dtype)};
}

// out = codes * step + lo.
void u8_dequantize(const uint8_t* q, const Rows& rc, const float* l, const float* s, int64_t pb, int64_t pc, int dtype, void* out, const Rows& r,
                   int64_t threads) {
  check_same_rows(r, rc, "u8_dequantize codes");
  const Params p = params_of(r, pb, pc);
  const bool known = dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    T* o = static_cast<T*>(out);
    each_row(r, rc, threads, [=](int64_t, int64_t i, int64_t j, int64_t at, int64_t code_at) {
      const int64_t g = p.at(i, j, 0);
      if (p.pc == 1) {
        u8_dequantize_row<false>(q + code_at, o + at, r.c, l + g, s + g);
      } else {
        u8_dequantize_row<true>(q + code_at, o + at, r.c, l + g, s + g);
      }
    });
  });
  if (!known) throw ArgError{"unknown value dtype code " + std::to_string(dtype)};
}

// Runs one kernel, turning an argument error into PDKV_EVALUE and its message.
template <class F>
int guarded(char* err, size_t err_len, F fn) {
  try {
    fn();
    return PDKV_OK;
  } catch (const ArgError& e) {
    if (err && err_len) std::snprintf(err, err_len, "pdkv kvcodec: %s", e.what.c_str());
  } catch (const std::exception& e) {  // std::bad_alloc: nothing may unwind through the C ABI
    if (err && err_len) std::snprintf(err, err_len, "pdkv kvcodec: %s", e.what());
  }
  return PDKV_EVALUE;
}

}  // namespace
}  // namespace pdkv

using pdkv::guarded;
using pdkv::Rows;

PDKV_API int pdkv_split_planes(const uint8_t* src, int64_t n, int64_t width, const int64_t* planes, uint8_t* const* dsts, int64_t count, int64_t threads,
                               char* err, size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::split_planes(src, n, width, planes, dsts, count, threads); });
}

PDKV_API int pdkv_merge_planes(const uint8_t* const* srcs, int64_t width, uint8_t* dst, int64_t n, int64_t threads, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::merge_planes(srcs, width, dst, n, threads); });
}

PDKV_API int pdkv_fp8_encode(int dtype, const void* x, const Rows* r, uint8_t* codes, const Rows* rc, int8_t* exps, int64_t threads, char* err,
                             size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::fp8_encode(dtype, x, *r, codes, *rc, exps, threads); });
}

PDKV_API int pdkv_fp8_decode(const uint8_t* codes, const Rows* rc, const int8_t* exps, const float* lut, int dtype, void* out, const Rows* r,
                             int64_t threads, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::fp8_decode(codes, *rc, exps, lut, dtype, out, *r, threads); });
}

PDKV_API int pdkv_group_minmax(int dtype, const void* x, const Rows* r, float* lo, float* hi, int64_t pb, int64_t pc, int64_t threads, char* err,
                               size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::group_minmax(dtype, x, *r, lo, hi, pb, pc, threads); });
}

PDKV_API int pdkv_u8_quantize(int dtype, const void* x, const Rows* r, const float* lo, const float* inv, int64_t pb, int64_t pc, uint8_t* codes,
                              const Rows* rc, int64_t threads, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::u8_quantize(dtype, x, *r, lo, inv, pb, pc, codes, *rc, threads); });
}

PDKV_API int pdkv_u8_dequantize(const uint8_t* codes, const Rows* rc, const float* lo, const float* step, int64_t pb, int64_t pc, int dtype, void* out,
                                const Rows* r, int64_t threads, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { pdkv::u8_dequantize(codes, *rc, lo, step, pb, pc, dtype, out, *r, threads); });
}
