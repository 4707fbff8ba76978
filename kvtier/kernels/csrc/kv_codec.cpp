// The record codecs of kv_codec.h. Every result is bit-identical to codec.py's torch path (its
// reference and oracle, tests/backends/test_codec_kernel.py), which fixes each operation here:
//
// - a scale is max(amax |x|, 1e-12f) / MAX in float32 (MAX 448 for fp8, 127 for int8), and a
//   value is stored as x / scale, an IEEE division (torch divides by a broadcast tensor, not by
//   a reciprocal);
// - fp8: that quotient rounded to e4m3fn as torch's float -> float8_e4m3fn conversion rounds
//   (nearest even, e4m3 subnormals below 2**-6, |y| >= 480 and NaN to 0x7F);
// - int8: the quotient rounded half to even, clamped to [-127, 127];
// - decode: out = (stored value * scale) in float32, rounded once to the pool dtype (nearest
//   even). codec.py multiplies q * 2**-8 (exact) by scale * 2**8 (exact), the same product.
//   An fp8 byte 0x7F/0xFF (never encoded from finite input) reads as +-480, as codec.py's
//   `_widen` reads it.
//
// Inputs are finite (KV); a NaN in a chunk gives unspecified bytes, not a crash.
#include "kv_codec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif


#define KV_INLINE inline __attribute__((always_inline))

namespace kvtier {
namespace {

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

const Levels& levels() {
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

#if defined(__x86_64__)
bool avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0 &&
           __builtin_cpu_supports("fma") != 0;
  }();
  return has;
}
#endif

struct Shape {
  int64_t planes, layers, tokens, hidden;
  int64_t values() const { return planes * layers * tokens * hidden; }
  int64_t payload_bytes() const {
    return values() + 4 * layers * hidden + (planes == 2 ? 4 * layers * tokens : 0);
  }
};

// The row operations the kernels are made of, plain C++ (compiled for any CPU; the compiler
// vectorizes what it can) ...
struct ScalarRows {
  template <typename T>
  static KV_INLINE void amax_into(const T* x, float* amax, int64_t n) {
    for (int64_t h = 0; h < n; ++h) amax[h] = std::max(amax[h], std::fabs(widen(x[h])));
  }
  template <typename T>
  static KV_INLINE float amax(const T* x, int64_t n) {
    float m = 0.0f;
    for (int64_t h = 0; h < n; ++h) m = std::max(m, std::fabs(widen(x[h])));
    return m;
  }
  // x / scale (scales[h] each, or `scale` for all when scales is null) stored as bytes
  // (`recips`/`recip`: the scales' reciprocals, for the AVX2 rows)
  template <typename Q, typename T>
  static KV_INLINE void quantize(const T* x, const float* scales, const float* /*recips*/,
                                 float scale, float /*recip*/, uint8_t* q, int64_t n) {
    for (int64_t h = 0; h < n; ++h) q[h] = Q::quantize(widen(x[h]) / (scales ? scales[h] : scale));
  }
  // level * scale (scales[h] each, or `scale` for all), the scales already times Q::kUnit
  template <typename Q, typename T>
  static KV_INLINE void dequantize(const uint8_t* q, const float* scales, float scale, T* out,
                                   int64_t n) {
    for (int64_t h = 0; h < n; ++h) narrow(Q::level(q[h]) * (scales ? scales[h] : scale), out + h);
  }
};

#if defined(__x86_64__)
#define KV_AVX2 inline __attribute__((always_inline, target("avx2,f16c,fma")))
// A row function: called (not inlined) from the chunk loops, which are compiled for any CPU.
#define KV_AVX2_ROW __attribute__((target("avx2,f16c,fma")))

// ... and in AVX2 intrinsics, eight values at a time, the same operations lane by lane (the
// compiler vectorizes none of the quantizers: their selects read to it as control flow); each
// row's tail goes through ScalarRows.
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
#endif

template <typename R, typename T, typename Q>
KV_INLINE void encode_chunk(const Shape& s, const T* x, uint8_t* payload) {
  const int64_t L = s.layers, T_ = s.tokens, H = s.hidden;
  std::vector<float> chan(L * H, 0.0f);  // plane 0: a scale per (layer, channel)
  std::vector<float> recips(H);
  for (int64_t l = 0; l < L; ++l) {
    float* scale = chan.data() + l * H;
    for (int64_t t = 0; t < T_; ++t) R::amax_into(x + (l * T_ + t) * H, scale, H);
    for (int64_t h = 0; h < H; ++h) {
      scale[h] = std::max(scale[h], kTiny) / Q::kMax;
      recips[h] = 1.0f / scale[h];
    }
    for (int64_t t = 0; t < T_; ++t) {
      const int64_t at = (l * T_ + t) * H;
      R::template quantize<Q>(x + at, scale, recips.data(), 0.0f, 0.0f, payload + at, H);
    }
  }
  std::memcpy(payload + s.values(), chan.data(), 4 * L * H);  // unaligned in the payload
  if (s.planes != 2) return;
  std::vector<float> tok(L * T_);  // plane 1: a scale per (layer, token)
  const int64_t plane = L * T_ * H;
  for (int64_t r = 0; r < L * T_; ++r) {
    const T* row = x + plane + r * H;
    tok[r] = std::max(R::amax(row, H), kTiny) / Q::kMax;
    R::template quantize<Q>(row, nullptr, nullptr, tok[r], 1.0f / tok[r],
                            payload + plane + r * H, H);
  }
  std::memcpy(payload + s.values() + 4 * L * H, tok.data(), 4 * L * T_);
}

template <typename R, typename T, typename Q>
KV_INLINE void decode_chunk(const Shape& s, const uint8_t* payload, T* out) {
  const int64_t L = s.layers, T_ = s.tokens, H = s.hidden;
  std::vector<float> chan(L * H);
  std::memcpy(chan.data(), payload + s.values(), 4 * L * H);  // unaligned in the payload
  for (float& c : chan) c *= Q::kUnit;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t t = 0; t < T_; ++t) {
      const int64_t at = (l * T_ + t) * H;
      R::template dequantize<Q>(payload + at, chan.data() + l * H, 0.0f, out + at, H);
    }
  }
  if (s.planes != 2) return;
  std::vector<float> tok(L * T_);
  std::memcpy(tok.data(), payload + s.values() + 4 * L * H, 4 * L * T_);
  const int64_t plane = L * T_ * H;
  for (int64_t r = 0; r < L * T_; ++r) {
    R::template dequantize<Q>(payload + plane + r * H, nullptr, tok[r] * Q::kUnit,
                              out + plane + r * H, H);
  }
}

// Each kernel runs with the plain C++ rows or (where the CPU has them, unless `simd` is false)
// the AVX2 + F16C + FMA rows (FMA only where `divide8` wants it: ISO C++ builds contract
// nothing themselves, and a fused multiply-add elsewhere would round differently from torch).
bool use_avx2(bool simd) {
#if defined(__x86_64__)
  return simd && avx2();
#else
  return false;
#endif
}

template <typename T, typename Q>
void encode_as(const Shape& s, const at::Tensor& chunk, uint8_t* p, bool simd) {
  const T* x = reinterpret_cast<const T*>(chunk.data_ptr());
#if defined(__x86_64__)
  if (use_avx2(simd)) return encode_chunk<Avx2Rows, T, Q>(s, x, p);
#endif
  encode_chunk<ScalarRows, T, Q>(s, x, p);
}

template <typename Q, typename T>
void decode_as(const Shape& s, const uint8_t* p, at::Tensor& out, bool simd) {
  T* o = reinterpret_cast<T*>(out.data_ptr());
#if defined(__x86_64__)
  if (use_avx2(simd)) return decode_chunk<Avx2Rows, T, Q>(s, p, o);
#endif
  decode_chunk<ScalarRows, T, Q>(s, p, o);
}

template <typename Q>
void decode_with(const Shape& s, const uint8_t* p, at::Tensor& out, bool simd) {
  switch (out.scalar_type()) {
    case at::kBFloat16:
      return decode_as<Q, c10::BFloat16>(s, p, out, simd);
    case at::kHalf:
      return decode_as<Q, c10::Half>(s, p, out, simd);
    default:
      return decode_as<Q, float>(s, p, out, simd);
  }
}

template <typename Q>
void encode_with(const Shape& s, const at::Tensor& chunk, uint8_t* p, bool simd) {
  switch (chunk.scalar_type()) {
    case at::kBFloat16:
      return encode_as<c10::BFloat16, Q>(s, chunk, p, simd);
    case at::kHalf:
      return encode_as<c10::Half, Q>(s, chunk, p, simd);
    default:
      return encode_as<float, Q>(s, chunk, p, simd);
  }
}

bool is_fp8(const std::string& codec) {
  KV_CHECK(codec == "fp8" || codec == "int8", "codec must be 'fp8' or 'int8', got '", codec,
           "'");
  return codec == "fp8";
}

// The chunk's shape, once `chunk` (named `name`) is a contiguous CPU [1 or 2, L, T, H] tensor
// of a pool dtype the codecs take and `payload` a contiguous CPU uint8 vector of its length.
Shape check(const at::Tensor& chunk, const char* name, const at::Tensor& payload) {
  KV_CHECK(chunk.is_cpu() && chunk.dim() == 4 && chunk.is_contiguous(), name,
           " must be a contiguous 4-D [planes, layers, tokens, hidden] CPU tensor");
  const auto type = chunk.scalar_type();
  KV_CHECK(type == at::kBFloat16 || type == at::kHalf || type == at::kFloat, name,
           " must be bfloat16, float16 or float32, got ", type);
  const Shape s{chunk.size(0), chunk.size(1), chunk.size(2), chunk.size(3)};
  KV_CHECK(s.planes == 1 || s.planes == 2, name, " must have 1 or 2 planes, got ", s.planes);
  KV_CHECK(s.values() > 0, name, " must not be empty");
  KV_CHECK(payload.is_cpu() && payload.dim() == 1 && payload.scalar_type() == at::kByte &&
               payload.is_contiguous(),
           "payload must be a contiguous 1-D uint8 CPU tensor");
  KV_CHECK(payload.numel() == s.payload_bytes(), "payload: ", payload.numel(),
           " bytes for a chunk of ", s.payload_bytes());
  return s;
}

}  // namespace

void codec_encode(const Checked& checked, const at::Tensor& chunk, at::Tensor payload,
                  const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check(chunk, "chunk", payload);
  checked();
  auto* p = payload.data_ptr<uint8_t>();
  return fp8 ? encode_with<Fp8>(s, chunk, p, simd) : encode_with<Int8>(s, chunk, p, simd);
}

void codec_decode(const Checked& checked, const at::Tensor& payload, at::Tensor out,
                  const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check(out, "out", payload);
  checked();
  const auto* p = payload.data_ptr<uint8_t>();
  return fp8 ? decode_with<Fp8>(s, p, out, simd) : decode_with<Int8>(s, p, out, simd);
}

}  // namespace kvtier
