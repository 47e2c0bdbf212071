// LoRA updates of one projection for every adapter of a step, in one call (see kvstrata/model/lora.py):
// y[row] += (x[row] @ A_g.T) @ BT_g for each row of each group g. In torch that is two small matmuls and
// an add per adapter and projection, ~120 projections a step: on a 2-core CPU their dispatches cost more
// than their arithmetic (a 32-row step with 4 adapters: +20-30 ms on a 35 ms step). Here it is one call.
//
// bfloat16 in and out, float32 inside: a row's shrink (t = A x, r dot products of `in` values, each in
// one fixed order of 16 lanes then halving folds) stays in float32, its expand adds t @ BT to the row in
// float32 and rounds once, as torch rounds. Rows of one adapter go in blocks of up to 8, so each weight
// vector is read once per block (a decode step is memory-bound: 4 rank-16 adapters are 39 MB beside
// SmolLM2's 270 MB). A row's result depends only on that row and its adapter: never on the other rows
// of its block or batch, their number, or the thread that ran it.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvs_abi.h"
#include "vec16.h"

namespace {

constexpr int64_t MAX_RANK = 1024;             // LoRAConfig.max_lora_rank's ceiling (per fused projection: 3x)
constexpr int64_t BLOCK = 8;                   // rows of one group done together: each weight vector read once
constexpr int64_t PARALLEL_MACS = 1 << 18;     // fewer multiply-adds than this: one thread

// Rows x[0..N) of one group (their own addresses): t = A x_n, then y_n += t BT, each row's sums in the
// same order whatever N is, so a row's bits do not depend on the rows done beside it. BT comes in tiles
// of 16 columns, each tile's rank x 16 values contiguous (`bt_tiles`), so the expand reads it in one
// stream rather than rank strided ones.
template <int N>
__attribute__((always_inline)) inline void lora_rows(uint16_t* const* y, const float* xs, const uint16_t* a,
                                                     const uint16_t* bt_tiles, int64_t in, int64_t out,
                                                     int64_t rank, float* t) {
    for (int64_t j = 0; j < rank; ++j) {
        const uint16_t* row = a + j * in;
        v16 acc[N];
        for (int n = 0; n < N; ++n) acc[n] = splat(0.f);
        for (int64_t k = 0; k < in; k += 16) {
            const v16 w = load(row + k);
            for (int n = 0; n < N; ++n) acc[n] += w * load(xs + n * in + k);
        }
        for (int n = 0; n < N; ++n) t[j * N + n] = lanes_sum(acc[n]);
    }
    for (int64_t o = 0; o < out; o += 16) {
        const uint16_t* tile = bt_tiles + o * rank;          // tile o / 16: rank rows of 16
        v16 acc[N];
        for (int n = 0; n < N; ++n) acc[n] = load(y[n] + o);
        for (int64_t j = 0; j < rank; ++j) {
            const v16 w = load(tile + j * 16);
            for (int n = 0; n < N; ++n) acc[n] += splat(t[j * N + n]) * w;
        }
        for (int n = 0; n < N; ++n) store(y[n] + o, acc[n]);
    }
}

void lora_block(uint16_t* const* y, const uint16_t* const* x, int n, const uint16_t* a, const uint16_t* bt,
                int64_t in, int64_t out, int64_t rank, float* xs, float* t) {
    for (int r = 0; r < n; ++r)                // each row widened to float32 once, not once per rank
        for (int64_t k = 0; k < in; k += 16) store(xs + r * in + k, load(x[r] + k));
    switch (n) {
        case 8: lora_rows<8>(y, xs, a, bt, in, out, rank, t); break;
        case 7: lora_rows<7>(y, xs, a, bt, in, out, rank, t); break;
        case 6: lora_rows<6>(y, xs, a, bt, in, out, rank, t); break;
        case 5: lora_rows<5>(y, xs, a, bt, in, out, rank, t); break;
        case 4: lora_rows<4>(y, xs, a, bt, in, out, rank, t); break;
        case 3: lora_rows<3>(y, xs, a, bt, in, out, rank, t); break;
        case 2: lora_rows<2>(y, xs, a, bt, in, out, rank, t); break;
        default: lora_rows<1>(y, xs, a, bt, in, out, rank, t); break;
    }
}

}  // namespace

// y (rows, out) and x (rows, in) bfloat16 with row strides y_stride and x_stride; in % 16 == 0 and
// out % 16 == 0. Group g's rows are rows[offsets[g]:offsets[g + 1]] (each row in at most one group), its
// A is a[g] (ranks[g], in) and its BT is bt[g] in tiles (out / 16, ranks[g], 16), both contiguous bfloat16.
void kvs_lora_apply(uint16_t* y, int64_t y_stride, const uint16_t* x, int64_t x_stride, int64_t in, int64_t out,
                    int64_t groups, const int64_t* offsets, const int64_t* rows, const uint16_t* const* a,
                    const uint16_t* const* bt, const int64_t* ranks) {
    std::vector<int64_t> starts, group_of;     // blocks of up to BLOCK rows, never across two groups
    int64_t macs = 0;
    for (int64_t g = 0; g < groups; ++g) {
        if (ranks[g] == 0) continue;           // the adapter does not target this projection
        for (int64_t i = offsets[g]; i < offsets[g + 1]; i += BLOCK) {
            starts.push_back(i);
            group_of.push_back(g);
        }
        macs += (offsets[g + 1] - offsets[g]) * ranks[g] * (in + out);
    }
    const int64_t blocks = static_cast<int64_t>(starts.size());
#pragma omp parallel if (macs >= PARALLEL_MACS)
    {
        std::vector<float> xs(BLOCK * in), t(BLOCK * 3 * MAX_RANK);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t g = group_of[b], first = starts[b];
            const int n = static_cast<int>(std::min<int64_t>(BLOCK, offsets[g + 1] - first));
            uint16_t* ys[BLOCK];
            const uint16_t* xr[BLOCK];
            for (int r = 0; r < n; ++r) {
                ys[r] = y + rows[first + r] * y_stride;
                xr[r] = x + rows[first + r] * x_stride;
            }
            lora_block(ys, xr, n, a[g], bt[g], in, out, ranks[g], xs.data(), t.data());
        }
    }
}
