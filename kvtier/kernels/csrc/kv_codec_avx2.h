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
// A row function: called (not inlined) from the chunk loops, which are compiled for any CPU.
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

// Eight int32 lanes, each a byte value in [0, 255], stored as eight bytes.
KV_AVX2 void store_bytes8(__m256i b, uint8_t* q) {
  const __m256i w = _mm256_packus_epi32(b, b);       // per 128-bit lane: 4 words, twice
  const __m256i y = _mm256_packus_epi16(w, w);       // per lane: 4 bytes, four times
  const uint32_t lo = static_cast<uint32_t>(_mm256_cvtsi256_si32(y));
  const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(y, 4));
  std::memcpy(q, &lo, 4);
  std::memcpy(q + 4, &hi, 4);
}

// Four times eight such lanes, as 32 bytes in order: the packs interleave the four by 128-bit
// lane (4 bytes of each), the permutation puts each one's two halves back together.
KV_AVX2 void store_bytes32(__m256i a, __m256i b, __m256i c, __m256i d, uint8_t* q) {
  const __m256i y = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(y, order));
}

KV_AVX2 __m256i fp8_8(__m256 y) {  // Fp8::quantize, lane by lane
  const __m256i all = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(all, 24), _mm256_set1_epi32(0x80));
  const __m256i mag = _mm256_and_si256(all, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i denorm = _mm256_set1_epi32(141 << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(denorm))),
      denorm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i norm = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(mag, _mm256_set1_epi32(120 << 23)),
                       _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), odd)), 20);
  // mag < 2**31: the signed compares are the unsigned ones
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), mag);
  const __m256i big = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32((1087 << 20) - 1));
  __m256i bits = _mm256_blendv_epi8(norm, sub, small);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7F), big);
  return _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0xFF)), sign);
}

KV_AVX2 __m256i int8_8(__m256 y) {  // Int8::quantize, lane by lane
  const __m256 round = _mm256_set1_ps(12582912.0f);
  __m256 r = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(128.0f));
  r = _mm256_sub_ps(_mm256_add_ps(r, round), round);
  r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  return _mm256_and_si256(_mm256_cvttps_epi32(r), _mm256_set1_epi32(0xFF));
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

// x / s correctly rounded (as an IEEE division), from r = 1 / s (correctly rounded) in three
// multiplies instead of a division, which took ~40% of an encode: q0 = x * r is within an ulp,
// and one FMA step with the exact remainder x - q0 * s rounds it correctly (Markstein's
// theorem; the scales are positive and normal, the quotients at most ~448). A quotient that
// underflows may differ in its last bits, but every quotient under 2**-10 stores as a zero
// (fp8) or 0 (int8) either way: only its sign counts, which is x's (s > 0), set here so
// that -0 stays -0. 1.5e8 random pairs over the scales' whole range matched the division.
KV_AVX2 __m256 divide8(__m256 x, __m256 s, __m256 r) {
  const __m256 q0 = _mm256_mul_ps(x, r);
  const __m256 q1 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, s, x), r, q0);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_or_ps(_mm256_andnot_ps(sign, q1), _mm256_and_ps(sign, x));
}

// A row being quantized: its values and scales (per value, or one for all when null).
template <typename T>
struct Row {
  const T* x;
  const float* scales;
  const float* recips;
  float scale, recip;
};

// x[at, at + 8) quantized, a byte value per lane.
template <typename Q, typename T>
KV_AVX2 __m256i bytes8(const Row<T>& row, int64_t at) {
  const __m256 s = row.scales ? _mm256_loadu_ps(row.scales + at) : _mm256_set1_ps(row.scale);
  const __m256 r = row.scales ? _mm256_loadu_ps(row.recips + at) : _mm256_set1_ps(row.recip);
  const __m256 y = divide8(load8(row.x + at), s, r);
  return std::is_same_v<Q, Fp8> ? fp8_8(y) : int8_8(y);
}

struct Avx2Rows {
  template <typename T>
  static KV_AVX2_ROW void amax_into(const T* x, float* amax, int64_t n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int64_t h = 0;
    for (; h + 8 <= n; h += 8) {
      const __m256 a = _mm256_and_ps(load8(x + h), abs);
      _mm256_storeu_ps(amax + h, _mm256_max_ps(_mm256_loadu_ps(amax + h), a));
    }
    ScalarRows::amax_into(x + h, amax + h, n - h);
  }
  template <typename T>
  static KV_AVX2_ROW float amax(const T* x, int64_t n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= n; h += 8) m = _mm256_max_ps(m, _mm256_and_ps(load8(x + h), abs));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float best = ScalarRows::amax(x + h, n - h);  // a max of finite values: any order
    for (float v : lanes) best = std::max(best, v);
    return best;
  }
  template <typename Q, typename T>
  static KV_AVX2_ROW void quantize(const T* x, const float* scales, const float* recips,
                                   float scale, float recip, uint8_t* q, int64_t n) {
    const Row<T> row{x, scales, recips, scale, recip};
    int64_t h = 0;
    for (; h + 32 <= n; h += 32) {
      store_bytes32(bytes8<Q>(row, h), bytes8<Q>(row, h + 8), bytes8<Q>(row, h + 16),
                    bytes8<Q>(row, h + 24), q + h);
    }
    for (; h + 8 <= n; h += 8) store_bytes8(bytes8<Q>(row, h), q + h);
    ScalarRows::quantize<Q>(x + h, scales ? scales + h : nullptr, nullptr, scale, recip, q + h,
                            n - h);
  }

  template <typename Q, typename T>
  static KV_AVX2_ROW void dequantize(const uint8_t* q, const float* scales, float scale, T* out,
                                     int64_t n) {
    int64_t h = 0;
    if constexpr (std::is_same_v<Q, Fp8>) {
      for (; h + 16 <= n; h += 16) {
        __m256 lo, hi;
        fp8_levels16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + h)), &lo, &hi);
        const __m256 s0 = scales ? _mm256_loadu_ps(scales + h) : _mm256_set1_ps(scale);
        const __m256 s1 = scales ? _mm256_loadu_ps(scales + h + 8) : s0;
        store8(_mm256_mul_ps(lo, s0), out + h);
        store8(_mm256_mul_ps(hi, s1), out + h + 8);
      }
    } else {
      for (; h + 8 <= n; h += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + h));
        const __m256 s = scales ? _mm256_loadu_ps(scales + h) : _mm256_set1_ps(scale);
        store8(_mm256_mul_ps(int8_levels8(bytes), s), out + h);
      }
    }
    ScalarRows::dequantize<Q>(q + h, scales ? scales + h : nullptr, scale, out + h, n - h);
  }
};

}  // namespace codec_cpu
}  // namespace kvtier
#endif  // __x86_64__
