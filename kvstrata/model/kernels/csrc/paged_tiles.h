// The tile math of the paged-attention kernel (paged_attention.cpp): a tile of 16 keys against a few query rows,
// read in place (decodes, `rows`) or transposed once for many rows (prefill chunks, `rows_transposed`); both sum in
// the same order, so a row gets the same bits from either path.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec16.h"

namespace {

constexpr int W = 16;            // lanes, and keys per tile
constexpr int MAX_G = 16;        // query rows per kv head
constexpr int MAX_D = 256;       // head dim

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

// One row's online softmax over a tile's scores s (lanes not `valid` ignored): its weights into p, its
// running max m and sum l updated. The old sums are rescaled only when the max grows, which after the
// first tiles it seldom does.
INLINE void softmax_tile(v16 s, i16v valid, float& m, float& l, float* acc, float* p, int c) {
    s = valid ? s : splat(-INFINITY);
    const float m_new = std::fmax(m, lanes_max(s));
    const v16 e = valid ? exp16(s - m_new) : splat(0.f);
    store(p, e);
    if (m_new > m) {                                     // rescale what was summed under the old max
        const float alpha = std::exp(m - m_new);         // 0 on the first tile
        l *= alpha;
        for (int x = 0; x < c; ++x) store(acc + x * W, load(acc + x * W) * alpha);
        m = m_new;
    }
    l += lanes_sum(e);
}

// acc (R rows of d) += p (R rows of W weights) times the tile's V rows [lo, hi): each element's sum runs
// over the keys in order; X vectors of each row at once, so R * X chains of sums are in flight, not R.
template <int R, int X, typename T>
INLINE void add_pv_part(float* acc, const float (*p)[W], const T* vf, int lo, int hi, int x0, int d) {
    v16 a[R][X];
    for (int r = 0; r < R; ++r)
        for (int x = 0; x < X; ++x) a[r][x] = load(acc + r * d + (x0 + x) * W);
    for (int j = lo; j < hi; ++j)
        for (int x = 0; x < X; ++x) {
            const v16 v = load(vf + j * d + (x0 + x) * W);
            for (int r = 0; r < R; ++r) a[r][x] += p[r][j] * v;
        }
    for (int r = 0; r < R; ++r)
        for (int x = 0; x < X; ++x) store(acc + r * d + (x0 + x) * W, a[r][x]);
}

template <int R, typename T>
INLINE void add_pv(float* acc, const float (*p)[W], const T* vf, int lo, int hi, int c, int d) {
    int x0 = 0;
    for (; x0 + 4 <= c; x0 += 4) add_pv_part<R, 4>(acc, p, vf, lo, hi, x0, d);
    for (; x0 < c; ++x0) add_pv_part<R, 1>(acc, p, vf, lo, hi, x0, d);
}

// One tile of W keys (K rows kf, V rows vf, d values each; keys [lo, hi) valid) for R query rows
// (q, acc: R rows of d floats; their running max m and sum l).
template <int R, typename T>
INLINE void rows(const float* q, float* acc, float* m, float* l, const T* kf, const T* vf,
                 i16v valid, int lo, int hi, int c, int d) {
    alignas(64) v16 dots[R][W];
    for (int j = 0; j < W; ++j) {
        const T* kj = kf + j * d;
        v16 s[R];
        for (int r = 0; r < R; ++r) s[r] = load(q + r * d) * load(kj);
        for (int x = 1; x < c; ++x) {
            const v16 k = load(kj + x * W);
            for (int r = 0; r < R; ++r) s[r] += load(q + r * d + x * W) * k;
        }
        for (int r = 0; r < R; ++r) dots[r][j] = s[r];
    }
    alignas(64) float p[R][W];
    for (int r = 0; r < R; ++r) softmax_tile(transpose_sum(dots[r]), valid, m[r], l[r], acc + r * d, p[r], c);
    add_pv<R>(acc, p, vf, lo, hi, c, d);
}

// Where tile `tile`'s K and V rows (keys [tile, tile + W) of a sequence with `end` keys) are read: in place
// when the tile lies in one block, else copied row by row into kbuf / vbuf (keys past `end` zeroed).
template <typename T>
INLINE void tile_keys_of(const T* kp, const T* vp, const int64_t* table, int64_t tile, int64_t end, int bs, int d,
                         T* kbuf, T* vbuf, const T*& kf, const T*& vf) {
    if (bs % W == 0) {                                   // the tile lies in one block: rows in a run
        const int64_t row = table[tile / bs] * bs + tile % bs;
        kf = kp + row * d;
        vf = vp + row * d;
        return;
    }
    for (int j = 0; j < W; ++j) {                        // small blocks: copy the tile's keys row by row
        const int64_t key = tile + j, row = key < end ? table[key / bs] * bs + key % bs : -1;
        if (row < 0) {
            std::memset(kbuf + j * d, 0, d * sizeof(T));
            std::memset(vbuf + j * d, 0, d * sizeof(T));
        } else {
            std::memcpy(kbuf + j * d, kp + row * d, d * sizeof(T));
            std::memcpy(vbuf + j * d, vp + row * d, d * sizeof(T));
        }
    }
    kf = kbuf;
    vf = vbuf;
}

// Many query rows against one key tile: prefill chunks (a row per position and query head, each
// seeing keys [0, its position], or a sliding layer's last `window` of them). The tile's K is
// transposed into floats once (Kt: key j of element x at Kt[x * W + j]) and read by every row, so a
// row's 16 scores come out as one vector, no horizontal sums. Each score is summed in exactly the
// order of `rows` above (per lane l: the products of elements l, l + 16, ... in turn; then the lanes
// folded by `transpose_sum`'s tree, written out below as `lane_tree`), and the softmax and the P V
// sums are `rows`' own: a row gets the bits the decode path gives it, so a token's K/V do not depend
// on whether it was prefilled or decoded, or in which chunk.

// out[r] = the products of row r's elements l, l + W, l + 2W, ... with the tile's keys, summed in turn.
template <int R>
INLINE void lane_products(v16* out, const float* q, int d, const float* kt, int l, int c) {
    const v16 k0 = load(kt + l * W);
    for (int r = 0; r < R; ++r) out[r] = splat(q[r * d + l]) * k0;
    if (c == 1)     // a bare product: keep the compiler from fusing it into lane_tree's add (`rows` adds after a shuffle)
        for (int r = 0; r < R; ++r) asm("" : "+m"(out[r]));
    for (int x = 1; x < c; ++x) {
        const v16 k = load(kt + (l + x * W) * W);
        for (int r = 0; r < R; ++r) out[r] += splat(q[r * d + l + x * W]) * k;
    }
}

// Lanes l, l + STEP, l + 2 STEP, ... summed as transpose_sum sums them: (l, l + 8) first, then
// pairs of those STEP 4 apart, and so on. Depth first, so a few vectors per row stay live.
template <int R, int STEP>
INLINE void lane_tree(v16* out, const float* q, int d, const float* kt, int l, int c) {
    v16 a[R], b[R];
    if constexpr (STEP == W / 2) {
        lane_products<R>(a, q, d, kt, l, c);
        lane_products<R>(b, q, d, kt, l + STEP, c);
    } else {
        lane_tree<R, STEP * 2>(a, q, d, kt, l, c);
        lane_tree<R, STEP * 2>(b, q, d, kt, l + STEP, c);
    }
    for (int r = 0; r < R; ++r) out[r] = a[r] + b[r];
}

// One tile for R query rows that all see keys [lo, hi) of it: `rows` with the scores from Kt.
template <int R>
INLINE void rows_transposed(const float* q, float* acc, float* m, float* l, const float* kt, const float* vf,
                            int lo, int hi, int c, int d) {
    v16 s[R];
    lane_tree<R, 1>(s, q, d, kt, 0, c);
    i16v valid;
    for (int j = 0; j < W; ++j) valid[j] = j >= lo && j < hi ? -1 : 0;
    alignas(64) float p[R][W];
    for (int r = 0; r < R; ++r) softmax_tile(s[r], valid, m[r], l[r], acc + r * d, p[r], c);
    add_pv<R>(acc, p, vf, lo, hi, c, d);
}

// One tile of a (segment, kv head)'s keys made ready for many rows: K transposed into floats, V widened.
template <typename T>
INLINE void prepare_tile(float* kt, float* vt, const T* kp, const T* vp, const int64_t* table, int64_t tile,
                         int64_t end, int bs, int d) {
    const int c = d / W;
    for (int j = 0; j < W; ++j) {
        const int64_t key = tile + j;
        if (key >= end && bs % W != 0) {                 // past the table's last block: never read
            for (int x = 0; x < c; ++x) store(vt + j * d + x * W, splat(0.f));
            for (int e = 0; e < d; ++e) kt[e * W + j] = 0.f;
            continue;
        }
        const int64_t row = table[key / bs] * bs + key % bs;    // blocks of W or more: past `end`, still its block
        for (int x = 0; x < c; ++x) {
            const v16 kx = load(kp + row * d + x * W);
            for (int e = 0; e < W; ++e) kt[(x * W + e) * W + j] = kx[e];
            store(vt + j * d + x * W, load(vp + row * d + x * W));
        }
    }
}

}  // namespace
