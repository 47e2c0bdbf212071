// RMSNorm and SiLU(gate) * up over bfloat16 rows, one call each (see kvstrata/model/kernels.py): a decode
// step's norms and activations are tiny (a few rows of 576-4096 values), so in torch they cost their
// dispatches, not their arithmetic: RMSNorm in bf16 is ten ops (widen, square, sum, divide, add, rsqrt,
// scale, narrow, weight), the activation four. Here each is one call.
//
// They compute what torch computes, rounding where it rounds: RMSNorm as transformers' LlamaRMSNorm
// (float32 statistics, x * rsqrt(mean(x^2) + eps) rounded to bf16, then times the bf16 weight, rounded
// again); the activation as F.silu in float32 rounded to bf16, times up, rounded. A row's sum of squares
// is taken in one fixed order (16 lanes, then halving folds), so a row's result never depends on the
// other rows of its batch or on the thread that ran it. Bits can differ from torch's by an ulp (another
// order of the sum, another e^x).

#include <cmath>
#include <cstdint>

#include "vec16.h"

namespace {

constexpr int64_t PARALLEL_VALUES = 1 << 16;     // fewer values than this: one thread (a decode's rows)

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void rms_norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
    v16 squares = splat(0.f);
    for (int64_t i = 0; i < n; i += 16) {
        const v16 v = load(x + i);
        squares += v * v;
    }
    const float inv = 1.f / std::sqrt(lanes_sum(squares) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; i += 16) {
        uint16_t normed[16];
        store(normed, load(x + i) * inv);
        store(out + i, load(w + i) * load(normed));
    }
}

// silu(g) = g / (1 + e^-g), written with e^-|g| <= 1 so that exp16 (which takes x <= 0) serves both signs
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const v16 g = load(gate + i);
        v16 e = exp16(g < 0.f ? g : -g);
        e = g < -87.f ? splat(0.f) : e;          // e^g below exp16's range: silu(g) is -0, as torch's
        uint16_t silu[16];
        store(silu, (g < 0.f ? g * e : g) / (1.f + e));
        store(out + i, load(silu) * load(up + i));
    }
}

}  // namespace

extern "C" {

// x (rows, n) and out (rows, n) bfloat16 with row strides x_stride and n; w (n,) bfloat16; n % 16 == 0.
void kvs_rms_norm(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* out, int64_t rows,
                  int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_stride, w, out + r * n, n, eps);
}

// gate_up (rows, 2n) bfloat16, gate then up in each row; out (rows, n) bfloat16; n % 16 == 0.
void kvs_silu_mul(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
}

}  // extern "C"
