// A GGUF's BF16 matrices times activation rows (kind 4 of gguf_matmul.cpp), the weights read at their 16
// bits. A decode step reads every weight once, so at one row what counts is streaming them: oneDNN's bf16
// GEMM reached ~20 GB/s at one row on a 2-core Zen 4, llama.cpp's ~34, this loop ~40; past a few rows it
// is compute, where AVX512-BF16's dot product does twice the multiply-adds of an FMA.
//
// Layout (`bf16k::pack`): output rows in tiles of 16; a tile holds its inputs in pairs, each pair its 16
// rows' two bf16 weights as one 32-bit word: one 64-byte load is 16 rows x 2 inputs, the operand of
// VDPBF16PS (or, shifted left 16 and masked to its high half, the even and odd weights as float32). The
// same bytes as the file.
//
// Exactness: each output is acc = 0, then for each input pair in order acc = fma(w_odd, x_odd, acc),
// acc = fma(w_even, x_even, acc), with denormals flushed to zero (inputs and results), which is what
// VDPBF16PS computes (checked bit for bit against it); the other paths do those FMAs with the MXCSR's
// flush-to-zero and denormals-are-zero set, so every path gives the same bits and a row's result depends
// on that row alone (never on its batch or thread). Activations are bf16 rows (the model's) or float32
// ones (the same order, by FMA on every path: VDPBF16PS takes bf16 only).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t PARALLEL_MACS = 1 << 18;   // fewer multiply-adds than this: one thread (both kernels)
constexpr int PREFETCH = 2048;               // bytes ahead of a tile's loads (both kernels): both cores' streams in flight

// float32 -> bfloat16, rounded to nearest even as torch rounds (NaN -> the quiet NaN)
inline uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

// `lanes` results into y (float32, or bf16 when is_bf16) at element `at`: both kernels' last step.
inline void store_row(const float* acc, int64_t lanes, void* y, int64_t at, int is_bf16) {
    if (is_bf16) {
        uint16_t* yr = static_cast<uint16_t*>(y) + at;
        for (int64_t l = 0; l < lanes; ++l) yr[l] = to_bf16(acc[l]);
    } else {
        std::memcpy(static_cast<float*>(y) + at, acc, static_cast<size_t>(lanes) * 4);
    }
}

namespace bf16k {

constexpr int64_t TILE = 16;     // output rows per tile
constexpr int R = 8;             // activation rows per pass over a tile's weights (8 chains hide VDPBF16PS's latency)
constexpr unsigned FLUSH = 0x8040;   // MXCSR flush-to-zero and denormals-are-zero

inline int64_t tile_elems(int64_t in) { return TILE * in; }
inline int64_t packed_bytes(int64_t out, int64_t in) { return (out + TILE - 1) / TILE * tile_elems(in) * 2; }

inline float widen(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float flushed(float f) { return std::fabs(f) < 1.17549435e-38f ? std::copysign(0.f, f) : f; }

// The file's rows (out, in) bf16 -> tiles of 16 rows, inputs in pairs (see the top); rows past `out` are 0.
inline void pack(const uint16_t* raw, int64_t out, int64_t in, uint16_t* packed) {
    std::memset(packed, 0, static_cast<size_t>(packed_bytes(out, in)));
    for (int64_t o = 0; o < out; ++o) {
        uint16_t* tile = packed + (o / TILE) * tile_elems(in);
        const int64_t l = o % TILE;
        for (int64_t i = 0; i < in; ++i) tile[(i / 2) * 2 * TILE + 2 * l + i % 2] = raw[o * in + i];
    }
}

// Activation rows: x float32 (nr rows of `in` at stride `in`, flushed), and for VDPBF16PS the bf16 pairs
// as 32-bit words (xb, `in` / 2 a row; null for float32 activations).
struct Rows {
    const float* x;
    const uint32_t* xb;
    int64_t in;
};

// The plain path: the FMAs in order, flushing as the MXCSR would.
inline void tile_plain(const uint16_t* tile, const Rows& a, int nr, float (*acc)[TILE]) {
    for (int r = 0; r < nr; ++r)
        for (int64_t l = 0; l < TILE; ++l) {
            float s = 0.f;
            for (int64_t p = 0; p < a.in / 2; ++p)
                for (int k = 1; k >= 0; --k)
                    s = flushed(std::fma(flushed(widen(tile[p * 2 * TILE + 2 * l + k])), a.x[r * a.in + 2 * p + k], s));
            acc[r][l] = s;
        }
}

#ifdef __AVX512BF16__
template <int NR>
void tile_dpbf16(const uint16_t* tile, const Rows& a, float (*acc)[TILE]) {
    __m512 s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < a.in / 2; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(tile + p * 2 * TILE) + PREFETCH, _MM_HINT_T0);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(tile + p * 2 * TILE);
        for (int r = 0; r < NR; ++r)
            s[r] = _mm512_dpbf16_ps(s[r], w, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(a.xb[r * a.in / 2 + p])));
    }
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(acc[r], s[r]);
}

#endif

#ifdef __AVX512F__
template <int NR>
void tile_avx512(const uint16_t* tile, const Rows& a, float (*acc)[TILE]) {
    __m512 s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t p = 0; p < a.in / 2; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(tile + p * 2 * TILE) + PREFETCH, _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(tile + p * 2 * TILE);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        for (int r = 0; r < NR; ++r) {
            s[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(a.x[r * a.in + 2 * p + 1]), s[r]);
            s[r] = _mm512_fmadd_ps(we, _mm512_set1_ps(a.x[r * a.in + 2 * p]), s[r]);
        }
    }
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(acc[r], s[r]);
}

#endif

#ifdef __AVX2__
// AVX2: each half of a tile (8 rows) on its own, the same operations per lane.
template <int NR>
void tile_avx2(const uint16_t* tile, const Rows& a, float (*acc)[TILE]) {
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int half = 0; half < 2; ++half) {
        __m256 s[NR];
        for (int r = 0; r < NR; ++r) s[r] = _mm256_setzero_ps();
        for (int64_t p = 0; p < a.in / 2; ++p) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + p * 2 * TILE + 16 * half));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (int r = 0; r < NR; ++r) {
                s[r] = _mm256_fmadd_ps(wo, _mm256_set1_ps(a.x[r * a.in + 2 * p + 1]), s[r]);
                s[r] = _mm256_fmadd_ps(we, _mm256_set1_ps(a.x[r * a.in + 2 * p]), s[r]);
            }
        }
        for (int r = 0; r < NR; ++r) _mm256_storeu_ps(acc[r] + 8 * half, s[r]);
    }
}

#endif

// The path of this build's ISA level: VDPBF16PS (bf16 rows where the CPU has AVX512-BF16), AVX-512, AVX2, plain.
inline void tile_rows(const uint16_t* tile, const Rows& a, int nr, float (*acc)[TILE]) {
#ifndef __AVX2__
    return tile_plain(tile, a, nr, acc);
#else
    auto run = [&](auto width) {
        constexpr int N = decltype(width)::value;
#if defined(__AVX512BF16__)
        if (a.xb != nullptr) return tile_dpbf16<N>(tile, a, acc);
#endif
#if defined(__AVX512F__)
        tile_avx512<N>(tile, a, acc);
#else
        tile_avx2<N>(tile, a, acc);
#endif
    };
    switch (nr) {
        case 8: run(std::integral_constant<int, 8>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
    }
#endif
}

// y (rows, out) = x (rows, in) times the packed (out, in) matrix transposed (kvs_gguf_matmul's arguments).
inline void matmul(const uint16_t* packed, int64_t out, int64_t in, const void* x, int64_t x_stride,
                   void* y, int64_t y_stride, int64_t rows, int is_bf16) {
    const int64_t tiles = (out + TILE - 1) / TILE;
    std::vector<float> wide(static_cast<size_t>(rows * in));
    std::vector<uint32_t> pairs(is_bf16 ? static_cast<size_t>(rows * in / 2) : 0);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < in; ++i)
            wide[r * in + i] = flushed(is_bf16 ? widen(static_cast<const uint16_t*>(x)[r * x_stride + i])
                                               : static_cast<const float*>(x)[r * x_stride + i]);
        if (is_bf16) std::memcpy(pairs.data() + r * in / 2, static_cast<const uint16_t*>(x) + r * x_stride, in * 2);
    }
    const Rows a{wide.data(), is_bf16 ? pairs.data() : nullptr, in};
    const bool parallel = rows * in * out >= PARALLEL_MACS;
#pragma omp parallel if (parallel)
    {
        const unsigned csr = _mm_getcsr();        // per thread: what VDPBF16PS does, the FMA paths do flushed
        _mm_setcsr(csr | FLUSH);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t lanes = std::min<int64_t>(TILE, out - t * TILE);
            for (int64_t r0 = 0; r0 < rows; r0 += R) {
                const int nr = static_cast<int>(std::min<int64_t>(R, rows - r0));
                float acc[R][TILE];
                const Rows part{a.x + r0 * in, a.xb == nullptr ? nullptr : a.xb + r0 * in / 2, in};
                tile_rows(packed + t * tile_elems(in), part, nr, acc);
                for (int r = 0; r < nr; ++r) store_row(acc[r], lanes, y, (r0 + r) * y_stride + t * TILE, is_bf16);
            }
        }
        _mm_setcsr(csr);
    }
}

}  // namespace bf16k

}  // namespace
