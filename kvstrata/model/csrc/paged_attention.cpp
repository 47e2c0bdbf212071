// Paged decode attention that reads K/V where they lie in the cache (see kvstrata/model/kernels.py).
//
// One work item is one sequence and one kv head: its G query rows walk the sequence's blocks from
// key `first` to key `len - 1` with an online softmax, 16 keys at a time. The order of every sum
// depends only on the item (its keys and the block size), never on the batch or the thread that
// runs it, so a row's result is the same whatever else is in the step.
//
// Written with GCC vector extensions (16 floats), not intrinsics: `target_clones` compiles the
// per-item function for AVX-512, AVX2 + FMA and baseline x86-64 and picks one at load time, so the
// library is correct on any x86-64 and fast where the wide units exist. No -ffast-math: exp16's
// rounding trick relies on IEEE order.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

constexpr int W = 16;            // lanes, and keys per tile
constexpr int MAX_G = 16;        // query rows per kv head
constexpr int MAX_D = 256;       // head dim

#define INLINE inline __attribute__((always_inline))

INLINE v16 splat(float x) { return v16{} + x; }

INLINE v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }

INLINE v16 load(const uint16_t* p) {     // bfloat16 -> float32: the bf16 bits are the float's high half
    h16v h; std::memcpy(&h, p, sizeof h);
    u16v u = __builtin_convertvector(h, u16v) << 16;
    v16 v; std::memcpy(&v, &u, sizeof v); return v;
}

INLINE void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// Lane i of the result: the sum of the lanes of a[i] (sixteen horizontal sums by halving folds).
INLINE v16 fold(v16 a, v16 b, int half) {
    // lanes [0, half) of each 2*half run come from a, [half, 2*half) from b; the two halves of each
    // run are summed
    v16 lo, hi;
    if (half == 8) {
        lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        hi = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if (half == 4) {
        lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    } else if (half == 2) {
        lo = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        hi = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    } else {
        lo = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        hi = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
    return lo + hi;
}

INLINE v16 transpose_sum(v16* a) {      // a[16] -> r with r[i] = sum of a[i]'s lanes; clobbers a
    for (int half = 8, n = W; half >= 1; half /= 2, n /= 2)
        for (int i = 0; i < n / 2; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], half);
    // after the folds, lane i holds key (bit-reversed i)'s sum; put them back in key order
    return __builtin_shufflevector(a[0], a[0], 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

INLINE float lanes_max(v16 v) { float m = v[0]; for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m; return m; }
INLINE float lanes_sum(v16 v) { float s = 0.f; for (int i = 0; i < W; ++i) s += v[i]; return s; }

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

struct Item {
    const float* q;          // (G, D), unscaled
    const void* k;           // this kv head's K plane: (num_blocks, bs, D)
    const void* v;           // its V plane
    const int64_t* table;    // block ids of the sequence
    int64_t first, len;      // keys [first, len) are attended
    float* out;              // (G, D)
    float* lse;              // (G,)
};

template <typename T>
INLINE void attend_item(const Item& it, int g, int d, int bs, float scale) {
    const int c = d / W;                                  // vectors per row
    alignas(64) float q[MAX_G * MAX_D], acc[MAX_G * MAX_D];
    alignas(64) float kbuf[W * MAX_D], vbuf[W * MAX_D];
    float m[MAX_G], l[MAX_G];
    for (int i = 0; i < g * d; ++i) { q[i] = it.q[i] * scale; acc[i] = 0.f; }
    for (int i = 0; i < g; ++i) { m[i] = -INFINITY; l[i] = 0.f; }
    const T* kp = static_cast<const T*>(it.k);
    const T* vp = static_cast<const T*>(it.v);
    for (int64_t tile = it.first / W * W; tile < it.len; tile += W) {
        const int lo = static_cast<int>(tile < it.first ? it.first - tile : 0);
        const int hi = static_cast<int>(it.len - tile < W ? it.len - tile : W);
        const float* kf = kbuf;
        const float* vf = vbuf;
        if (bs % W == 0 && tile + W < it.len) {          // the next tile's block: from memory, not cache
            const int64_t next = it.table[(tile + W) / bs] * bs + (tile + W) % bs;
            for (int b = 0; b < W * d * static_cast<int>(sizeof(T)); b += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(kp + next * d) + b);
                __builtin_prefetch(reinterpret_cast<const char*>(vp + next * d) + b);
            }
        }
        if (bs % W == 0) {                               // the tile lies in one block: rows in a run
            const int64_t row = it.table[tile / bs] * bs + tile % bs;
            const T* ks = kp + row * d;
            const T* vs = vp + row * d;
            if constexpr (sizeof(T) == sizeof(float)) {
                kf = reinterpret_cast<const float*>(ks);
                vf = reinterpret_cast<const float*>(vs);
            } else {
                for (int j = 0; j < W * d; j += W) { store(kbuf + j, load(ks + j)); store(vbuf + j, load(vs + j)); }
            }
        } else {                                         // small blocks: copy the tile's keys row by row
            for (int j = 0; j < W; ++j) {
                const int64_t key = tile + j, row = key < it.len ? it.table[key / bs] * bs + key % bs : -1;
                for (int x = 0; x < d; x += W) {
                    store(kbuf + j * d + x, row < 0 ? splat(0.f) : load(kp + row * d + x));
                    store(vbuf + j * d + x, row < 0 ? splat(0.f) : load(vp + row * d + x));
                }
            }
        }
        i16v valid;
        for (int j = 0; j < W; ++j) valid[j] = j >= lo && j < hi ? -1 : 0;
        for (int gi = 0; gi < g; ++gi) {
            const float* qg = q + gi * d;
            v16 dots[W];
            for (int j = 0; j < W; ++j) {
                v16 s = load(qg) * load(kf + j * d);
                for (int x = 1; x < c; ++x) s += load(qg + x * W) * load(kf + j * d + x * W);
                dots[j] = s;
            }
            v16 s = transpose_sum(dots);
            s = valid ? s : splat(-INFINITY);
            const float m_new = std::fmax(m[gi], lanes_max(s));
            const float alpha = std::exp(m[gi] - m_new);     // 0 on the first tile
            const v16 p = valid ? exp16(s - m_new) : splat(0.f);
            l[gi] = l[gi] * alpha + lanes_sum(p);
            m[gi] = m_new;
            float* ag = acc + gi * d;
            for (int x = 0; x < c; ++x) {
                v16 a = load(ag + x * W) * alpha;
                for (int j = lo; j < hi; ++j) a += p[j] * load(vf + j * d + x * W);
                store(ag + x * W, a);
            }
        }
    }
    for (int gi = 0; gi < g; ++gi) {
        const float inv = 1.f / l[gi];
        for (int i = 0; i < d; ++i) it.out[gi * d + i] = acc[gi * d + i] * inv;
        it.lse[gi] = m[gi] + std::log(l[gi]);
    }
}

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_item_f32(const Item& it, int g, int d, int bs, float scale) { attend_item<float>(it, g, d, bs, scale); }

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_item_bf16(const Item& it, int g, int d, int bs, float scale) { attend_item<uint16_t>(it, g, d, bs, scale); }

}  // namespace

extern "C" {

// Limits the caller checks before calling (kernels.py reads them once).
int kvs_max_group() { return MAX_G; }
int kvs_supports_head_dim(int d) { return d % W == 0 && d <= MAX_D; }
int kvs_lanes() { return W; }

// q (n, kvh, g, d) float32; kv (2, kvh, num_blocks, bs, d) float32 (bf16 = 0) or bfloat16 (bf16 = 1);
// tables (n, table_stride) int64; first, lens (n,) int64; out (n, kvh, g, d) float32; lse (n, kvh, g).
// Requires g <= MAX_G, kvs_supports_head_dim(d), bs a multiple or a divisor of W, and first < len for every
// sequence.
void kvs_paged_decode(const float* q, const void* kv, int bf16, const int64_t* tables, int64_t table_stride,
                      const int64_t* first, const int64_t* lens, int64_t n, int64_t kvh, int64_t g, int64_t d,
                      int64_t num_blocks, int64_t bs, float scale, float* out, float* lse) {
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t plane = num_blocks * bs * d * elem;    // bytes of one (K or V, head) plane
    const char* base = static_cast<const char*>(kv);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n * kvh; ++i) {
        const int64_t s = i / kvh, h = i % kvh;
        const Item it{q + i * g * d, base + h * plane, base + (kvh + h) * plane, tables + s * table_stride,
                      first[s], lens[s], out + i * g * d, lse + i * g};
        if (bf16)
            attend_item_bf16(it, static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs), scale);
        else
            attend_item_f32(it, static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs), scale);
    }
}

}  // extern "C"
