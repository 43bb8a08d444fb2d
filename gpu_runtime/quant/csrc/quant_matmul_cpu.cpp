// y = x @ W.T with W kept in its GGUF blocks (one uint8 row of blocks per output feature), on the CPU.
//
// Decode batches (few rows of x), by `activation_bits` (gpu_runtime/quant/linear.py chooses):
// - 16, the default for 1-7 rows: x rounded to int16 per 32 values, each weight block widened to int16 and
//   dotted with AVX2 madd (VNNI dpwssd where the CPU has it), scaled once per block; at batch 1 the scales of 8
//   blocks at a time come from one gather (grouped_blocks). Each value of x is off by at most amax/65534.
//   (llama.cpp's int8 x, q8_1, was measured here too and removed: SmolLM2's activation outliers cost it the 99%
//   top-1 agreement the float path has, at the int16 path's speed: docs/BENCHMARKS.md.)
// - 32, from 8 rows: each weight block dequantized into registers (AVX2 for the 32-value types; a row at a time
//   into L1 for the k-quants and CPUs without AVX2) and multiplied into float x: exact up to summation order.
// Threads split the output rows (at::parallel_for).
// Larger batches (prefill): `dequantize` gives W as float32 for oneDNN's GEMM (gpu_runtime/quant/linear.py);
// `matmul_tiled` (a tile of W at a time through at::mm) is kept for the benchmark's comparison.
//
// Block layouts are ggml's (ggml-common.h); the dequantizers here match gpu_runtime/gguf/dequantize.py bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKEND_QUANT_AVX2 1
#endif

namespace {

// ggml's type ids (GGMLQuantizationType).
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14;
constexpr int QK = 32;     // values per block of the simple types, and per block of the quantized activation
constexpr int QK_K = 256;  // values per k-quant super-block

struct TypeInfo {
  int block_values;
  int block_bytes;
};

TypeInfo type_info(int64_t type) {
  switch (type) {
    case Q4_0: return {QK, 18};
    case Q4_1: return {QK, 20};
    case Q8_0: return {QK, 34};
    case Q4_K: return {QK_K, 144};
    case Q6_K: return {QK_K, 210};
  }
  TORCH_CHECK(false, "tokend quant: unsupported ggml type ", type);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Q4_K's eight 6-bit scales and mins from its 12 packed bytes (ggml's get_scale_min_k4).
inline void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---- dequantization: one row of blocks into `k` floats ----

void dequantize_row(int64_t type, const uint8_t* row, float* out, int64_t k) {
  const TypeInfo info = type_info(type);
  const int64_t nb = k / info.block_values;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = row + b * info.block_bytes;
    float* y = out + b * info.block_values;
    if (type == Q8_0) {
      const float d = f16(w);
      const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
      for (int i = 0; i < QK; ++i) y[i] = q[i] * d;
    } else if (type == Q4_0) {
      const float d = f16(w);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * ((w[2 + i] & 0xF) - 8);
        y[i + 16] = d * ((w[2 + i] >> 4) - 8);
      }
    } else if (type == Q4_1) {
      const float d = f16(w), m = f16(w + 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * (w[4 + i] & 0xF) + m;
        y[i + 16] = d * (w[4 + i] >> 4) + m;
      }
    } else if (type == Q4_K) {
      const float d = f16(w), dmin = f16(w + 2);
      const uint8_t* qs = w + 16;
      for (int r = 0; r < 4; ++r) {
        int sc0, m0, sc1, m1;
        k4_scale_min(w + 4, 2 * r, sc0, m0);
        k4_scale_min(w + 4, 2 * r + 1, sc1, m1);
        const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
        for (int i = 0; i < 32; ++i) {
          y[r * 64 + i] = d0 * (qs[r * 32 + i] & 0xF) - o0;
          y[r * 64 + 32 + i] = d1 * (qs[r * 32 + i] >> 4) - o1;
        }
      }
    } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
      const uint8_t* ql = w;
      const uint8_t* qh = w + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      const float d = f16(w + 208);
      for (int r = 0; r < 2; ++r) {
        for (int s = 0; s < 4; ++s) {
          for (int i = 0; i < 32; ++i) {
            const int idx = r * 128 + s * 32 + i;
            const uint8_t low_byte = ql[r * 64 + (s & 1) * 32 + i];
            const int low = s < 2 ? (low_byte & 0xF) : (low_byte >> 4);
            const int high = (qh[r * 32 + i] >> (2 * s)) & 3;
            y[idx] = d * sc[idx / 16] * ((low | (high << 4)) - 32);
          }
        }
      }
    }
  }
}

#ifdef TOKEND_QUANT_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The float-activation path for the 32-value types: each weight block dequantized into four registers (the same
// float32 values as dequantize_row's), then multiplied into R float rows of x. No rounding of x, so the result is
// the dequantized float32 matmul's up to summation order.
inline __m256 bytes8_u8(const __m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 bytes8_s8(const __m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

inline void dequantize_block32(int64_t type, const uint8_t* w, __m256 v[4]) {
  if (type == Q8_0) {
    const __m256 d = _mm256_set1_ps(f16(w));
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 18));
    v[0] = _mm256_mul_ps(bytes8_s8(lo), d);
    v[1] = _mm256_mul_ps(bytes8_s8(_mm_srli_si128(lo, 8)), d);
    v[2] = _mm256_mul_ps(bytes8_s8(hi), d);
    v[3] = _mm256_mul_ps(bytes8_s8(_mm_srli_si128(hi, 8)), d);
    return;
  }
  const int qs = type == Q4_0 ? 2 : 4;
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  const __m256 n[4] = {bytes8_u8(lo), bytes8_u8(_mm_srli_si128(lo, 8)), bytes8_u8(hi), bytes8_u8(_mm_srli_si128(hi, 8))};
  const __m256 d = _mm256_set1_ps(f16(w));
  if (type == Q4_0) {
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int j = 0; j < 4; ++j) v[j] = _mm256_mul_ps(d, _mm256_sub_ps(n[j], eight));
  } else {
    const __m256 m = _mm256_set1_ps(f16(w + 2));
    for (int j = 0; j < 4; ++j) v[j] = _mm256_add_ps(_mm256_mul_ps(d, n[j]), m);
  }
}

template <int R>
void dot_rows_f32(int64_t type, const uint8_t* w, const float* x, int64_t k, float* out, int64_t out_stride) {
  const int stride = type_info(type).block_bytes;
  // At least four independent FMA chains (A a row), so that FMA latency does not bound a few rows, and few enough
  // accumulators to stay in registers at eight rows.
  constexpr int A = R >= 8 ? 1 : (R >= 4 ? 2 : 4);
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / QK; ++b, w += stride) {
    __m256 v[4];
    dequantize_block32(type, w, v);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + b * QK;
      for (int j = 0; j < 4; ++j) acc[r][j % A] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[r][a]);
    out[r * out_stride] = hsum(sum);
  }
}


// ---- the 16-bit-activation path ----
// Each 32 values of x are rounded to int16 with the scale amax/32767 (so each is off by at most amax/65534, 258
// times less than int8's amax/254: an outlier no longer crushes its block's other values), and each weight block
// is widened to int16 once for all R rows. One madd multiplies 16 value pairs into 8 int32 lanes, twice the
// float FMA's 8, with no int-to-float conversion per weight: a block costs a conversion and an FMA per row.

struct Q16Rows {
  int64_t rows, blocks;
  std::vector<int16_t> q;  // [rows][blocks * 32]
  std::vector<float> d;    // the scale: [rows][blocks]
  std::vector<float> sum;  // the block's float sum, for the types whose values carry an offset: [rows][blocks]
};

Q16Rows quantize_activation16(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / QK;
  Q16Rows a{rows, blocks, std::vector<int16_t>(rows * k), std::vector<float>(rows * blocks),
            std::vector<float>(rows * blocks)};
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const float* v = x + i * QK;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < QK; ++j) {
      amax = std::max(amax, std::fabs(v[j]));
      sum += v[j];
    }
    const float d = amax / 32767.f;
    const float id = d > 0.f && std::isfinite(sum) ? 1.f / d : 0.f;
    int16_t* q = a.q.data() + i * QK;
    for (int j = 0; j < QK; ++j) q[j] = static_cast<int16_t>(std::nearbyint(v[j] * id));
    a.d[i] = std::isfinite(sum) ? d : NAN;  // a NaN or infinity in x reaches the output, as the float path's would
    a.sum[i] = sum;
  }
  return a;
}

// How far ahead of the block being multiplied its weight row is prefetched. The rows are read in order, but one
// core's hardware prefetcher alone left a batch-1 pass over SmolLM2's weights at 4.3 GB/s here (22.3 ms); 4 KB
// ahead it took 16.2-16.9 ms (2, 8 and 12 KB: 17-18 ms); with the grouped scales below, 12.4-12.8 ms (2 and 8 KB
// measured no better).
constexpr int64_t PREFETCH_BYTES = 4096;

// One block of 32 weights as w = d * (lo, hi) + offset: lo and hi hold the values 0..15 and 16..31 as int16.
struct Block16 {
  __m256i lo, hi;
  float d, offset;
};

inline __m256i widen_u8(__m128i v) { return _mm256_cvtepu8_epi16(v); }

inline bool is_simple(int64_t type) { return type == Q8_0 || type == Q4_0 || type == Q4_1; }

inline int simple_block_bytes(int64_t type) { return type == Q8_0 ? 34 : (type == Q4_0 ? 18 : 20); }

// A simple type's block `b` of a row, its values only (as int16, without d or m): Q8_0's bytes; Q4_0's nibbles - 8;
// Q4_1's nibbles. Byte i of a 4-bit block holds value i (low nibble) and value i + 16 (high).
inline void simple_values16(int64_t type, const uint8_t* row, int64_t b, __m256i& lo, __m256i& hi) {
  const uint8_t* w = row + b * simple_block_bytes(type);
  if (type == Q8_0) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 18)));
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (type == Q4_0 ? 2 : 4)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = widen_u8(_mm_and_si128(raw, mask));
  hi = widen_u8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
  if (type == Q4_0) {
    lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8));
    hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
  }
}

// The scales of up to 8 consecutive simple blocks of a row (the lanes set in `lanes`; the others 0), from one
// gather: each block starts with d (f16), and Q4_1's with m after it, so one 32-bit load a block fetches both. Converting 8 at once, not one by one, is what makes
// them vector work in the grouped loop below.
inline void simple_scales8(int64_t type, const uint8_t* row, int64_t b, __m256i lanes, __m256& d, __m256& m) {
  const int stride = simple_block_bytes(type);
  const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  const __m256i dm = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(row + b * stride),
                                                 offsets, lanes, 1);
  const __m256i low = _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF));
  d = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  if (type == Q4_1) {
    const __m256i high = _mm256_srli_epi32(dm, 16);
    m = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
  } else {
    m = _mm256_setzero_ps();
  }
}

// The weight block `b` (of 32 values) of a row: the simple types' own block, or a k-quant super-block's 32.
inline Block16 weight_block16(int64_t type, const uint8_t* row, int64_t b) {
  if (is_simple(type)) {
    Block16 block;
    simple_values16(type, row, b, block.lo, block.hi);
    const uint8_t* w = row + b * simple_block_bytes(type);
    block.d = f16(w);
    block.offset = type == Q4_1 ? f16(w + 2) : 0.f;  // Q4_1: d * n + m
    return block;
  }
  if (type == Q4_K) {  // sub-block j of 8: the low nibbles of 32 bytes (j even) or their high ones (j odd)
    const uint8_t* w = row + (b / 8) * 144;
    const int j = b % 8;
    int sc, mn;
    k4_scale_min(w + 4, j, sc, mn);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + (j / 2) * 32));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i n = (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask) : _mm256_and_si256(raw, mask);
    return {widen_u8(_mm256_castsi256_si128(n)), widen_u8(_mm256_extracti128_si256(n, 1)), f16(w) * sc,
            -f16(w + 2) * mn};
  }
  // Q6_K: sub-block s of 8 (s = half * 4 + quarter), 6-bit values - 32, each 16 with their own int8 scale, folded
  // into the int16 weight (|q - 32| <= 32, |scale| <= 128: at most 4096).
  const uint8_t* w = row + (b / 8) * 210;
  const int half = (b % 8) / 4, s = b % 4;
  const __m256i low_src = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + half * 64 + (s & 1) * 32));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i low = s < 2 ? _mm256_and_si256(low_src, mask) : _mm256_and_si256(_mm256_srli_epi16(low_src, 4), mask);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + half * 32));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
  const __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));  // 0..63
  const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192) + half * 8 + s * 2;
  const __m256i m32 = _mm256_set1_epi16(32);
  const __m256i lo = _mm256_mullo_epi16(_mm256_sub_epi16(widen_u8(_mm256_castsi256_si128(q)), m32),
                                        _mm256_set1_epi16(scales[0]));
  const __m256i hi = _mm256_mullo_epi16(_mm256_sub_epi16(widen_u8(_mm256_extracti128_si256(q, 1)), m32),
                                        _mm256_set1_epi16(scales[1]));
  return {lo, hi, f16(w + 208), 0.f};
}

// The 8 int32 partial sums of 32 int16 products (pairs added by madd; VNNI fuses the add where the CPU has it).
inline __m256i dot16(const Block16& w, __m256i x0, __m256i x1) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w.lo, x0), w.hi, x1);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w.lo, x0), w.hi, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
#endif
}

// One activation row against W weight rows of a simple type, 8 blocks a group: the 8 blocks' scales of each weight
// row come from one gather, their products with x's 8 scales from one multiply, and Q4_1's min term from one FMA,
// where the per-block loop does each of them block by block, as scalars (about half its instructions at batch 1).
// Accumulates into acc and offset; the last group may be short (a 576-wide row is 18 blocks: 8, 8 and 2).
template <int W>
void grouped_blocks(int64_t type, const uint8_t* w, int64_t row_bytes, const Q16Rows& a, int64_t r0, __m256 acc[W],
                    float offset[W]) {
  const int64_t nb = a.blocks;
  const int64_t first = r0 * nb;  // this activation row's first block
  __m256 offsets[W];
  for (int c = 0; c < W; ++c) offsets[c] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 dx = _mm256_maskload_ps(a.d.data() + first + b0, lanes);
    const __m256 sx = _mm256_maskload_ps(a.sum.data() + first + b0, lanes);
    __m256 scale[W];
    for (int c = 0; c < W; ++c) {
      __m256 dw, mw;
      simple_scales8(type, w + c * row_bytes, b0, lanes, dw, mw);
      scale[c] = _mm256_mul_ps(dw, dx);
      offsets[c] = _mm256_fmadd_ps(mw, sx, offsets[c]);
    }
    for (int j = 0; j < count; ++j) {
      const int64_t b = b0 + j;
      const int16_t* x = a.q.data() + (first + b) * QK;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      const __m256i lane = _mm256_set1_epi32(j);
      for (int c = 0; c < W; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(w + c * row_bytes + b * row_bytes / nb + PREFETCH_BYTES),
                     _MM_HINT_T0);
        Block16 block;
        simple_values16(type, w + c * row_bytes, b, block.lo, block.hi);
        const __m256 p = _mm256_cvtepi32_ps(dot16(block, x0, x1));
        acc[c] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(scale[c], lane), p, acc[c]);
      }
    }
  }
  for (int c = 0; c < W; ++c) offset[c] += hsum(offsets[c]);
}

// R activation rows against W consecutive weight rows: each weight block widened once and met by all R rows, each
// activation block loaded once and met by all W weight rows (at batch 1 the W rows are what amortises x's loads).
template <int R, int W>
void dot_tile_int16(int64_t type, const uint8_t* w, int64_t row_bytes, const Q16Rows& a, int64_t r0, float* out,
                    int64_t out_stride) {
  __m256 acc[R][W];
  float offset[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      offset[r][c] = 0.f;
    }
  const int64_t nb = a.blocks;
  int64_t b = 0;  // the blocks before b are done
  if constexpr (R == 1) {
    if (is_simple(type)) {
      grouped_blocks<W>(type, w, row_bytes, a, r0, acc[0], offset[0]);
      b = nb;
    }
  }
  for (; b < nb; ++b) {
    Block16 block[W];
    for (int c = 0; c < W; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * row_bytes + b * row_bytes / nb + PREFETCH_BYTES),
                   _MM_HINT_T0);
      block[c] = weight_block16(type, w + c * row_bytes, b);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const int16_t* x = a.q.data() + i * QK;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      for (int c = 0; c < W; ++c) {
        const __m256 p = _mm256_cvtepi32_ps(dot16(block[c], x0, x1));
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(block[c].d * a.d[i]), p, acc[r][c]);
        offset[r][c] += block[c].offset * a.sum[i];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) out[r * out_stride + c] = hsum(acc[r][c]) + offset[r][c];
}

// Rows [begin, end) of W against every row of x, R rows of x and W rows of W a tile (the last ones narrower).
template <int R, int W>
void matmul_rows_int16(int64_t type, const uint8_t* wp, int64_t row_bytes, const Q16Rows& a, int64_t begin,
                       int64_t end, float* yp, int64_t n) {
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    int64_t r = 0;
    for (; r + R <= a.rows; r += R) dot_tile_int16<R, W>(type, wp + i * row_bytes, row_bytes, a, r, yp + r * n + i, n);
    for (; r < a.rows; ++r) dot_tile_int16<1, W>(type, wp + i * row_bytes, row_bytes, a, r, yp + r * n + i, n);
  }
  for (; i < end; ++i) {
    int64_t r = 0;
    for (; r + R <= a.rows; r += R) dot_tile_int16<R, 1>(type, wp + i * row_bytes, row_bytes, a, r, yp + r * n + i, n);
    for (; r < a.rows; ++r) dot_tile_int16<1, 1>(type, wp + i * row_bytes, row_bytes, a, r, yp + r * n + i, n);
  }
}

#endif  // TOKEND_QUANT_AVX2

inline float dot_f32(const float* a, const float* b, int64_t k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += a[i] * b[i];
  return s;
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == k,
              "tokend quant: x must be a contiguous float32 [rows, ", k, "] tensor");
  const TypeInfo info = type_info(type);
  TORCH_CHECK(k % info.block_values == 0, "tokend quant: in_features ", k, " is not a multiple of ",
              info.block_values);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) == k / info.block_values * info.block_bytes,
              "tokend quant: w must be contiguous uint8 [out_features, ", k / info.block_values * info.block_bytes,
              "]");
}

}  // namespace

// W's rows as float32 [N, k].
at::Tensor quant_dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "tokend quant: w must be uint8");
  const int64_t n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#ifdef TOKEND_QUANT_AVX2
      if (type == Q8_0 || type == Q4_0 || type == Q4_1) {  // in registers, 32 values a block (prefill's tiles)
        const int stride = type_info(type).block_bytes;
        for (int64_t b = 0; b < k / QK; ++b) {
          __m256 v[4];
          dequantize_block32(type, src + i * row_bytes + b * stride, v);
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + i * k + b * QK + 8 * j, v[j]);
        }
        continue;
      }
#endif
      dequantize_row(type, src + i * row_bytes, dst + i * k, k);
    }
  });
  return out;
}

// Decode: x [M, k] float32 times W.T, M small; x rounded to int16 (activation_bits 16, AVX2) or kept float (32).
at::Tensor quant_matmul_decode(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t k,
                               int64_t activation_bits) {
  check_inputs(x, w, type, k);
  TORCH_CHECK(activation_bits == 16 || activation_bits == 32, "tokend quant: activation_bits must be 16 or 32, not ",
              activation_bits);
  const int64_t m = x.size(0), n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
#ifdef TOKEND_QUANT_AVX2
  if (activation_bits == 16) {
    const Q16Rows a = quantize_activation16(xp, m, k);
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      if (m <= 2) {
        matmul_rows_int16<1, 4>(type, wp, row_bytes, a, begin, end, yp, n);
      } else {
        matmul_rows_int16<4, 2>(type, wp, row_bytes, a, begin, end, yp, n);
      }
    });
    return out;
  }
  if (type == Q8_0 || type == Q4_0 || type == Q4_1) {
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t* row = wp + i * row_bytes;
        int64_t r = 0;
        for (; r + 8 <= m; r += 8) dot_rows_f32<8>(type, row, xp + r * k, k, yp + r * n + i, n);
        for (; r + 4 <= m; r += 4) dot_rows_f32<4>(type, row, xp + r * k, k, yp + r * n + i, n);
        switch (m - r) {
          case 3: dot_rows_f32<3>(type, row, xp + r * k, k, yp + r * n + i, n); break;
          case 2: dot_rows_f32<2>(type, row, xp + r * k, k, yp + r * n + i, n); break;
          case 1: dot_rows_f32<1>(type, row, xp + r * k, k, yp + r * n + i, n); break;
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);  // one dequantized weight row, in L1 while every x row meets it
    for (int64_t i = begin; i < end; ++i) {
      dequantize_row(type, wp + i * row_bytes, row.data(), k);
      for (int64_t r = 0; r < m; ++r) yp[r * n + i] = dot_f32(row.data(), xp + r * k, k);
    }
  });
  return out;
}

// Prefill: x [M, k] times W.T, a tile of W's rows dequantized at a time into float32 for torch's GEMM (the
// tile stays in cache, and the whole float32 matrix is never held).
at::Tensor quant_matmul_tiled(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t k, int64_t tile_rows) {
  check_inputs(x, w, type, k);
  const int64_t m = x.size(0), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  tile_rows = std::max<int64_t>(tile_rows, 1);
  for (int64_t start = 0; start < n; start += tile_rows) {
    const int64_t rows = std::min(tile_rows, n - start);
    at::Tensor tile = quant_dequantize(w.narrow(0, start, rows), type, k);
    out.narrow(1, start, rows).copy_(at::mm(x, tile.t()));
  }
  return out;
}

TORCH_LIBRARY(tokend_quant, m) {
  m.def("dequantize(Tensor w, int type, int k) -> Tensor");
  m.def("matmul_decode(Tensor x, Tensor w, int type, int k, int activation_bits) -> Tensor");
  m.def("matmul_tiled(Tensor x, Tensor w, int type, int k, int tile_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokend_quant, CPU, m) {
  m.impl("dequantize", &quant_dequantize);
  m.impl("matmul_decode", &quant_matmul_decode);
  m.impl("matmul_tiled", &quant_matmul_tiled);
}
