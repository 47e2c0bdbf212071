// Paged attention that reads K/V where they lie in the cache (see kvstrata/model/kernels.py): decodes
// (kvs_paged_decode, below) and prefill chunks (kvs_paged_rows, further down: many rows per key tile).
//
// Decodes: one work item is one sequence and one kv head: its G query rows walk the sequence's blocks from
// key `first` to key `len - 1` with an online softmax, 16 keys at a time. The order of every sum
// depends only on the item (its keys and the block size), never on the batch or the thread that
// runs it, so a row's result is the same whatever else is in the step.
//
// Each tile's K and V rows are read once for up to four query rows (`rows`), bf16 widened in
// registers, never copied: the kernel's cost is reading the cache, so the arithmetic per byte read
// is what it saves on (1.3-1.5x faster than one row at a time through a widened copy of the tile,
// with the KV in cache; 1.1-1.2x with it in memory, as in a model step).
//
// Written with GCC vector extensions (16 floats), not intrinsics: `target_clones` compiles the
// per-item function for AVX-512, AVX2 + FMA and baseline x86-64 and picks one at load time, so the
// library is correct on any x86-64 and fast where the wide units exist. No -ffast-math: exp16's
// rounding trick relies on IEEE order.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <utility>
#include <vector>

#include <omp.h>

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
    alignas(64) T kbuf[W * MAX_D], vbuf[W * MAX_D];
    float m[MAX_G], l[MAX_G];
    for (int i = 0; i < g * d; ++i) { q[i] = it.q[i] * scale; acc[i] = 0.f; }
    for (int i = 0; i < g; ++i) { m[i] = -INFINITY; l[i] = 0.f; }
    const T* kp = static_cast<const T*>(it.k);
    const T* vp = static_cast<const T*>(it.v);
    for (int64_t tile = it.first / W * W; tile < it.len; tile += W) {
        const int lo = static_cast<int>(tile < it.first ? it.first - tile : 0);
        const int hi = static_cast<int>(it.len - tile < W ? it.len - tile : W);
        if (bs % W == 0 && tile + W < it.len) {          // the next tile's block: from memory, not cache
            const int64_t next = it.table[(tile + W) / bs] * bs + (tile + W) % bs;
            for (int b = 0; b < W * d * static_cast<int>(sizeof(T)); b += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(kp + next * d) + b);
                __builtin_prefetch(reinterpret_cast<const char*>(vp + next * d) + b);
            }
        }
        const T *kf, *vf;
        tile_keys_of(kp, vp, it.table, tile, it.len, bs, d, kbuf, vbuf, kf, vf);
        i16v valid;
        for (int j = 0; j < W; ++j) valid[j] = j >= lo && j < hi ? -1 : 0;
        for (int g0 = 0; g0 < g; g0 += 4) {
            switch (g - g0) {
                case 1: rows<1, T>(q + g0 * d, acc + g0 * d, m + g0, l + g0, kf, vf, valid, lo, hi, c, d); break;
                case 2: rows<2, T>(q + g0 * d, acc + g0 * d, m + g0, l + g0, kf, vf, valid, lo, hi, c, d); break;
                case 3: rows<3, T>(q + g0 * d, acc + g0 * d, m + g0, l + g0, kf, vf, valid, lo, hi, c, d); break;
                default: rows<4, T>(q + g0 * d, acc + g0 * d, m + g0, l + g0, kf, vf, valid, lo, hi, c, d); break;
            }
        }
    }
    for (int gi = 0; gi < g; ++gi) {
        const float inv = 1.f / l[gi];
        for (int i = 0; i < d; ++i) it.out[gi * d + i] = acc[gi * d + i] * inv;
        it.lse[gi] = m[gi] + std::log(l[gi]);
    }
}

// Many query rows against one key tile: prefill chunks (a row per position and query head, each
// seeing keys [0, its position]). The tile's K is transposed into floats once (Kt: key j of element
// x at Kt[x * W + j]) and read by every row, so a row's 16 scores come out as one vector, no
// horizontal sums. Each score is summed in exactly the order of `rows` above (per lane l: the
// products of elements l, l + 16, ... in turn; then the lanes folded by `transpose_sum`'s tree,
// written out below as `lane_tree`), and the softmax and the P V sums are `rows`' own: a row gets
// the bits the decode path gives it, so a token's K/V do not depend on whether it was prefilled or
// decoded, or in which chunk.

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

// One tile for R query rows that all see keys [0, hi) of it: `rows` with the scores from Kt.
template <int R>
INLINE void rows_transposed(const float* q, float* acc, float* m, float* l, const float* kt, const float* vf,
                            int hi, int c, int d) {
    v16 s[R];
    lane_tree<R, 1>(s, q, d, kt, 0, c);
    i16v valid;
    for (int j = 0; j < W; ++j) valid[j] = j < hi ? -1 : 0;
    alignas(64) float p[R][W];
    for (int r = 0; r < R; ++r) softmax_tile(s[r], valid, m[r], l[r], acc + r * d, p[r], c);
    add_pv<R>(acc, p, vf, 0, hi, c, d);
}

constexpr int MAX_ROWS = 48;     // query rows of one item: positions x G
#ifndef IN_PLACE_POSITIONS
#define IN_PLACE_POSITIONS 16     // segments of at most this many positions are read in place
#endif

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

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void prepare_tile_f32(float* kt, float* vt, const float* kp, const float* vp, const int64_t* table, int64_t tile,
                      int64_t end, int bs, int d) { prepare_tile(kt, vt, kp, vp, table, tile, end, bs, d); }

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void prepare_tile_bf16(float* kt, float* vt, const uint16_t* kp, const uint16_t* vp, const int64_t* table,
                       int64_t tile, int64_t end, int bs, int d) {
    prepare_tile(kt, vt, kp, vp, table, tile, end, bs, d);
}

struct RowItem {
    const float* q;          // its first position's rows: (G, D) per position, `stride` floats apart
    const float* tiles;      // its (segment, kv head)'s prepared tiles: Kt (D x W) then V (W x D), each
    int64_t len0;            // position i of the item sees keys [0, len0 + i)
    int positions;
    int64_t stride;          // floats from one position's rows to the next (in q, out; lse: / D)
    float* out;              // like q
    float* lse;              // (G,) per position, stride / D apart
};

// An item's rows scaled into q, their sums and maxima zeroed, and the keys each sees (position i: len0 + i).
INLINE void start_rows(const RowItem& it, int g, int d, float scale, float* q, float* acc, float* m, float* l,
                       int64_t* len) {
    for (int p = 0; p < it.positions; ++p)
        for (int i = 0; i < g * d; ++i) {
            q[p * g * d + i] = it.q[p * it.stride + i] * scale;
            acc[p * g * d + i] = 0.f;
        }
    for (int r = 0; r < it.positions * g; ++r) { m[r] = -INFINITY; l[r] = 0.f; len[r] = it.len0 + r / g; }
}

// The rows' outputs (sums over their softmax totals) and log-sum-exps, where the item's caller reads them.
INLINE void finish_rows(const RowItem& it, int g, int d, const float* acc, const float* m, const float* l) {
    for (int r = 0; r < it.positions * g; ++r) {
        const int p = r / g, gi = r % g;
        const float inv = 1.f / l[r];
        for (int i = 0; i < d; ++i) it.out[p * it.stride + gi * d + i] = acc[r * d + i] * inv;
        it.lse[p * it.stride / d + gi] = m[r] + std::log(l[r]);
    }
}

INLINE int tile_keys(int64_t len, int64_t tile) { return static_cast<int>(len - tile < W ? len - tile : W); }

INLINE void attend_rows(const RowItem& it, int g, int d, float scale) {
    const int c = d / W, n = it.positions * g;
    alignas(64) float q[MAX_ROWS * MAX_D], acc[MAX_ROWS * MAX_D];
    float m[MAX_ROWS], l[MAX_ROWS];
    int64_t len[MAX_ROWS];
    start_rows(it, g, d, scale, q, acc, m, l, len);
    const int64_t end = it.len0 + it.positions - 1;       // the last row's keys
    int first_row = 0;                                   // rows before it see no key of this tile
    for (int64_t tile = 0; tile < end; tile += W) {
        while (len[first_row] <= tile) first_row += g;
        const float* kt = it.tiles + tile / W * 2 * W * d;
        const float* vt = kt + W * d;
        for (int r = first_row; r < n;) {                 // runs of up to 4 rows that see the same keys
            const int hi = tile_keys(len[r], tile);
            int run = 1;
            while (run < 4 && r + run < n && tile_keys(len[r + run], tile) == hi) ++run;
            float *qr = q + r * d, *ar = acc + r * d;
            switch (run) {
                case 1: rows_transposed<1>(qr, ar, m + r, l + r, kt, vt, hi, c, d); break;
                case 2: rows_transposed<2>(qr, ar, m + r, l + r, kt, vt, hi, c, d); break;
                case 3: rows_transposed<3>(qr, ar, m + r, l + r, kt, vt, hi, c, d); break;
                default: rows_transposed<4>(qr, ar, m + r, l + r, kt, vt, hi, c, d); break;
            }
            r += run;
        }
    }
    finish_rows(it, g, d, acc, m, l);
}

// A few positions of one segment (speculative verification: K + 1 rows per sequence) for one kv head,
// read in place as decodes read them: `rows` per tile for runs of up to four rows that see the same
// keys. Preparing transposed tiles (written out, then read back) costs about what a dozen rows' scores
// cost per tile, so for a few positions it is most of the call: bf16, 3 kv heads of 3 rows, 2 threads,
// Zen 5: 32 sequences x 5 positions over 900 keys 7.6 -> 3.9 ms, one sequence's 9 over 900 keys
// 182 -> 175 us; from 17 positions on, one sequence's rows are faster prepared.
template <typename T>
INLINE void attend_in_place(const RowItem& it, const T* kp, const T* vp, const int64_t* table, int g, int d,
                            int bs, float scale) {
    const int c = d / W, n = it.positions * g;
    alignas(64) float q[MAX_ROWS * MAX_D], acc[MAX_ROWS * MAX_D];
    alignas(64) T kbuf[W * MAX_D], vbuf[W * MAX_D];
    float m[MAX_ROWS], l[MAX_ROWS];
    int64_t len[MAX_ROWS];
    start_rows(it, g, d, scale, q, acc, m, l, len);
    const int64_t end = it.len0 + it.positions - 1;       // the last row's keys
    int first_row = 0;
    for (int64_t tile = 0; tile < end; tile += W) {
        while (len[first_row] <= tile) first_row += g;
        const T *kf, *vf;
        tile_keys_of(kp, vp, table, tile, end, bs, d, kbuf, vbuf, kf, vf);
        for (int r = first_row; r < n;) {
            const int hi = tile_keys(len[r], tile);
            int run = 1;
            while (run < 4 && r + run < n && tile_keys(len[r + run], tile) == hi) ++run;
            i16v valid;
            for (int j = 0; j < W; ++j) valid[j] = j < hi ? -1 : 0;
            float *qr = q + r * d, *ar = acc + r * d;
            switch (run) {
                case 1: rows<1, T>(qr, ar, m + r, l + r, kf, vf, valid, 0, hi, c, d); break;
                case 2: rows<2, T>(qr, ar, m + r, l + r, kf, vf, valid, 0, hi, c, d); break;
                case 3: rows<3, T>(qr, ar, m + r, l + r, kf, vf, valid, 0, hi, c, d); break;
                default: rows<4, T>(qr, ar, m + r, l + r, kf, vf, valid, 0, hi, c, d); break;
            }
            r += run;
        }
    }
    finish_rows(it, g, d, acc, m, l);
}

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_in_place_f32(const RowItem& it, const float* kp, const float* vp, const int64_t* table, int g, int d,
                         int bs, float scale) { attend_in_place(it, kp, vp, table, g, d, bs, scale); }

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_in_place_bf16(const RowItem& it, const uint16_t* kp, const uint16_t* vp, const int64_t* table, int g,
                          int d, int bs, float scale) { attend_in_place(it, kp, vp, table, g, d, bs, scale); }

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void attend_rows_cloned(const RowItem& it, int g, int d, float scale) { attend_rows(it, g, d, scale); }

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

// Query rows of segments of positions, each segment's positions reading one block table: q (T, kvh, g, d)
// float32 (T rows; segment s is rows [starts[s], starts[s + 1])); tables (S, table_stride) int64; lens (S,):
// position i of a segment's n sees keys [0, lens - n + 1 + i). out like q, lse (T, kvh, g). Same
// requirements as kvs_paged_decode, and every position sees at least one key.
void kvs_paged_rows(const float* q, const void* kv, int bf16, const int64_t* tables, int64_t table_stride,
                    const int64_t* starts, const int64_t* lens, int64_t segments,
                    int64_t kvh, int64_t g, int64_t d, int64_t num_blocks, int64_t bs, float scale, float* out,
                    float* lse) {
    // Positions per item: as many as MAX_ROWS holds, fewer when that would leave threads idle.
    const int64_t total = starts[segments] - starts[0], threads = omp_get_max_threads();
    const int64_t positions = std::max<int64_t>(1, std::min<int64_t>(MAX_ROWS / g, total * kvh / (4 * threads)));
    const int64_t elem = bf16 ? 2 : 4, tile_floats = 2 * W * d;
    const int64_t plane = num_blocks * bs * d * elem;
    const char* base = static_cast<const char*>(kv);
    // Prepared tiles: segment s, kv head h from float (tile_first[s] * kvh + h * tiles(s)) * tile_floats on.
    // Segments of IN_PLACE_POSITIONS or fewer are read in place and get no prepared tiles.
    std::vector<int64_t> tile_first(segments + 1, 0);
    for (int64_t s = 0; s < segments; ++s)
        tile_first[s + 1] = tile_first[s] + (starts[s + 1] - starts[s] <= IN_PLACE_POSITIONS ? 0 : (lens[s] + W - 1) / W);
    thread_local std::vector<float> prepared;            // kept: a fresh buffer per call would fault its pages in
    if (prepared.size() < static_cast<size_t>(tile_first[segments] * kvh * tile_floats))
        prepared.resize(tile_first[segments] * kvh * tile_floats);
    float* tiles = prepared.data();
    std::vector<std::pair<int64_t, int64_t>> chunks;     // (segment, first position): the last, longest, first
    for (int64_t s = 0; s < segments; ++s)
        for (int64_t p = starts[s + 1] - starts[s]; p > 0; p -= positions)
            chunks.emplace_back(s, starts[s] + (p - 1) / positions * positions);
    const int64_t stride = kvh * g * d, items = static_cast<int64_t>(chunks.size()) * kvh;
    const int64_t all_tiles = tile_first[segments] * kvh;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < all_tiles; ++i) {       // tile i: segment s, head h, tile t of it
            const int64_t s = std::upper_bound(tile_first.begin(), tile_first.end(), i / kvh) - tile_first.begin() - 1;
            const int64_t per = tile_first[s + 1] - tile_first[s], h = (i - tile_first[s] * kvh) / per;
            const int64_t t = (i - tile_first[s] * kvh) % per;
            float* kt = tiles + i * tile_floats;
            const int64_t* table = tables + s * table_stride;
            if (bf16)
                prepare_tile_bf16(kt, kt + W * d, reinterpret_cast<const uint16_t*>(base + h * plane),
                                  reinterpret_cast<const uint16_t*>(base + (kvh + h) * plane), table, t * W, lens[s],
                                  static_cast<int>(bs), static_cast<int>(d));
            else
                prepare_tile_f32(kt, kt + W * d, reinterpret_cast<const float*>(base + h * plane),
                                 reinterpret_cast<const float*>(base + (kvh + h) * plane), table, t * W, lens[s],
                                 static_cast<int>(bs), static_cast<int>(d));
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; ++i) {
            const auto [s, t0] = chunks[i / kvh];
            const int64_t h = i % kvh, n = starts[s + 1] - starts[s], i0 = t0 - starts[s];
            const int64_t len0 = lens[s] - (n - 1) + i0;
            const int count = static_cast<int>(starts[s + 1] - t0 < positions ? starts[s + 1] - t0 : positions);
            const int64_t row = t0 * stride + h * g * d, per = tile_first[s + 1] - tile_first[s];
            const RowItem it{q + row, tiles + (tile_first[s] * kvh + h * per) * tile_floats, len0, count, stride,
                             out + row, lse + row / d};
            if (per > 0)
                attend_rows_cloned(it, static_cast<int>(g), static_cast<int>(d), scale);
            else if (bf16)
                attend_in_place_bf16(it, reinterpret_cast<const uint16_t*>(base + h * plane),
                                     reinterpret_cast<const uint16_t*>(base + (kvh + h) * plane), tables + s * table_stride,
                                     static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs), scale);
            else
                attend_in_place_f32(it, reinterpret_cast<const float*>(base + h * plane),
                                    reinterpret_cast<const float*>(base + (kvh + h) * plane), tables + s * table_stride,
                                    static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs), scale);
        }
    }
}

}  // extern "C"
