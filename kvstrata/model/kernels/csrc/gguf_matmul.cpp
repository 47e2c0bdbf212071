// A GGUF's quantized matrices (Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K) times activation rows, the
// weights read at their own bits or near them (gguf_blocks.h: the layout each kind is packed into). A decode
// step is memory-bound: what it costs is the bytes of weights it reads, so the weights stay 4.5-10 bits and
// the activations come down to them instead, as llama.cpp does: each row is quantized to int8 in blocks of 32
// (d = max|x| / 127), and a weight block times an activation block is one integer dot product (VNNI's u8 x s8
// -> s32), scaled once in float32.
//
// Exactness: a block's integer sum s = sum((q - offset) * xq) is exact on every path; then
// acc = fma(d, float(s) * dx, acc) (and the kinds with a minimum: acc = fma(m, dx * sum(xq), acc)), block after
// block in order (Q6_K: each half block's sum s_h, acc = fma(d * sc_h, float(s_h) * dx, acc), d * sc_h exact in
// float32). The AVX-512 VNNI, AVX2 and plain paths do these same float operations, so they give the same bits,
// and a row's result depends only on that row: never on the rows beside it, their number or the thread.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"
#include "gguf_blocks.h"
#include "kvs_abi.h"

namespace {

constexpr int R = 4;                           // activation rows per pass over a tile's weights

// One row's activations as int8 blocks: quants, scale, the quants' sum, and scale * sum (Q4_1's minimum term).
struct Acts {
    const int8_t* q;      // (rows, in)
    const float* dx;      // (rows, nb)
    const int32_t* sx;    // (rows, nb)
    const int32_t* sx16;  // (rows, 2 nb): each half block's sum (Q6_K's scales are per 16)
    const float* sxd;     // (rows, nb)
    int64_t in, nb;
};

// Activation rows to int8 blocks. Every operation is exactly rounded (max of magnitudes, divide, multiply,
// round half to even, integer sums), so the three paths give the same quants.
struct Quants {
    int8_t* q;
    float* dx;
    int32_t* sx;
    int32_t* sx16;
    float* sxd;
};

inline float inverse(float d) { return d != 0.f ? 1.f / d : 0.f; }

inline void block_sums(const Quants& out, int64_t b, float d, int32_t lo, int32_t hi) {
    out.dx[b] = d;
    out.sx16[2 * b] = lo;
    out.sx16[2 * b + 1] = hi;
    out.sx[b] = lo + hi;
    out.sxd[b] = d * static_cast<float>(lo + hi);
}

void quantize_plain(const float* x, int64_t in, const Quants& out) {
    for (int64_t b = 0; b < in / QK; ++b) {
        const float* xb = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f, id = inverse(d);
        int32_t sum[2] = {0, 0};
        for (int i = 0; i < QK; ++i) {
            const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * id));
            out.q[b * QK + i] = static_cast<int8_t>(v);
            sum[i / 16] += v;
        }
        block_sums(out, b, d, sum[0], sum[1]);
    }
}

#ifdef __AVX512BW__
void quantize_avx512(const float* x, int64_t in, const Quants& out) {
    for (int64_t b = 0; b < in / QK; ++b) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.f;
        const __m512 id = _mm512_set1_ps(inverse(d));
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + b * QK), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + b * QK + 16), _mm512_cvtepi32_epi8(i1));
        block_sums(out, b, d, _mm512_reduce_add_epi32(i0), _mm512_reduce_add_epi32(i1));
    }
}

#endif

#ifdef __AVX2__
int32_t sum8(__m256i v) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}

void quantize_avx2(const float* x, int64_t in, const Quants& out) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < in / QK; ++b) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(x + b * QK + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float d = _mm_cvtss_f32(h) / 127.f;
        const __m256 id = _mm256_set1_ps(inverse(d));
        __m256i i[4];
        for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
        // packs work within 128-bit lanes: the permute puts the four 4-byte groups of each lane in order
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q + b * QK),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        block_sums(out, b, d, sum8(_mm256_add_epi32(i[0], i[1])), sum8(_mm256_add_epi32(i[2], i[3])));
    }
}

#endif

void quantize_row(const float* x, int64_t in, const Quants& out) {
#if defined(__AVX512BW__)
    quantize_avx512(x, in, out);
#elif defined(__AVX2__)
    quantize_avx2(x, in, out);
#else
    quantize_plain(x, in, out);
#endif
}

// Row l's scale (or minimum) of a block's 16 starting at p: float16, or float32 for the K-quants.
template <int KIND>
inline float scale_at(const uint8_t* p, int64_t l) {
    if (!wide_scales(KIND)) return half_to_float(p + 2 * l);
    float v;
    std::memcpy(&v, p + 4 * l, 4);
    return v;
}

// The plain path: what the vector paths compute, one lane at a time.
template <int KIND>
void tile_plain(const uint8_t* tile, const Acts& a, int64_t r0, int nr, float (*acc)[TILE]) {
    for (int r = 0; r < nr; ++r)
        for (int64_t l = 0; l < TILE; ++l) acc[r][l] = 0.f;
    for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* blk = tile + b * block_stride(KIND);
        for (int64_t l = 0; l < TILE; ++l) {
            int32_t u[QK];
            for (int i = 0; i < QK; ++i) {
                if (byte_quants(KIND)) {
                    u[i] = blk[(i / 4) * 64 + l * 4 + i % 4];
                } else {
                    const uint8_t byte = blk[((i % 16) / 4) * 64 + l * 4 + i % 4];
                    u[i] = i < 16 ? byte & 0x0F : byte >> 4;
                }
            }
            const float d = scale_at<KIND>(blk + d_at(KIND), l);
            for (int r = 0; r < nr; ++r) {
                const int64_t row = r0 + r;
                const int8_t* xq = a.q + row * a.in + b * QK;
                if (KIND == Q6_K) {
                    for (int h = 0; h < 2; ++h) {
                        int32_t s = 0;
                        for (int i = 16 * h; i < 16 * h + 16; ++i) s += u[i] * xq[i];
                        s -= offset_of(KIND) * a.sx16[row * 2 * a.nb + 2 * b + h];
                        const float scale = static_cast<float>(static_cast<int8_t>(blk[m_at(KIND) + 16 * h + l])) * d;
                        acc[r][l] = std::fma(scale, static_cast<float>(s) * a.dx[row * a.nb + b], acc[r][l]);
                    }
                    continue;
                }
                int32_t s = 0;
                for (int i = 0; i < QK; ++i) s += u[i] * xq[i];
                s -= offset_of(KIND) * a.sx[row * a.nb + b];
                const float p = static_cast<float>(s) * a.dx[row * a.nb + b];
                acc[r][l] = std::fma(d, p, acc[r][l]);
                if (has_min(KIND))
                    acc[r][l] = std::fma(scale_at<KIND>(blk + m_at(KIND), l), a.sxd[(r0 + r) * a.nb + b], acc[r][l]);
            }
        }
    }
}

inline int32_t four_bytes(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// One block's float steps for one row, written once for both vector widths (V: V512 or V256 below): each half
// block's integer sum less its offset, scaled and summed into acc (Q6_K), or the block's whole (then Q4_1's
// minimum term). `offset` is what the path's quants carry (Q8_0's +128 on the VNNI path, none on AVX2's).
template <int KIND, typename V>
inline typename V::F block_into(typename V::F acc, const typename V::I* sums, typename V::F d, const typename V::F* scale,
                                typename V::F m, int32_t offset, const Acts& a, int64_t row, int64_t b) {
    const typename V::F dx = V::splat(a.dx[row * a.nb + b]);
    if (KIND == Q6_K) {
        for (int h = 0; h < 2; ++h)
            acc = V::fmadd(scale[h], V::mul(V::to_float(V::less(sums[h], offset * a.sx16[row * 2 * a.nb + 2 * b + h])),
                                            dx), acc);
        return acc;
    }
    acc = V::fmadd(d, V::mul(V::to_float(V::less(V::add(sums[0], sums[1]), offset * a.sx[row * a.nb + b])), dx), acc);
    return has_min(KIND) ? V::fmadd(m, V::splat(a.sxd[row * a.nb + b]), acc) : acc;
}

// The vector ops `block_into` takes, defined once for both widths (BITS 256: AVX2, 512: AVX-512).
#define KVS_VECTOR(NAME, BITS)                                                                   \
    struct NAME {                                                                                \
        using I = __m##BITS##i;                                                                  \
        using F = __m##BITS;                                                                     \
        static I add(I x, I y) { return _mm##BITS##_add_epi32(x, y); }                           \
        static I less(I x, int32_t c) { return _mm##BITS##_sub_epi32(x, _mm##BITS##_set1_epi32(c)); } \
        static F to_float(I x) { return _mm##BITS##_cvtepi32_ps(x); }                            \
        static F mul(F x, F y) { return _mm##BITS##_mul_ps(x, y); }                             \
        static F fmadd(F x, F y, F z) { return _mm##BITS##_fmadd_ps(x, y, z); }                  \
        static F splat(float x) { return _mm##BITS##_set1_ps(x); }                               \
    };

#ifdef __AVX512VNNI__
KVS_VECTOR(V512, 512)

// A block's 16 scales (or minimums) at p as float32.
template <int KIND>
inline __m512 scales16(const uint8_t* p) {
    if (wide_scales(KIND)) return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// AVX-512 VNNI: a block of 16 rows is 8 vectors of 16 rows x 4 inputs; 8 dpbusd per activation row.
template <int KIND, int NR>
void tile_vnni(const uint8_t* tile, const Acts& a, int64_t r0, float (*out)[TILE]) {
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* blk = tile + b * block_stride(KIND);
        for (int64_t line = 0; line < block_stride(KIND); line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk) + PREFETCH + line, _MM_HINT_T0);
        __m512i w[8];                                   // w[j]: 16 rows x inputs 4j .. 4j + 3 of the block
        if (byte_quants(KIND)) {
            for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(blk + 64 * j);
        } else {
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(blk + 64 * j);
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        const __m512 d = scales16<KIND>(blk + d_at(KIND));
        const __m512 m = has_min(KIND) ? scales16<KIND>(blk + m_at(KIND)) : d;
        __m512 scale[2];                                // Q6_K: d * sc of each half block, exact
        if (KIND == Q6_K)
            for (int h = 0; h < 2; ++h)
                scale[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + m_at(KIND) + 16 * h)))), d);
        for (int r = 0; r < NR; ++r) {
            const int8_t* xq = a.q + (r0 + r) * a.in + b * QK;
            __m512i half[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};   // inputs 0-15, 16-31
            for (int j = 0; j < 4; ++j)
                for (int h = 0; h < 2; ++h)
                    half[h] = _mm512_dpbusd_epi32(half[h], w[4 * h + j], _mm512_set1_epi32(four_bytes(xq + 16 * h + 4 * j)));
            acc[r] = block_into<KIND, V512>(acc[r], half, d, scale, m, offset_of(KIND), a, r0 + r, b);
        }
    }
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

#endif

#ifdef __AVX2__
KVS_VECTOR(V256, 256)

// Half `half` (8 rows) of a block's 16 scales (or minimums) at p as float32.
template <int KIND>
inline __m256 scales8(const uint8_t* p, int half) {
    if (wide_scales(KIND)) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * half);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
}

// AVX2: each half of a tile (8 rows) on its own; u8 x s8 pairs sum in int16 (maddubs), which the 4-, 5- and
// 6-bit quants (<= 63) never saturate; Q8_0 goes signed (|w| x sign(x, w)), so its pairs stay <= 2 x 128 x 127.
template <int KIND, int NR>
void tile_avx2(const uint8_t* tile, const Acts& a, int64_t r0, float (*out)[TILE]) {
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; ++half) {
        __m256 acc[NR];
        for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < a.nb; ++b) {
            const uint8_t* blk = tile + b * block_stride(KIND);
            __m256i w[8];
            for (int j = 0; j < (byte_quants(KIND) ? 8 : 4); ++j) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                if (KIND == Q8_0) {
                    w[j] = _mm256_xor_si256(v, flip);              // the signed quant
                } else if (byte_quants(KIND)) {
                    w[j] = v;
                } else {
                    w[j] = _mm256_and_si256(v, low);
                    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            }
            const __m256 d = scales8<KIND>(blk + d_at(KIND), half);
            const __m256 m = has_min(KIND) ? scales8<KIND>(blk + m_at(KIND), half) : d;
            __m256 scale[2];
            if (KIND == Q6_K)
                for (int h = 0; h < 2; ++h)
                    scale[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + m_at(KIND) + 16 * h + 8 * half)))), d);
            for (int r = 0; r < NR; ++r) {
                const int8_t* xq = a.q + (r0 + r) * a.in + b * QK;
                __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};   // inputs 0-15, 16-31
                for (int j = 0; j < 8; ++j) {
                    const __m256i x = _mm256_set1_epi32(four_bytes(xq + 4 * j));
                    const __m256i pairs = KIND == Q8_0
                        ? _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(x, w[j]))
                        : _mm256_maddubs_epi16(w[j], x);
                    sums[j / 4] = _mm256_add_epi32(sums[j / 4], _mm256_madd_epi16(pairs, ones));
                }
                // Q8_0's sums are signed already on this path: no offset
                acc[r] = block_into<KIND, V256>(acc[r], sums, d, scale, m, KIND == Q8_0 ? 0 : offset_of(KIND), a, r0 + r,
                                                b);
            }
        }
        for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
    }
}

#endif

// The path of this build's ISA level: VNNI, AVX2 (AVX-512 without VNNI too) or plain.
template <int KIND>
void tile_rows(const uint8_t* tile, const Acts& a, int64_t r0, int nr, float (*acc)[TILE]) {
#ifndef __AVX2__
    return tile_plain<KIND>(tile, a, r0, nr, acc);
#else
    auto run = [&](auto width) {
        constexpr int N = decltype(width)::value;
#ifdef __AVX512VNNI__
        tile_vnni<KIND, N>(tile, a, r0, acc);
#else
        tile_avx2<KIND, N>(tile, a, r0, acc);
#endif
    };
    switch (nr) {
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
    }
#endif
}

}  // namespace

// Bytes of the packed layout of an (out, in) matrix of `kind` (KVS_GGUF_TYPES).
int64_t kvs_gguf_packed_bytes(int64_t kind, int64_t out, int64_t in) {
    if (kind == BF16) return bf16k::packed_bytes(out, in);
    return (out + TILE - 1) / TILE * (in / QK) * block_stride(kind);
}

// The file's raw rows (out, in / source_weights blocks in ggml's layout of `kind`) -> the packed layout
// (gguf_blocks.h). Rows past `out` in the last tile are zero (scale 0).
void kvs_gguf_pack(int64_t kind, const uint8_t* raw, int64_t out, int64_t in, uint8_t* packed) {
    if (kind == BF16)
        return bf16k::pack(reinterpret_cast<const uint16_t*>(raw), out, in, reinterpret_cast<uint16_t*>(packed));
    const int64_t nb = in / QK, stride = block_stride(kind), tiles = (out + TILE - 1) / TILE;
    const int64_t sources = in / source_weights(kind), blocks_per_source = source_weights(kind) / QK;
    std::memset(packed, 0, static_cast<size_t>(tiles * nb * stride));
    for (int64_t o = 0; o < out; ++o) {
        const int64_t t = o / TILE, l = o % TILE;
        for (int64_t sb = 0; sb < sources; ++sb) {
            const uint8_t* src = raw + (o * sources + sb) * source_bytes(kind);
            uint8_t* blks[8];
            for (int64_t bb = 0; bb < blocks_per_source; ++bb)
                blks[bb] = packed + (t * nb + sb * blocks_per_source + bb) * stride;
            if (kind == Q6_K)
                pack_q6_k(src, l, blks);
            else
                pack_source_block(static_cast<int>(kind), src, l, blks);
        }
    }
}

// y (rows, out) = x (rows, in) times the packed (out, in) matrix transposed. x and y float32 (is_bf16 0) or
// bfloat16 (1), with row strides x_stride and y_stride; in % 32 == 0. Every ISA level's build gives the same bits.
void kvs_gguf_matmul(int64_t kind, const uint8_t* packed, int64_t out, int64_t in, const void* x,
                     int64_t x_stride, void* y, int64_t y_stride, int64_t rows, int64_t is_bf16) {
    if (kind == BF16)
        return bf16k::matmul(reinterpret_cast<const uint16_t*>(packed), out, in, x, x_stride, y, y_stride,
                             rows, is_bf16);
    const int64_t nb = in / QK, tiles = (out + TILE - 1) / TILE, stride = block_stride(kind);
    std::vector<int8_t> q(static_cast<size_t>(rows * in));
    std::vector<float> dx(static_cast<size_t>(rows * nb)), sxd(dx.size());
    std::vector<int32_t> sx(dx.size()), sx16(2 * dx.size());
    const bool parallel = rows * in * out >= PARALLEL_MACS;
#pragma omp parallel if (parallel)
    {
        std::vector<float> wide(static_cast<size_t>(in));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = static_cast<const float*>(x) + r * x_stride;
            if (is_bf16) {
                const uint16_t* xb = static_cast<const uint16_t*>(x) + r * x_stride;
                for (int64_t i = 0; i < in; ++i) {
                    const uint32_t u = static_cast<uint32_t>(xb[i]) << 16;
                    std::memcpy(&wide[i], &u, 4);
                }
                xr = wide.data();
            }
            quantize_row(xr, in, Quants{q.data() + r * in, dx.data() + r * nb, sx.data() + r * nb,
                                               sx16.data() + 2 * r * nb, sxd.data() + r * nb});
        }
    }
    const Acts acts{q.data(), dx.data(), sx.data(), sx16.data(), sxd.data(), in, nb};
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* tile = packed + t * nb * stride;
        const int64_t lanes = std::min<int64_t>(TILE, out - t * TILE);
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
            const int nr = static_cast<int>(std::min<int64_t>(R, rows - r0));
            float acc[R][TILE];
            switch (kind) {
                case Q4_0: tile_rows<Q4_0>(tile, acts, r0, nr, acc); break;
                case Q4_1: tile_rows<Q4_1>(tile, acts, r0, nr, acc); break;
                case Q5_0: tile_rows<Q5_0>(tile, acts, r0, nr, acc); break;
                case Q5_1: tile_rows<Q5_1>(tile, acts, r0, nr, acc); break;
                case Q4_K: tile_rows<Q4_K>(tile, acts, r0, nr, acc); break;
                case Q5_K: tile_rows<Q5_K>(tile, acts, r0, nr, acc); break;
                case Q6_K: tile_rows<Q6_K>(tile, acts, r0, nr, acc); break;
                default: tile_rows<Q8_0>(tile, acts, r0, nr, acc); break;
            }
            for (int r = 0; r < nr; ++r) store_row(acc[r], lanes, y, (r0 + r) * y_stride + t * TILE, is_bf16);
        }
    }
}
