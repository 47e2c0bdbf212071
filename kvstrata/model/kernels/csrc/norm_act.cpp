// RMSNorm and SiLU(gate) * up over bfloat16 rows, and RoPE with the K/V write, one call each (see
// kvstrata/model/kernels/norm_act.py): a decode step's norms, activations and rotations are tiny (a few rows of
// 576-4096 values), so in torch they cost their dispatches, not their arithmetic: RMSNorm in bf16 is ten
// ops (widen, square, sum, divide, add, rsqrt, scale, narrow, weight), the activation four, RoPE with
// its slices, the K/V write and the attention kernel's float32 queries about twenty. Here each is one call.
//
// They compute what torch computes, rounding where it rounds: RMSNorm as transformers' LlamaRMSNorm
// (float32 statistics, x * rsqrt(mean(x^2) + eps) rounded to bf16, then times the bf16 weight, rounded
// again); the activation as F.silu in float32 rounded to bf16, times up, rounded. A row's sum of squares
// is taken in one fixed order (16 lanes, then halving folds), so a row's result never depends on the
// other rows of its batch or on the thread that ran it. Bits can differ from torch's by an ulp (another
// order of the sum, another e^x). RoPE gives torch's bits exactly (`apply_rotary`: x * cos rounded to
// the model dtype, then one fused multiply-add in float32, as torch's addcmul, rounded again).

#include <cmath>
#include <cstdint>

#include "kvs_abi.h"
#include "vec16.h"

namespace {

constexpr int64_t PARALLEL_VALUES = 1 << 16;     // fewer values than this: one thread (a decode's rows)
constexpr int64_t MAX_HEAD_DIM = 512;

// 1 / sqrt(mean(x^2) + eps) of a row, its sum of squares in one fixed order
INLINE float inverse_rms(const uint16_t* x, int64_t n, float eps) {
    v16 squares = splat(0.f);
    for (int64_t i = 0; i < n; i += 16) {
        const v16 v = load(x + i);
        squares += v * v;
    }
    return 1.f / std::sqrt(lanes_sum(squares) / static_cast<float>(n) + eps);
}

void rms_norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
    const float inv = inverse_rms(x, n, eps);
    for (int64_t i = 0; i < n; i += 16) {
        uint16_t normed[16];
        store(normed, load(x + i) * inv);
        store(out + i, load(w + i) * load(normed));
    }
}

// The same statistics with a float32 weight (Gemma's 1 + w, kvstrata.model.builder): x * rsqrt(...) stays float32
// and is scaled in float32, rounded to bf16 once, as the torch path does for such a weight.
void rms_norm_row_wide(const uint16_t* x, const float* w, uint16_t* out, int64_t n, float eps) {
    const float inv = inverse_rms(x, n, eps);
    for (int64_t i = 0; i < n; i += 16) store(out + i, load(x + i) * inv * load(w + i));
}

// silu(g) = g / (1 + e^-g), written with e^-|g| <= 1 so that exp16 (which takes x <= 0) serves both signs
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

INLINE float round_bf16(float x) {            // to the nearest bfloat16, ties to even, as torch rounds
    uint32_t u; std::memcpy(&u, &x, sizeof u);
    u = x != x ? 0x7FC00000u : ((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16) << 16;
    float r; std::memcpy(&r, &u, sizeof r); return r;
}

INLINE float widen(float x) { return x; }
INLINE float widen(uint16_t x) { const uint32_t u = uint32_t{x} << 16; float f; std::memcpy(&f, &u, sizeof f); return f; }
INLINE float narrowed(float x, float) { return x; }                 // x already rounded to the model dtype
INLINE uint16_t narrowed(float x, uint16_t) { uint32_t u; std::memcpy(&u, &x, sizeof u); return static_cast<uint16_t>(u >> 16); }

// One head's values [from, to) rotated: x * cos + partner * sin_signed, where partner is x one half away,
// rounded as T rounds (a bf16 product is exact in float32: only the float32 model has a fused multiply-add
// to match, and torch's addcmul fuses it)
template <typename T>
INLINE void rotate(const T* x, const T* partner, const T* cos, const T* sin, int64_t from, int64_t to, float* out) {
    for (int64_t i = from; i < to; ++i) {
        float t = widen(x[i]) * widen(cos[i]);
        if (sizeof(T) == 2) t = round_bf16(t);
        const float r = __builtin_fmaf(widen(partner[i]), widen(sin[i]), t);
        out[i] = sizeof(T) == 2 ? round_bf16(r) : r;
    }
}

template <typename T>
INLINE void rotate_head(const T* x, const T* cos, const T* sin, int64_t d, float* out) {
    rotate(x, x + d / 2, cos, sin, 0, d / 2, out);
    rotate(x, x - d / 2, cos, sin, d / 2, d, out);
}

template <typename T>
void rope_store(const T* qkv, int64_t qkv_stride, const T* cos, const T* sin, const int64_t* slots, int64_t rows,
                int64_t heads, int64_t kv_heads, int64_t d, T* kv, int64_t plane_slots, float* q) {
#pragma omp parallel for schedule(static) if (rows * (heads + kv_heads) * d >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; ++r) {
        const T* x = qkv + r * qkv_stride;
        const T* c = cos + r * d;
        const T* s = sin + r * d;
        for (int64_t h = 0; h < heads; ++h) rotate_head(x + h * d, c, s, d, q + (r * heads + h) * d);
        float rotated[MAX_HEAD_DIM];
        for (int64_t h = 0; h < kv_heads; ++h) {
            T* k = kv + (h * plane_slots + slots[r]) * d;
            T* v = kv + ((kv_heads + h) * plane_slots + slots[r]) * d;
            const T* xv = x + (heads + kv_heads + h) * d;
            rotate_head(x + (heads + h) * d, c, s, d, rotated);
            for (int64_t i = 0; i < d; ++i) {
                k[i] = narrowed(rotated[i], T{});
                v[i] = xv[i];
            }
        }
    }
}

}  // namespace

int64_t kvs_rope_max_head_dim() { return MAX_HEAD_DIM; }

// x (rows, n) and out (rows, n) bfloat16 with row strides x_stride and n; w (n,) bfloat16; n % 16 == 0.
void kvs_rms_norm(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* out, int64_t rows,
                  int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_stride, w, out + r * n, n, eps);
}

// kvs_rms_norm with a float32 weight w (n,): Gemma's norms, whose weight is 1 + w.
void kvs_rms_norm_wide(const uint16_t* x, int64_t x_stride, const float* w, uint16_t* out, int64_t rows,
                       int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row_wide(x + r * x_stride, w, out + r * n, n, eps);
}

// gate_up (rows, 2n) bfloat16, gate then up in each row; out (rows, n) bfloat16; n % 16 == 0.
void kvs_silu_mul(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
}

// The attention inputs of a layer from its fused projection: qkv (rows, (heads + 2 kv_heads) d) with row stride
// qkv_stride, float32 (bf16 = 0) or bfloat16; cos and sin (rows, d) each row's RoPE tables (sin with its first half
// negated). Rotated queries into q (rows, heads, d) float32 (rounded to the model dtype first, as the attention
// kernel's queries are); rotated keys and the values into kv (2, kv_heads, plane_slots, d) at flat slots[r].
// d <= MAX_HEAD_DIM (kvs_rope_max_head_dim()), even.
void kvs_rope_store(const void* qkv, int64_t qkv_stride, int64_t bf16, const void* cos, const void* sin,
                    const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, void* kv,
                    int64_t plane_slots, float* q) {
    if (bf16)
        rope_store(static_cast<const uint16_t*>(qkv), qkv_stride, static_cast<const uint16_t*>(cos),
                   static_cast<const uint16_t*>(sin), slots, rows, heads, kv_heads, d, static_cast<uint16_t*>(kv),
                   plane_slots, q);
    else
        rope_store(static_cast<const float*>(qkv), qkv_stride, static_cast<const float*>(cos),
                   static_cast<const float*>(sin), slots, rows, heads, kv_heads, d, static_cast<float*>(kv),
                   plane_slots, q);
}
