// 16-float vectors in GCC's vector extensions, shared by our kernels (kvstrata/model/kernels.py):
// loads and stores of float32 and bfloat16 rows, fixed-order lane reductions, e^x. Every function is
// inlined into its caller, so a `target_clones` caller gets it compiled for each of its targets.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

#define INLINE inline __attribute__((always_inline))

INLINE v16 splat(float x) {         // a broadcast (v16{} + x would add 0 too: -0 is not +0)
    const v16 v{x};
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

INLINE v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }

INLINE v16 load(const uint16_t* p) {     // bfloat16 -> float32: the bf16 bits are the float's high half
    h16v h; std::memcpy(&h, p, sizeof h);
    u16v u = __builtin_convertvector(h, u16v) << 16;
    v16 v; std::memcpy(&v, &u, sizeof v); return v;
}

INLINE void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// float32 -> bfloat16, rounded to nearest even as torch rounds (a NaN becomes the quiet NaN 0x7FC0)
INLINE void store(uint16_t* p, v16 v) {
    u16v u; std::memcpy(&u, &v, sizeof u);
    u16v r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    const u16v quiet = u16v{} + 0x7FC0u;
    r = v != v ? quiet : r;
    const h16v h = __builtin_convertvector(r, h16v);
    std::memcpy(p, &h, sizeof h);
}

INLINE v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
// Lane folds (halves, quarters, ...): a fixed order of sums, whatever the target.
INLINE float lanes_max(v16 v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}
INLINE float lanes_sum(v16 v) {
    v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

// e^x for x <= 0 (scores minus their running max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2.
INLINE v16 exp16(v16 x) {
    x = x < -87.f ? splat(-87.f) : x;
    v16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;   // round to nearest
    v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
    v16 scale; std::memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

}  // namespace
