// The record codecs' row operations, in plain C++ (kv_codec.cpp's chunk loops run them, or
// the AVX2 rows of kv_codec_avx2.h, on every row): the pool dtypes as float32 and back, the two
// quantizers and the levels a stored byte stands for. See kv_codec.cpp for why each rounds as
// it does. Included by kv_codec.cpp (through kv_codec_avx2.h) only.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#define KV_INLINE inline __attribute__((always_inline))

namespace kvtier {
namespace codec_cpu {


constexpr float kTiny = 1e-12f;  // codec.py's _TINY: an all-zero channel or token

KV_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

KV_INLINE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The pool dtypes, as float32 and back (nearest even, as torch's casts round).
KV_INLINE float widen(float v) { return v; }
KV_INLINE float widen(c10::BFloat16 v) { return bits_float(static_cast<uint32_t>(v.x) << 16); }
KV_INLINE float widen(c10::Half v) { return static_cast<float>(v); }

KV_INLINE void narrow(float v, float* out) { *out = v; }
KV_INLINE void narrow(float v, c10::Half* out) { *out = c10::Half(v); }
KV_INLINE void narrow(float v, c10::BFloat16* out) {
  const uint32_t u = float_bits(v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  out->x = static_cast<uint16_t>(std::isnan(v) ? 0x7FC0u : rounded);
}

// What a stored byte stands for, before its scale, divided by its codec's kUnit: decode
// multiplies it by scale * kUnit (both exact), as codec.py does (fp8: q * 2**-8, a float16).
struct Levels {
  std::array<float, 256> fp8{};
  std::array<float, 256> int8{};

  Levels() {
    for (int b = 0; b < 256; ++b) {
      const int exp = (b >> 3) & 0xF;
      const int man = b & 7;
      // 0x7F / 0xFF read as +-480 (see the top of the file), like every other bit pattern
      const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -9 - 8)
                                 : std::ldexp(1.0f + man / 8.0f, exp - 7 - 8);
      fp8[b] = (b & 0x80) ? -mag : mag;
      int8[b] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(b)));
    }
  }
};

inline const Levels& levels() {
  static const Levels table;
  return table;
}

// float -> e4m3fn bits, branch-free so that it vectorizes: both of torch's paths are computed
// and one is picked.
struct Fp8 {
  static constexpr float kMax = 448.0f;
  static constexpr float kUnit = 256.0f;
  static KV_INLINE float level(uint8_t b) { return levels().fp8[b]; }

  static KV_INLINE uint8_t quantize(float y) {
    const uint32_t all = float_bits(y);
    const uint32_t sign = (all >> 24) & 0x80u;
    const uint32_t mag = all & 0x7FFFFFFFu;
    // Below 2**-6 (e4m3's smallest normal): adding 2**14, whose float32 ulp is 2**-9 (e4m3's
    // subnormal step), rounds |y| to a multiple of 2**-9 (nearest even); the low bits count them.
    const uint32_t sub = float_bits(bits_float(mag) + bits_float(141u << 23)) - (141u << 23);
    // Normal: rebias the exponent (127 -> 7), round the mantissa to 3 bits (nearest even).
    const uint32_t odd = (mag >> 20) & 1u;
    const uint32_t norm = (mag - (120u << 23) + 0x7FFFFu + odd) >> 20;
    uint32_t bits = mag < (121u << 23) ? sub : norm;
    bits = mag >= (1087u << 20) ? 0x7Fu : bits;  // |y| >= 480, or NaN: e4m3fn's NaN
    return static_cast<uint8_t>(bits | sign);
  }
};

struct Int8 {
  static constexpr float kMax = 127.0f;
  static constexpr float kUnit = 1.0f;
  static KV_INLINE float level(uint8_t b) { return levels().int8[b]; }

  static KV_INLINE uint8_t quantize(float y) {
    // Nearest even by adding and taking away 1.5 * 2**23 (exact for |r| < 2**22); clamping to
    // +-128 first keeps r there and changes nothing clamped to +-127 afterwards.
    constexpr float kRound = 12582912.0f;
    float r = std::min(std::max(y, -128.0f), 128.0f);
    r = (r + kRound) - kRound;
    r = std::min(std::max(r, -127.0f), 127.0f);
    return static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>(r)));
  }
};

// The operations the kernels are made of, in plain C++ (compiled for any CPU; the compiler
// vectorizes what it can; kv_codec_avx2.h has them in intrinsics). Each takes a block of
// `rows` rows of `n` values (a layer's tokens), so that a kernel makes one call a layer.
struct ScalarRows {
  // amax[h] = max(amax[h], |x[t][h]|) over the rows: a scale per column (channel)
  template <typename T>
  static KV_INLINE void amax_columns(const T* x, int64_t rows, int64_t n, float* amax) {
    for (int64_t t = 0; t < rows; ++t, x += n) {
      for (int64_t h = 0; h < n; ++h) amax[h] = std::max(amax[h], std::fabs(widen(x[h])));
    }
  }
  // amax[t] = max(amax[t], |x[t][h]|) over the row: a scale per row (token)
  template <typename T>
  static KV_INLINE void amax_rows(const T* x, int64_t rows, int64_t n, float* amax) {
    for (int64_t t = 0; t < rows; ++t, x += n) {
      float m = amax[t];
      for (int64_t h = 0; h < n; ++h) m = std::max(m, std::fabs(widen(x[h])));
      amax[t] = m;
    }
  }
  // x / scale (scales[h] each, or `scale` for all when scales is null) stored as bytes
  template <typename Q, typename T>
  static KV_INLINE void quantize_row(const T* x, const float* scales, float scale, uint8_t* q,
                                     int64_t n) {
    for (int64_t h = 0; h < n; ++h) q[h] = Q::quantize(widen(x[h]) / (scales ? scales[h] : scale));
  }
  // The block quantized under scales per column (scales[h]) or, `per_row`, per row
  // (scales[t]); `recips` are the scales' reciprocals, for the AVX2 rows; `next` the block
  // after it (or nullptr), which the AVX-512 rows fetch into L2 meanwhile
  template <typename Q, typename T>
  static KV_INLINE void quantize(const T* x, int64_t rows, int64_t n, const float* scales,
                                 const float* /*recips*/, bool per_row, uint8_t* q,
                                 const T* /*next*/) {
    for (int64_t t = 0; t < rows; ++t, x += n, q += n) {
      quantize_row<Q>(x, per_row ? nullptr : scales, per_row ? scales[t] : 0.0f, q, n);
    }
  }
  // level * scale (scales[h] each, or `scale` for all), the scales already times Q::kUnit
  template <typename Q, typename T>
  static KV_INLINE void dequantize_row(const uint8_t* q, const float* scales, float scale,
                                       T* out, int64_t n) {
    for (int64_t h = 0; h < n; ++h) narrow(Q::level(q[h]) * (scales ? scales[h] : scale), out + h);
  }
  template <typename Q, typename T>
  static KV_INLINE void dequantize(const uint8_t* q, int64_t rows, int64_t n,
                                   const float* scales, bool per_row, T* out) {
    for (int64_t t = 0; t < rows; ++t, q += n, out += n) {
      dequantize_row<Q>(q, per_row ? nullptr : scales, per_row ? scales[t] : 0.0f, out, n);
    }
  }
};

}  // namespace codec_cpu
}  // namespace kvtier
