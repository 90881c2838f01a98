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
// Safety: pdkv/codec/kernels.py validates shapes before calling in; every
// argument that decides an address is checked again here.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvcodec.h"
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

void check(const at::Tensor& t, const char* what, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(), "pdkv kvcodec: ", what, " must be a contiguous CPU tensor");
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, "pdkv kvcodec: ", what, " must be ", dtype, ", got ", t.scalar_type());
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

// dsts[j][i] = src[i * width + planes[j]]: the chosen byte planes of `src`, each its own contiguous run.
void split_planes(const at::Tensor& src, int64_t width, const std::vector<int64_t>& planes, const std::vector<at::Tensor>& dsts) {
  check(src, "split_planes source", at::kByte);
  TORCH_CHECK_VALUE(width > 0 && src.numel() % width == 0, "pdkv kvcodec: ", src.numel(), " bytes are not whole ", width, "-byte elements");
  TORCH_CHECK_VALUE(planes.size() == dsts.size(), "pdkv kvcodec: ", planes.size(), " planes but ", dsts.size(), " destinations");
  const int64_t n = src.numel() / width;
  std::vector<uint8_t*> out;
  for (size_t j = 0; j < planes.size(); ++j) {
    TORCH_CHECK_VALUE(planes[j] >= 0 && planes[j] < width, "pdkv kvcodec: plane ", planes[j], " out of range [0, ", width, ")");
    TORCH_CHECK_VALUE(j == 0 || planes[j] > planes[j - 1], "pdkv kvcodec: planes must be given in increasing order");
    check(dsts[j], "split_planes destination", at::kByte);
    TORCH_CHECK_VALUE(dsts[j].numel() == n, "pdkv kvcodec: plane destination holds ", dsts[j].numel(), " bytes, needs ", n);
    out.push_back(dsts[j].data_ptr<uint8_t>());
  }
  if (out.empty()) return;
  const uint8_t* s = src.data_ptr<uint8_t>();
  share_work(n, kGrainElements, [&](int64_t begin, int64_t end) { split_range(s, width, planes, out, begin, end); });
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

// dst[i * width + k] = srcs[k][i]: byte planes back into elements.
void merge_planes(const std::vector<at::Tensor>& srcs, const at::Tensor& dst) {
  check(dst, "merge_planes destination", at::kByte);
  const int64_t width = static_cast<int64_t>(srcs.size());
  TORCH_CHECK_VALUE(width > 0 && dst.numel() % width == 0, "pdkv kvcodec: ", dst.numel(), " bytes are not whole ", width, "-byte elements");
  const int64_t n = dst.numel() / width;
  std::vector<const uint8_t*> in;
  for (const auto& s : srcs) {
    check(s, "merge_planes source", at::kByte);
    TORCH_CHECK_VALUE(s.numel() == n, "pdkv kvcodec: plane holds ", s.numel(), " bytes, needs ", n);
    in.push_back(s.data_ptr<uint8_t>());
  }
  uint8_t* d = dst.data_ptr<uint8_t>();
  share_work(n, kGrainElements, [&](int64_t begin, int64_t end) {
    if (width == 4) return merge4(in[0], in[1], in[2], in[3], d, begin, end);
    if (width == 2) return merge2(in[0], in[1], d, begin, end);
    for (int64_t k = 0; k < width; ++k) merge_plane(in[k], width, d + k, begin, end);
  });
}

// Values are [a, b, c] tensors whose [b, c] part is contiguous (any stride over a): a
// chunk's keys or values alone, chunk[:, 0] or chunk[:, 1], need no copy first.
struct Rows {
  int64_t a, b, c, stride_a;
};

Rows rows_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 3, "pdkv kvcodec: ", what, " must be a 3-d CPU tensor");
  TORCH_CHECK_VALUE(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)) && t.stride(0) >= 0,
                    "pdkv kvcodec: ", what, " must be contiguous in its last two dimensions");
  return Rows{t.size(0), t.size(1), t.size(2), t.size(0) <= 1 ? 0 : t.stride(0)};
}

void check_values(const at::Tensor& t, const char* what) {
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, "pdkv kvcodec: ", what,
                    " must be float32, bfloat16 or float16, got ", s);
}

void check_same_rows(const Rows& x, const Rows& y, const char* what) {
  TORCH_CHECK_VALUE(x.a == y.a && x.b == y.b && x.c == y.c, "pdkv kvcodec: ", what, " must be shaped like the values");
}

int64_t grain_rows(int64_t c) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, c)); }

// Runs fn(n, i, j, value offset, code offset) for every row n = (i, j) of values r and codes rc, shared over threads.
template <class F>
void each_row(const Rows& r, const Rows& rc, F fn) {
  share_work(r.a * r.b, grain_rows(r.c), [=](int64_t begin, int64_t end) {
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
void fp8_encode(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& exps) {
  check_values(x, "fp8_encode input");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, "pdkv kvcodec: fp8_encode codes must be uint8");
  check(exps, "fp8_encode exponents", at::kChar);
  const Rows r = rows_of(x, "fp8_encode input"), rc = rows_of(codes, "fp8_encode codes");
  check_same_rows(r, rc, "fp8_encode codes");
  TORCH_CHECK_VALUE(exps.numel() == r.a * r.b, "pdkv kvcodec: fp8_encode needs one exponent per row");
  uint8_t* c = codes.data_ptr<uint8_t>();
  int8_t* e = exps.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pdkv_fp8_encode", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    each_row(r, rc, [=](int64_t n, int64_t, int64_t, int64_t at, int64_t code_at) { e[n] = fp8_encode_row(in + at, c + code_at, r.c); });
  });
}

// out[i, j, :] = e4m3(codes[i, j, :]) * 2^exps[i, j] (the caller checked the exponents' range).
void fp8_decode(const at::Tensor& codes, const at::Tensor& exps, const at::Tensor& out) {
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, "pdkv kvcodec: fp8_decode codes must be uint8");
  check(exps, "fp8_decode exponents", at::kChar);
  check_values(out, "fp8_decode output");
  const Rows r = rows_of(out, "fp8_decode output"), rc = rows_of(codes, "fp8_decode codes");
  check_same_rows(r, rc, "fp8_decode codes");
  TORCH_CHECK_VALUE(exps.numel() == r.a * r.b, "pdkv kvcodec: fp8_decode needs one exponent per row");
  float table[256];
  for (int b = 0; b < 256; ++b) table[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int8_t* e = exps.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "pdkv_fp8_decode", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const float* lut = table;
    each_row(r, rc, [=](int64_t n, int64_t, int64_t, int64_t at, int64_t code_at) {
      fp8_decode_row(c + code_at, o + at, r.c, pow2(std::min(std::max(static_cast<int>(e[n]), kExpMin), kExpMax)), lut);
    });
  });
}

// -- uint8 with one (min, step) per group -----------------------------------------------

// Parameters [a, 1 or b, 1 or c] (contiguous float32): per row (pc == 1) or per column (pb == 1) groups.
struct Params {
  int64_t pb, pc;
  int64_t at(int64_t i, int64_t j, int64_t k) const { return (i * pb + (pb == 1 ? 0 : j)) * pc + (pc == 1 ? 0 : k); }
};

Params params_of(const Rows& r, const at::Tensor& p1, const at::Tensor& p2, const char* what) {
  check(p1, what, at::kFloat);
  check(p2, what, at::kFloat);
  TORCH_CHECK_VALUE(p1.dim() == 3 && p1.sizes() == p2.sizes() && p1.size(0) == r.a && (p1.size(1) == 1 || p1.size(1) == r.b) &&
                        (p1.size(2) == 1 || p1.size(2) == r.c),
                    "pdkv kvcodec: ", what, " ", p1.sizes(), " do not broadcast over [", r.a, ", ", r.b, ", ", r.c, "]");
  return Params{p1.size(1), p1.size(2)};
}

// lo/hi [a, pb, pc] = min/max of x [a, b, c] over each group: a row (pc == 1) or a column (pb == 1).
void group_minmax(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi) {
  check_values(x, "group_minmax input");
  const Rows r = rows_of(x, "group_minmax input");
  const Params p = params_of(r, lo, hi, "group_minmax outputs");
  TORCH_CHECK_VALUE(p.pb == 1 || p.pc == 1, "pdkv kvcodec: group_minmax groups are rows or columns");
  float* l = lo.data_ptr<float>();
  float* h = hi.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pdkv_group_minmax", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    if (p.pc == 1) {  // one group per row
      share_work(r.a * r.b, grain_rows(r.c), [&](int64_t begin, int64_t end) {
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
    share_work(r.a, 1, [&](int64_t begin, int64_t end) {  // one group per column: rows of one i accumulate together
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
}

// codes = clamp(round_half_even((x - lo) * inv), 0, 255).
void u8_quantize(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& inv, const at::Tensor& codes) {
  check_values(x, "u8_quantize input");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, "pdkv kvcodec: u8_quantize codes must be uint8");
  const Rows r = rows_of(x, "u8_quantize input"), rc = rows_of(codes, "u8_quantize codes");
  check_same_rows(r, rc, "u8_quantize codes");
  const Params p = params_of(r, lo, inv, "u8_quantize parameters");
  const float* l = lo.data_ptr<float>();
  const float* v = inv.data_ptr<float>();
  uint8_t* q = codes.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pdkv_u8_quantize", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    each_row(r, rc, [=](int64_t, int64_t i, int64_t j, int64_t at, int64_t code_at) {
      const int64_t g = p.at(i, j, 0);
      if (p.pc == 1) {
        u8_quantize_row<false>(in + at, q + code_at, r.c, l + g, v + g);
      } else {
        u8_quantize_row<true>(in + at, q + code_at, r.c, l + g, v + g);
      }
    });
  });
}

// out = codes * step + lo.
void u8_dequantize(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& step, const at::Tensor& out) {
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, "pdkv kvcodec: u8_dequantize codes must be uint8");
  check_values(out, "u8_dequantize output");
  const Rows r = rows_of(out, "u8_dequantize output"), rc = rows_of(codes, "u8_dequantize codes");
  check_same_rows(r, rc, "u8_dequantize codes");
  const Params p = params_of(r, lo, step, "u8_dequantize parameters");
  const float* l = lo.data_ptr<float>();
  const float* s = step.data_ptr<float>();
  const uint8_t* q = codes.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "pdkv_u8_dequantize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    each_row(r, rc, [=](int64_t, int64_t i, int64_t j, int64_t at, int64_t code_at) {
      const int64_t g = p.at(i, j, 0);
      if (p.pc == 1) {
        u8_dequantize_row<false>(q + code_at, o + at, r.c, l + g, s + g);
      } else {
        u8_dequantize_row<true>(q + code_at, o + at, r.c, l + g, s + g);
      }
    });
  });
}

}  // namespace

void register_codec_ops(pybind11::module_& m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("split_planes", &split_planes, "dsts[j][i] = src[i * width + planes[j]]", py::arg("src"), py::arg("width"),
        py::arg("planes"), py::arg("dsts"), nogil);
  m.def("merge_planes", &merge_planes, "dst[i * width + k] = srcs[k][i]", py::arg("srcs"), py::arg("dst"), nogil);
  m.def("fp8_encode", &fp8_encode, "e4m3 codes and a power-of-two exponent per row", py::arg("x"), py::arg("codes"),
        py::arg("exps"), nogil);
  m.def("fp8_decode", &fp8_decode, "e4m3 codes times 2^exponent per row", py::arg("codes"), py::arg("exps"), py::arg("out"), nogil);
  m.def("group_minmax", &group_minmax, "min and max of each row or column group", py::arg("x"), py::arg("lo"), py::arg("hi"), nogil);
  m.def("u8_quantize", &u8_quantize, "uint8 codes of (x - lo) * inv", py::arg("x"), py::arg("lo"), py::arg("inv"),
        py::arg("codes"), nogil);
  m.def("u8_dequantize", &u8_dequantize, "codes * step + lo", py::arg("codes"), py::arg("lo"), py::arg("step"),
        py::arg("out"), nogil);
}

}  // namespace pdkv
