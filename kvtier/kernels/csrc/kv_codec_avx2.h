// The record codecs' rows in AVX2 + F16C + FMA intrinsics (kv_codec_rows.h has the plain
// ones, which finish each row's tail). Compiled with target attributes, so the rest of the
// extension stays runnable on any x86-64: kv_codec.cpp picks these rows at run time. Included
// by kv_codec.cpp only.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv_codec_rows.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvtier {
namespace codec_cpu {

#define KV_AVX2 inline __attribute__((always_inline, target("avx2,f16c,fma")))
// A block function: called (not inlined) once a layer from the chunk loops, which are
// compiled for any CPU.
#define KV_AVX2_ROW __attribute__((target("avx2,f16c,fma")))

// ScalarRows' operations in AVX2 intrinsics, eight values at a time, lane by lane (the compiler
// vectorizes none of the quantizers: their selects read to it as control flow); each row's tail
// goes through ScalarRows.
KV_AVX2 __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
KV_AVX2 __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
KV_AVX2 __m256 load8(const c10::BFloat16* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

KV_AVX2 void store8(__m256 v, float* out) { _mm256_storeu_ps(out, v); }
KV_AVX2 void store8(__m256 v, c10::Half* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
KV_AVX2 void store8(__m256 v, c10::BFloat16* out) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                 odd), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// Eight int32 lanes stored as eight bytes: fp8's bit patterns (in [0, 255]) with unsigned
// saturation, int8's values (in [-127, 128]) with signed saturation, which clamps 128 to 127.
template <typename Q>
KV_AVX2 __m256i pack32(__m256i a, __m256i b) {
  return std::is_same_v<Q, Fp8> ? _mm256_packus_epi32(a, b) : _mm256_packs_epi32(a, b);
}
template <typename Q>
KV_AVX2 __m256i pack16(__m256i a, __m256i b) {
  return std::is_same_v<Q, Fp8> ? _mm256_packus_epi16(a, b) : _mm256_packs_epi16(a, b);
}

template <typename Q>
KV_AVX2 void store_bytes8(__m256i b, uint8_t* q) {
  const __m256i w = pack32<Q>(b, b);  // per 128-bit lane: 4 words, twice
  const __m256i y = pack16<Q>(w, w);  // per lane: 4 bytes, four times
  const uint32_t lo = static_cast<uint32_t>(_mm256_cvtsi256_si32(y));
  const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(y, 4));
  std::memcpy(q, &lo, 4);
  std::memcpy(q + 4, &hi, 4);
}

// Four times eight such lanes, as 32 bytes in order: the packs interleave the four by 128-bit
// lane (4 bytes of each), the permutation puts each one's two halves back together.
template <typename Q>
KV_AVX2 void store_bytes32(__m256i a, __m256i b, __m256i c, __m256i d, uint8_t* q) {
  const __m256i y = pack16<Q>(pack32<Q>(a, b), pack32<Q>(c, d));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(y, order));
}

// Fp8::quantize of the quotient y = x / scale, lane by lane, in fewer operations than a lane
// by lane copy of it (an encode is compute-bound): the sign is x's (y's but for quotients that
// underflow, which store as a signed zero either way), "below e4m3's smallest normal" is a
// float compare, and |y| >= 480 (or NaN) becomes 0x7F by an unsigned min, since the normal
// path's bits reach 0x7F exactly there (and exceed it beyond) and the subnormal path's stay <= 8.
KV_AVX2 __m256i fp8_8(__m256 y, __m256 x) {
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 24),
                                        _mm256_set1_epi32(0x80));
  const __m256 magf = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256i mag = _mm256_castps_si256(magf);
  const __m256i denorm = _mm256_set1_epi32(141 << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(magf, _mm256_castsi256_ps(denorm))), denorm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i norm = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(
                                                 static_cast<int>(0x7FFFFu - (120u << 23)))),
                       odd), 20);
  const __m256 small = _mm256_cmp_ps(magf, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ);
  const __m256i bits = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(norm), _mm256_castsi256_ps(sub), small));
  return _mm256_or_si256(_mm256_min_epu32(bits, _mm256_set1_epi32(0x7F)), sign);
}

// Int8::quantize, lane by lane, left signed for the packs' saturation: clamped to [-127, 128]
// first (exact for the rounding trick), rounded half to even, and 128 saturates to 127 in
// store_bytes*, which Int8::quantize's second clamp does.
KV_AVX2 __m256i int8_8(__m256 y) {
  const __m256 round = _mm256_set1_ps(12582912.0f);
  __m256 r = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(128.0f));
  r = _mm256_sub_ps(_mm256_add_ps(r, round), round);
  return _mm256_cvttps_epi32(r);
}

// Sixteen e4m3 bytes as Fp8::level, in two halves of eight: the bits moved into a float16's
// (exponent and mantissa 7 places up) are the value times 2**-8, subnormals included.
KV_AVX2 void fp8_levels16(__m128i bytes, __m256* lo, __m256* hi) {
  const __m256i b = _mm256_cvtepu8_epi16(bytes);
  const __m256i half = _mm256_or_si256(
      _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3F80)),
      _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000))));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
}

KV_AVX2 __m256 int8_levels8(__m128i bytes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// x / s from r = 1 / s (correctly rounded) in three multiplies instead of a division, which
// took ~40% of an encode: q0 = x * r is within an ulp, and one FMA step with the exact
// remainder x - q0 * s rounds it correctly (Markstein's theorem; the scales are positive and
// normal, the quotients at most ~448). A quotient that underflows may differ in its last bits
// and its zero's sign, but every quotient under 2**-10 stores as a zero (fp8: signed by x, in
// fp8_8) or 0 (int8) either way. 1.5e8 random pairs over the scales' whole range matched the
// division.
KV_AVX2 __m256 divide8(__m256 x, __m256 s, __m256 r) {
  const __m256 q0 = _mm256_mul_ps(x, r);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, s, x), r, q0);
}

// Eight scales from at: one each (kEach), or p[0] for all.
template <bool kEach>
KV_AVX2 __m256 scales8(const float* p, int64_t at) {
  return kEach ? _mm256_loadu_ps(p + at) : _mm256_set1_ps(p[0]);
}

// x[at, at + 8) quantized, a value per lane (fp8: its bits; int8: its signed value), under
// scales8 of scales (and of their reciprocals).
template <typename Q, bool kEach, typename T>
KV_AVX2 __m256i bytes8(const T* x, int64_t at, const float* scales, const float* recips) {
  const __m256 v = load8(x + at);
  const __m256 y = divide8(v, scales8<kEach>(scales, at), scales8<kEach>(recips, at));
  if constexpr (std::is_same_v<Q, Fp8>) {
    return fp8_8(y, v);
  } else {
    return int8_8(y);
  }
}

// One row of n values into q: a scale per value (kEach: scales[h], recips[h]) or one for all
// (scales[0], recips[0]). The tail (n % 8) goes through ScalarRows.
template <typename Q, bool kEach, typename T>
KV_AVX2 void quantize_row(const T* x, const float* scales, const float* recips, uint8_t* q,
                          int64_t n) {
  int64_t h = 0;
  for (; h + 32 <= n; h += 32) {
    store_bytes32<Q>(bytes8<Q, kEach>(x, h, scales, recips),
                     bytes8<Q, kEach>(x, h + 8, scales, recips),
                     bytes8<Q, kEach>(x, h + 16, scales, recips),
                     bytes8<Q, kEach>(x, h + 24, scales, recips), q + h);
  }
  for (; h + 8 <= n; h += 8) store_bytes8<Q>(bytes8<Q, kEach>(x, h, scales, recips), q + h);
  ScalarRows::quantize_row<Q>(x + h, kEach ? scales + h : nullptr, scales[0], q + h, n - h);
}

// One row of n stored values into out (the scales already times Q::kUnit): a scale per value
// (kEach) or scales[0] for all.
template <typename Q, bool kEach, typename T>
KV_AVX2 void dequantize_row(const uint8_t* q, const float* scales, T* out, int64_t n) {
  int64_t h = 0;
  if constexpr (std::is_same_v<Q, Fp8>) {
    for (; h + 16 <= n; h += 16) {
      __m256 lo, hi;
      fp8_levels16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + h)), &lo, &hi);
      store8(_mm256_mul_ps(lo, scales8<kEach>(scales, h)), out + h);
      store8(_mm256_mul_ps(hi, scales8<kEach>(scales, h + 8)), out + h + 8);
    }
  } else {
    for (; h + 8 <= n; h += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + h));
      store8(_mm256_mul_ps(int8_levels8(bytes), scales8<kEach>(scales, h)), out + h);
    }
  }
  ScalarRows::dequantize_row<Q>(q + h, kEach ? scales + h : nullptr, scales[0], out + h, n - h);
}

// ScalarRows' block operations (see there), a call per layer's block of rows: the constants
// are set up once a block, not once a row.
struct Avx2Rows {
  template <typename T>
  static KV_AVX2_ROW void amax_columns(const T* x, int64_t rows, int64_t n, float* amax) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t t = 0; t < rows; ++t, x += n) {
      int64_t h = 0;
      for (; h + 8 <= n; h += 8) {
        const __m256 a = _mm256_and_ps(load8(x + h), abs);
        _mm256_storeu_ps(amax + h, _mm256_max_ps(_mm256_loadu_ps(amax + h), a));
      }
      ScalarRows::amax_columns(x + h, 1, n - h, amax + h);
    }
  }
  template <typename T>
  static KV_AVX2_ROW void amax_rows(const T* x, int64_t rows, int64_t n, float* amax) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t t = 0; t < rows; ++t, x += n) {
      __m256 m = _mm256_setzero_ps();
      int64_t h = 0;
      for (; h + 8 <= n; h += 8) m = _mm256_max_ps(m, _mm256_and_ps(load8(x + h), abs));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      ScalarRows::amax_rows(x + h, 1, n - h, amax + t);  // a max of finite values: any order
      for (float v : lanes) amax[t] = std::max(amax[t], v);
    }
  }
  template <typename Q, typename T>
  static KV_AVX2_ROW void quantize(const T* x, int64_t rows, int64_t n, const float* scales,
                                   const float* recips, bool per_row, uint8_t* q,
                                   const T* /*next*/) {
    for (int64_t t = 0; t < rows; ++t, x += n, q += n) {
      if (per_row) {
        quantize_row<Q, false>(x, scales + t, recips + t, q, n);
      } else {
        quantize_row<Q, true>(x, scales, recips, q, n);
      }
    }
  }
  template <typename Q, typename T>
  static KV_AVX2_ROW void dequantize(const uint8_t* q, int64_t rows, int64_t n,
                                     const float* scales, bool per_row, T* out) {
    for (int64_t t = 0; t < rows; ++t, q += n, out += n) {
      if (per_row) {
        dequantize_row<Q, false>(q, scales + t, out, n);
      } else {
        dequantize_row<Q, true>(q, scales, out, n);
      }
    }
  }
};

}  // namespace codec_cpu
}  // namespace kvtier
#endif  // __x86_64__
