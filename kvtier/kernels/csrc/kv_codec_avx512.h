// The record codecs' AVX-512 rows (kv_codec_avx2.h's AVX2 rows finish each row's tail and do
// what these do not): the encode's scales and quantizers sixteen lanes at a time (AVX-512 F and
// BW; fp8 from bf16 32 values a step with fewer operations, `fp8_words32`, and the next block
// fetched into L2 while one is quantized), and the decode's rounding into bf16 with AVX512-BF16. Compiled with target attributes
// and picked at run time by kv_codec.cpp, like the AVX2 rows. Included by kv_codec.cpp only.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_codec_avx2.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvtier {
namespace codec_cpu {

// Where the CPU also has AVX512-BF16 (and VL): decoding into a bf16 pool rounds each product
// with one VCVTNEPS2BF16 instead of store8's eight operations. That instruction rounds to
// nearest even as narrow() does, but reads float32 subnormals as zero, flushes its subnormal
// results and returns NaNs as they are: kv_codec.cpp takes these rows only for payloads whose
// scales keep every product finite and either zero or normal (`bf16_safe`), where it is exact.
#define KV_BF16 inline __attribute__((always_inline, target("avx2,f16c,fma,avx512f,avx512vl,avx512bf16")))
#define KV_BF16_ROW __attribute__((target("avx2,f16c,fma,avx512f,avx512vl,avx512bf16")))

KV_BF16 void store8_bf16(__m256 v, c10::BFloat16* out) {
  const __m128bh r = _mm256_cvtneps_pbh(v);
  std::memcpy(out, &r, 16);
}

template <typename Q, bool kEach>
KV_BF16 void dequantize_row_bf16(const uint8_t* q, const float* scales, c10::BFloat16* out,
                                 int64_t n) {
  int64_t h = 0;
  if constexpr (std::is_same_v<Q, Fp8>) {
    for (; h + 16 <= n; h += 16) {
      __m256 lo, hi;
      fp8_levels16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + h)), &lo, &hi);
      store8_bf16(_mm256_mul_ps(lo, scales8<kEach>(scales, h)), out + h);
      store8_bf16(_mm256_mul_ps(hi, scales8<kEach>(scales, h + 8)), out + h + 8);
    }
  } else {
    for (; h + 8 <= n; h += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + h));
      store8_bf16(_mm256_mul_ps(int8_levels8(bytes), scales8<kEach>(scales, h)), out + h);
    }
  }
  ScalarRows::dequantize_row<Q>(q + h, kEach ? scales + h : nullptr, scales[0], out + h, n - h);
}

// Avx2Rows' dequantize into bf16 with the rounding above (decode only).
struct Bf16Rows {
  template <typename Q>
  static KV_BF16_ROW void dequantize(const uint8_t* q, int64_t rows, int64_t n,
                                     const float* scales, bool per_row, c10::BFloat16* out) {
    for (int64_t t = 0; t < rows; ++t, q += n, out += n) {
      if (per_row) {
        dequantize_row_bf16<Q, false>(q, scales + t, out, n);
      } else {
        dequantize_row_bf16<Q, true>(q, scales, out, n);
      }
    }
  }
};

// Where the CPU has AVX-512 F and BW: the quantizers sixteen lanes at a time, with mask
// registers for the selects and vpmov narrowing (fp8's bits truncated, int8's values with
// signed saturation, which clamps 128 to 127 as store_bytes* do); the same operations lane by
// lane as fp8_8 / int8_8, so the same bytes; the scales' passes sixteen floats or 32 16-bit
// magnitudes at a time (below).
#define KV_512 inline __attribute__((always_inline, target("avx2,f16c,fma,avx512f,avx512bw")))
#define KV_512_ROW __attribute__((target("avx2,f16c,fma,avx512f,avx512bw")))

KV_512 __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
KV_512 __m512 load16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
KV_512 __m512 load16(const c10::BFloat16* x) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <bool kEach>
KV_512 __m512 scales16(const float* p, int64_t at) {
  return kEach ? _mm512_loadu_ps(p + at) : _mm512_set1_ps(p[0]);
}

template <typename Q, bool kEach, typename T>
KV_512 __m128i bytes16(const T* x, int64_t at, const float* scales, const float* recips) {
  const __m512 v = load16(x + at);
  const __m512 s = scales16<kEach>(scales, at), r = scales16<kEach>(recips, at);
  const __m512 q0 = _mm512_mul_ps(v, r);
  const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, s, v), r, q0);  // divide8's
  if constexpr (std::is_same_v<Q, Fp8>) {  // fp8_8's
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 24),
                                          _mm512_set1_epi32(0x80));
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 magf = _mm512_castsi512_ps(mag);
    const __m512i denorm = _mm512_set1_epi32(141 << 23);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(magf, _mm512_castsi512_ps(denorm))), denorm);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
    const __m512i norm = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(
                                                   static_cast<int>(0x7FFFFu - (120u << 23)))),
                         odd), 20);
    const __mmask16 small = _mm512_cmp_ps_mask(magf, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
    const __m512i bits = _mm512_min_epu32(_mm512_mask_blend_epi32(small, norm, sub),
                                          _mm512_set1_epi32(0x7F));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(bits, sign));
  } else {  // int8_8's
    const __m512 round = _mm512_set1_ps(12582912.0f);
    __m512 r8 = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(128.0f));
    r8 = _mm512_sub_ps(_mm512_add_ps(r8, round), round);
    return _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r8));
  }
}

template <typename Q, bool kEach, typename T>
KV_512 void quantize_row16(const T* x, const float* scales, const float* recips, uint8_t* q,
                           int64_t n) {
  int64_t h = 0;
  for (; h + 16 <= n; h += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + h),
                     bytes16<Q, kEach>(x, h, scales, recips));
  }
  // the rest (n % 16) on the AVX2 row: a row scale stays scales[0]
  quantize_row<Q, kEach>(x + h, kEach ? scales + h : scales, kEach ? recips + h : recips,
                         q + h, n - h);
}

// fp8 from bf16 with fewer operations a value, the same bytes (32 values a step): the input's
// magnitudes widened in two interleaved halves by unpacking (which the 16-bit pack at the end
// undoes: no widening shift, no per-half narrowing), each half's quotient |x| / scale rounded
// to its e4m3 code in one float add, and the sign and the clamp to 0x7F applied to 16-bit codes.
// The rounding: with 2**E the exponent of max(|y|, 2**-6) (a power of two, from a max and an
// and), s = |y| + 2**(E+20) rounds |y| to a multiple of 2**(E-3), to nearest even, as e4m3
// rounds at exponent E (subnormals: E = -6, steps of 2**-9). s's mantissa counts those steps
// (at most 16) and its exponent is E + 20 + 127, so the code, count + 8 (E + 6), is
// (low 16 bits + high 16 bits / 16) - 8 * 141 of s's bits: one multiply-add of the two halves
// (16 low + high, = 16 (code + 1128), under 2**15) here, the rest on 16-bit lanes; 0x7F from
// 480 up (the clamp).
KV_512 __m512i fp8_codes16(__m512 mag, __m512 s, __m512 r) {
  const __m512 q0 = _mm512_mul_ps(mag, r);
  const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, s, mag), r, q0);  // divide8's
  const __m512i e = _mm512_and_si512(_mm512_castps_si512(_mm512_max_ps(y, _mm512_set1_ps(0x1p-6f))),
                                     _mm512_set1_epi32(0x7F800000));
  const __m512 sum = _mm512_fmadd_ps(_mm512_castsi512_ps(e), _mm512_set1_ps(0x1p20f), y);
  return _mm512_madd_epi16(_mm512_castps_si512(sum), _mm512_set1_epi32((1 << 16) | 16));
}

// 32 bf16 values at x to their fp8 bytes, as 16-bit codes in x's order (sign included);
// scales and recips: (kEach) 32 per-channel values permuted as `fp8_order32` puts them, else
// one for all.
template <bool kEach>
KV_512 __m512i fp8_words32(const c10::BFloat16* x, const float* scales, const float* recips) {
  const __m512i raw = _mm512_loadu_si512(x);
  const __m512i abs = _mm512_and_si512(raw, _mm512_set1_epi16(0x7FFF));
  const __m512i zero = _mm512_setzero_si512();
  const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, abs));
  const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, abs));
  const __m512i clo = fp8_codes16(lo, scales16<kEach>(scales, 0), scales16<kEach>(recips, 0));
  const __m512i chi = fp8_codes16(hi, scales16<kEach>(scales, kEach ? 16 : 0),
                                  scales16<kEach>(recips, kEach ? 16 : 0));
  const __m512i sixteen = _mm512_packs_epi32(clo, chi);  // 16 (code + 1128), in x's order
  const __m512i codes = _mm512_min_epi16(
      _mm512_sub_epi16(_mm512_srli_epi16(sixteen, 4), _mm512_set1_epi16(8 * 141)),
      _mm512_set1_epi16(0x7F));
  // codes | (raw >> 8 & 0x80): the sign
  return _mm512_ternarylogic_epi32(codes, _mm512_srli_epi16(raw, 8), _mm512_set1_epi16(0x80),
                                   0xF8);
}

// Per-channel scales in the order fp8_words32's unpacked halves hold their channels: of each
// 32, the low half of every 128-bit lane's eight (channels 8k..8k+3), then the high halves.
KV_512 void fp8_order32(const float* in, float* out, int64_t n) {
  for (int64_t g = 0; g + 32 <= n; g += 32) {
    for (int k = 0; k < 4; ++k) {
      for (int j = 0; j < 4; ++j) {
        out[g + 4 * k + j] = in[g + 8 * k + j];
        out[g + 16 + 4 * k + j] = in[g + 8 * k + 4 + j];
      }
    }
  }
}

// One row of bf16 values to fp8, 64 then 32 at a time, the rest on quantize_row16; `ps`, `pr`
// the permuted scales and recips (kEach), `scales`, `recips` as quantize_row16 takes them.
template <bool kEach>
KV_512 void fp8_row_bf16(const c10::BFloat16* x, const float* ps, const float* pr,
                         const float* scales, const float* recips, uint8_t* q, int64_t n,
                         const c10::BFloat16* next) {
  // the 16-bit packs interleave two 32-code vectors by 128-bit lane: put each one's back together
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  int64_t h = 0;
  for (; h + 64 <= n; h += 64) {
    if (next != nullptr) {  // the same 128 bytes of the next block: one line at a time
      _mm_prefetch(reinterpret_cast<const char*>(next + h), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + h + 32), _MM_HINT_T1);
    }
    const __m512i a = fp8_words32<kEach>(x + h, ps + (kEach ? h : 0), pr + (kEach ? h : 0));
    const __m512i b = fp8_words32<kEach>(x + h + 32, ps + (kEach ? h + 32 : 0),
                                         pr + (kEach ? h + 32 : 0));
    _mm512_storeu_si512(q + h, _mm512_permutexvar_epi64(order, _mm512_packus_epi16(a, b)));
  }
  if (next != nullptr) {
    for (int64_t at = h; at < n; at += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T1);
    }
  }
  if (h + 32 <= n) {
    const __m512i a = fp8_words32<kEach>(x + h, ps + (kEach ? h : 0), pr + (kEach ? h : 0));
    const __m512i bytes = _mm512_permutexvar_epi64(order, _mm512_packus_epi16(a, a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + h), _mm512_castsi512_si256(bytes));
    h += 32;
  }
  quantize_row16<Fp8, kEach>(x + h, kEach ? scales + h : scales, kEach ? recips + h : recips,
                             q + h, n - h);
}

// A finite 16-bit float's magnitude orders as its bits & 0x7FFF (bf16 and fp16 alike, zeros and
// subnormals included), so the scales' passes over such a block take the unsigned max of those
// bits, 32 values an instruction, and widen one result a row or column: the same amax.
template <typename T>
constexpr bool kBits16 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

template <typename T>
KV_512 __m512i magnitudes32(const T* x) {
  return _mm512_and_si512(_mm512_loadu_si512(x), _mm512_set1_epi16(0x7FFF));
}

template <typename T>
KV_512 float widen_bits(uint16_t bits) {
  T v;
  v.x = bits;
  return widen(v);
}

struct Avx512Rows : Avx2Rows {
  template <typename T>
  static KV_512_ROW void amax_columns(const T* x, int64_t rows, int64_t n, float* amax) {
    if constexpr (kBits16<T>) {
      const int64_t wide = n - n % 32;
      std::vector<uint16_t> most(wide, 0);
      for (int64_t t = 0; t < rows; ++t, x += n) {
        for (int64_t h = 0; h < wide; h += 32) {
          __m512i* at = reinterpret_cast<__m512i*>(most.data() + h);
          _mm512_storeu_si512(at, _mm512_max_epu16(_mm512_loadu_si512(at), magnitudes32(x + h)));
        }
        Avx2Rows::amax_columns(x + wide, 1, n - wide, amax + wide);
      }
      for (int64_t h = 0; h < wide; ++h) amax[h] = std::max(amax[h], widen_bits<T>(most[h]));
      return;
    }
    for (int64_t t = 0; t < rows; ++t, x += n) {
      int64_t h = 0;
      for (; h + 16 <= n; h += 16) {
        _mm512_storeu_ps(amax + h,
                         _mm512_max_ps(_mm512_loadu_ps(amax + h), _mm512_abs_ps(load16(x + h))));
      }
      Avx2Rows::amax_columns(x + h, 1, n - h, amax + h);
    }
  }
  template <typename T>
  static KV_512_ROW void amax_rows(const T* x, int64_t rows, int64_t n, float* amax) {
    if constexpr (kBits16<T>) {
      for (int64_t t = 0; t < rows; ++t, x += n) {
        __m512i m = _mm512_setzero_si512();
        int64_t h = 0;
        for (; h + 32 <= n; h += 32) m = _mm512_max_epu16(m, magnitudes32(x + h));
        const __m256i m16 = _mm256_max_epu16(_mm512_castsi512_si256(m),
                                             _mm512_extracti64x4_epi64(m, 1));
        const __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m16),
                                         _mm256_extracti128_si256(m16, 1));
        // the largest of 8 lanes: the smallest of their complements
        const __m128i ones = _mm_set1_epi16(-1);
        const auto most = static_cast<uint16_t>(
            ~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m8, ones))));
        Avx2Rows::amax_rows(x + h, 1, n - h, amax + t);  // a max of finite values: any order
        amax[t] = std::max(amax[t], widen_bits<T>(most));
      }
      return;
    }
    for (int64_t t = 0; t < rows; ++t, x += n) {
      __m512 m = _mm512_setzero_ps();
      int64_t h = 0;
      for (; h + 16 <= n; h += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + h)));
      Avx2Rows::amax_rows(x + h, 1, n - h, amax + t);  // a max of finite values: any order
      amax[t] = std::max(amax[t], _mm512_reduce_max_ps(m));
    }
  }
  // `next`: the block after this one (or nullptr), a row's worth of it fetched into L2 with each
  // row: its scales' pass then reads from L2 what would otherwise stall it on memory, while
  // this block's quantizers keep the core busy
  template <typename Q, typename T>
  static KV_512_ROW void quantize(const T* x, int64_t rows, int64_t n, const float* scales,
                                  const float* recips, bool per_row, uint8_t* q, const T* next) {
    std::vector<float> order;
    if constexpr (std::is_same_v<Q, Fp8> && std::is_same_v<T, c10::BFloat16>) {
      if (!per_row) {
        order.resize(2 * n);
        fp8_order32(scales, order.data(), n);
        fp8_order32(recips, order.data() + n, n);
      }
    }
    for (int64_t t = 0; t < rows; ++t, x += n, q += n) {
      const T* ahead = next == nullptr ? nullptr : next + t * n;
      if constexpr (std::is_same_v<Q, Fp8> && std::is_same_v<T, c10::BFloat16>) {
        if (per_row) {
          fp8_row_bf16<false>(x, scales + t, recips + t, scales + t, recips + t, q, n, ahead);
        } else {
          fp8_row_bf16<true>(x, order.data(), order.data() + n, scales, recips, q, n, ahead);
        }
        continue;
      }
      if (ahead != nullptr) {
        const char* row = reinterpret_cast<const char*>(ahead);
        for (int64_t at = 0; at < n * static_cast<int64_t>(sizeof(T)); at += 64) {
          _mm_prefetch(row + at, _MM_HINT_T1);
        }
      }
      if (per_row) {
        quantize_row16<Q, false>(x, scales + t, recips + t, q, n);
      } else {
        quantize_row16<Q, true>(x, scales, recips, q, n);
      }
    }
  }
};

}  // namespace codec_cpu
}  // namespace kvtier
#endif  // __x86_64__
