// Paged attention that reads K/V where they lie in the cache (see kvstrata/model/kernels/paged.py): decodes
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
// Written with GCC vector extensions (16 floats), not intrinsics: the same code is built for every ISA level
// (kvstrata/model/kernels/isa.py: AVX-512, AVX2 + FMA, baseline x86-64), so the library is correct on any
// x86-64 and fast where the wide units exist. No -ffast-math: exp16's rounding trick relies on IEEE order.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <utility>
#include <vector>

#include <omp.h>

#include "kvs_abi.h"
#include "paged_tiles.h"

namespace {

template <typename T>
INLINE const T* plane_at(const char* base, int64_t index, int64_t plane) {     // K or V plane `index` of a layer
    return reinterpret_cast<const T*>(base + index * plane);
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

constexpr int MAX_ROWS = 48;     // query rows of one item: positions x G
#ifndef IN_PLACE_POSITIONS
#define IN_PLACE_POSITIONS 16     // segments of at most this many positions are read in place
#endif

struct RowItem {
    const float* q;          // its first position's rows: (G, D) per position, `stride` floats apart
    const float* tiles;      // its (segment, kv head)'s prepared tiles: Kt (D x W) then V (W x D), each
    int64_t tile0;           // the key of its first prepared tile
    int64_t len0;            // position i of the item sees keys [0, len0 + i), or their last `window`
    int64_t window;          // 0: every key
    int positions;
    int64_t stride;          // floats from one position's rows to the next (in q, out; lse: / D)
    float* out;              // like q
    float* lse;              // (G,) per position, stride / D apart
};

INLINE int tile_keys(int64_t len, int64_t tile) { return static_cast<int>(len - tile < W ? len - tile : W); }
INLINE int tile_low(int64_t low, int64_t tile) { return static_cast<int>(low > tile ? low - tile : 0); }

// An item's rows scaled into q, their sums and maxima zeroed, and the keys each sees: [low, len) (position i:
// len0 + i, and low its window's first key).
INLINE void start_rows(const RowItem& it, int g, int d, float scale, float* q, float* acc, float* m, float* l,
                       int64_t* low, int64_t* len) {
    for (int p = 0; p < it.positions; ++p)
        for (int i = 0; i < g * d; ++i) {
            q[p * g * d + i] = it.q[p * it.stride + i] * scale;
            acc[p * g * d + i] = 0.f;
        }
    for (int r = 0; r < it.positions * g; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        len[r] = it.len0 + r / g;
        low[r] = it.window > 0 && len[r] > it.window ? len[r] - it.window : 0;
    }
}

// The rows of an item that see keys of tile `tile`: [first, stop), both only ever growing with the tile (a row's
// window starts no earlier than the row before's); runs of up to four of them that see the same keys of it go to
// `attend(r, run, lo, hi)` in order. A row's first tile is the one holding its window's first key, as for a decode.
template <typename F>
INLINE void tile_runs(const int64_t* low, const int64_t* len, int n, int g, int64_t tile, int& first, int& stop,
                      F attend) {
    while (len[first] <= tile) first += g;
    while (stop < n && low[stop] < tile + W) stop += g;
    for (int r = first; r < stop;) {
        const int lo = tile_low(low[r], tile), hi = tile_keys(len[r], tile);
        int run = 1;
        while (run < 4 && r + run < stop && tile_low(low[r + run], tile) == lo && tile_keys(len[r + run], tile) == hi)
            ++run;
        attend(r, run, lo, hi);
        r += run;
    }
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

INLINE void attend_rows(const RowItem& it, int g, int d, float scale) {
    const int c = d / W, n = it.positions * g;
    alignas(64) float q[MAX_ROWS * MAX_D], acc[MAX_ROWS * MAX_D];
    float m[MAX_ROWS], l[MAX_ROWS];
    int64_t low[MAX_ROWS], len[MAX_ROWS];
    start_rows(it, g, d, scale, q, acc, m, l, low, len);
    const int64_t end = it.len0 + it.positions - 1;       // the last row's keys
    int first = 0, stop = 0;
    for (int64_t tile = low[0] / W * W; tile < end; tile += W) {
        const float* kt = it.tiles + (tile - it.tile0) / W * 2 * W * d;
        const float* vt = kt + W * d;
        tile_runs(low, len, n, g, tile, first, stop, [&](int r, int run, int lo, int hi) {
            float *qr = q + r * d, *ar = acc + r * d;
            switch (run) {
                case 1: rows_transposed<1>(qr, ar, m + r, l + r, kt, vt, lo, hi, c, d); break;
                case 2: rows_transposed<2>(qr, ar, m + r, l + r, kt, vt, lo, hi, c, d); break;
                case 3: rows_transposed<3>(qr, ar, m + r, l + r, kt, vt, lo, hi, c, d); break;
                default: rows_transposed<4>(qr, ar, m + r, l + r, kt, vt, lo, hi, c, d); break;
            }
        });
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
    int64_t low[MAX_ROWS], len[MAX_ROWS];
    start_rows(it, g, d, scale, q, acc, m, l, low, len);
    const int64_t end = it.len0 + it.positions - 1;       // the last row's keys
    int first = 0, stop = 0;
    for (int64_t tile = low[0] / W * W; tile < end; tile += W) {
        const T *kf, *vf;
        tile_keys_of(kp, vp, table, tile, end, bs, d, kbuf, vbuf, kf, vf);
        tile_runs(low, len, n, g, tile, first, stop, [&](int r, int run, int lo, int hi) {
            i16v valid;
            for (int j = 0; j < W; ++j) valid[j] = j >= lo && j < hi ? -1 : 0;
            float *qr = q + r * d, *ar = acc + r * d;
            switch (run) {
                case 1: rows<1, T>(qr, ar, m + r, l + r, kf, vf, valid, lo, hi, c, d); break;
                case 2: rows<2, T>(qr, ar, m + r, l + r, kf, vf, valid, lo, hi, c, d); break;
                case 3: rows<3, T>(qr, ar, m + r, l + r, kf, vf, valid, lo, hi, c, d); break;
                default: rows<4, T>(qr, ar, m + r, l + r, kf, vf, valid, lo, hi, c, d); break;
            }
        });
    }
    finish_rows(it, g, d, acc, m, l);
}

}  // namespace

// Limits the caller checks before calling (kvstrata/model/kernels/paged.py reads them once).
int64_t kvs_max_group() { return MAX_G; }
int64_t kvs_supports_head_dim(int64_t d) { return d % W == 0 && d <= MAX_D; }
int64_t kvs_lanes() { return W; }

// q (n, kvh, g, d) float32; kv (2, kvh, num_blocks, bs, d) float32 (bf16 = 0) or bfloat16 (bf16 = 1);
// tables (n, table_stride) int64; first, lens (n,) int64; out (n, kvh, g, d) float32; lse (n, kvh, g).
// Requires g <= MAX_G, kvs_supports_head_dim(d), bs a multiple or a divisor of W, and first < len for every
// sequence.
void kvs_paged_decode(const float* q, const void* kv, int64_t bf16, const int64_t* tables, int64_t table_stride,
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
            attend_item<uint16_t>(it, static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs), scale);
        else
            attend_item<float>(it, static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs), scale);
    }
}

// Query rows of segments of positions, each segment's positions reading one block table: q (T, kvh, g, d)
// float32 (T rows; segment s is rows [starts[s], starts[s + 1])); tables (S, table_stride) int64; lens (S,):
// position i of a segment's n sees keys [0, lens - n + 1 + i), or with `window` > 0 (a sliding layer) the last
// `window` of them, whose blocks alone the table need hold (a position reads from its window's first tile on,
// as a decode with `first` at its window's start does, so the two paths give a row the same bits). out like q,
// lse (T, kvh, g). Same requirements as kvs_paged_decode, and every position sees at least one key.
void kvs_paged_rows(const float* q, const void* kv, int64_t bf16, const int64_t* tables, int64_t table_stride,
                    const int64_t* starts, const int64_t* lens, int64_t segments, int64_t window,
                    int64_t kvh, int64_t g, int64_t d, int64_t num_blocks, int64_t bs, float scale, float* out,
                    float* lse) {
    // Positions per item: as many as MAX_ROWS holds, fewer when that would leave threads idle.
    const int64_t total = starts[segments] - starts[0], threads = omp_get_max_threads();
    const int64_t positions = std::max<int64_t>(1, std::min<int64_t>(MAX_ROWS / g, total * kvh / (4 * threads)));
    const int64_t elem = bf16 ? 2 : 4, tile_floats = 2 * W * d;
    const int64_t plane = num_blocks * bs * d * elem;
    const char* base = static_cast<const char*>(kv);
    // Prepared tiles: segment s, kv head h from float (tile_first[s] * kvh + h * tiles(s)) * tile_floats on,
    // the keys from its first position's first tile (key tile0[s]) to its last. Segments of IN_PLACE_POSITIONS
    // or fewer are read in place and get no prepared tiles.
    std::vector<int64_t> tile_first(segments + 1, 0), tile0(segments, 0);
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t n = starts[s + 1] - starts[s], first_len = lens[s] - n + 1;
        tile0[s] = window > 0 && first_len > window ? (first_len - window) / W * W : 0;
        tile_first[s + 1] = tile_first[s] + (n <= IN_PLACE_POSITIONS ? 0 : (lens[s] + W - 1) / W - tile0[s] / W);
    }
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
                prepare_tile(kt, kt + W * d, plane_at<uint16_t>(base, h, plane), plane_at<uint16_t>(base, kvh + h, plane),
                             table, tile0[s] + t * W, lens[s], static_cast<int>(bs), static_cast<int>(d));
            else
                prepare_tile(kt, kt + W * d, plane_at<float>(base, h, plane), plane_at<float>(base, kvh + h, plane), table,
                             tile0[s] + t * W, lens[s], static_cast<int>(bs), static_cast<int>(d));
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; ++i) {
            const auto [s, t0] = chunks[i / kvh];
            const int64_t h = i % kvh, n = starts[s + 1] - starts[s], i0 = t0 - starts[s];
            const int64_t len0 = lens[s] - (n - 1) + i0;
            const int count = static_cast<int>(starts[s + 1] - t0 < positions ? starts[s + 1] - t0 : positions);
            const int64_t row = t0 * stride + h * g * d, per = tile_first[s + 1] - tile_first[s];
            const RowItem it{q + row, tiles + (tile_first[s] * kvh + h * per) * tile_floats, tile0[s], len0, window,
                             count, stride, out + row, lse + row / d};
            if (per > 0)
                attend_rows(it, static_cast<int>(g), static_cast<int>(d), scale);
            else if (bf16)
                attend_in_place(it, plane_at<uint16_t>(base, h, plane), plane_at<uint16_t>(base, kvh + h, plane),
                                tables + s * table_stride, static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs),
                                scale);
            else
                attend_in_place(it, plane_at<float>(base, h, plane), plane_at<float>(base, kvh + h, plane),
                                tables + s * table_stride, static_cast<int>(g), static_cast<int>(d), static_cast<int>(bs),
                                scale);
        }
    }
}
