// A step's decoder layers in one call (see kvstrata/model/network/fused.py): for a bf16 model whose every
// projection our GGUF kernel runs, the Python loop over layers dispatched ~12 calls a layer (norms, four
// projections, RoPE with the K/V write, attention, the residual adds), each a few microseconds of
// interpreter and ctypes around a few microseconds of work at one row. Here the loop is C++, and it calls
// the same entry points of the other libraries (their addresses come in `Kernels`), so every result has the
// bits of the Python loop: the only arithmetic of its own is the bf16 rounding of attention's output and
// the residual adds, each rounded to nearest even as torch rounds.

#include <cstdint>
#include <ctime>
#include <vector>

#include "kvs_abi.h"
#include "vec16.h"

namespace {

double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Clock {                   // splits the call's time between the parts of `KvsStep::seconds`
    double* seconds;
    double last = seconds ? now() : 0.0;
    void lap(int part) {
        if (!seconds) return;
        const double t = now();
        seconds[part] += t - last;
        last = t;
    }
};

enum Part { PROJECTIONS = 0, ATTENTION = 1, REST = 2 };

void project(const KvsKernels& k, const KvsProjection& p, const uint16_t* x, uint16_t* y, int64_t rows) {
    k.gguf_matmul(p.kind, p.packed, p.out, p.in, x, p.in, y, p.out, rows, 1);
}

void add_rows(uint16_t* h, const uint16_t* y, int64_t n) {          // h += y in bf16: float sum, rounded
    for (int64_t i = 0; i < n; i += 16) store(h + i, load(h + i) + load(y + i));
}

void narrow_rows(const float* x, uint16_t* out, int64_t n) {         // float32 -> bf16
    for (int64_t i = 0; i < n; i += 16) store(out + i, load(x + i));
}

}  // namespace

int64_t kvs_sizeof_step() { return sizeof(KvsStep); }
int64_t kvs_sizeof_layer() { return sizeof(KvsLayer); }

// h (rows, hidden) bf16, contiguous: the residual stream after the embeddings, replaced by the last layer's
// output. hidden, heads * head_dim and intermediate are multiples of 16.
void kvs_decoder_layers(const KvsKernels* k, const KvsLayer* layers, int64_t n_layers, const KvsStep* s,
                        uint16_t* h) {
    const int64_t t = s->rows, e = s->hidden, hd = s->heads * s->head_dim, kvh = s->kv_heads;
    const int64_t g = s->heads / kvh, qkv_width = hd + 2 * kvh * s->head_dim, inter = s->intermediate;
    thread_local std::vector<uint16_t> half;            // kept: fresh buffers each call would fault their pages in
    thread_local std::vector<float> single;
    half.resize(static_cast<size_t>(t * (2 * e + qkv_width + hd + 3 * inter)));
    single.resize(static_cast<size_t>(t * (2 * hd + s->heads)));
    uint16_t *x = half.data(), *qkv = x + t * e, *ob = qkv + t * qkv_width, *y = ob + t * hd, *gu = y + t * e;
    uint16_t* act = gu + 2 * t * inter;
    float *q = single.data(), *o = q + t * hd, *lse = o + t * hd;
    Clock clock{s->seconds};
    for (int64_t l = 0; l < n_layers; ++l) {
        const KvsLayer& layer = layers[l];
        k->rms_norm(h, e, layer.input_norm, x, t, e, s->eps);
        clock.lap(REST);
        project(*k, layer.qkv, x, qkv, t);
        clock.lap(PROJECTIONS);
        k->rope_store(qkv, qkv_width, 1, s->cos, s->sin, s->slots, t, s->heads, kvh, s->head_dim, layer.kv,
                      s->num_blocks * s->block_size, q);
        if (s->decodes)
            k->paged_decode(q, layer.kv, 1, s->decode_tables, s->decode_table_stride, s->first, s->decode_lens,
                            s->decodes, kvh, g, s->head_dim, s->num_blocks, s->block_size, s->scale, o, lse);
        if (s->segments)
            k->paged_rows(q + s->rows_start * hd, layer.kv, 1, s->row_tables, s->row_table_stride, s->starts,
                          s->row_lens, s->segments, 0, kvh, g, s->head_dim, s->num_blocks, s->block_size,
                          s->scale, o + s->rows_start * hd, lse + s->rows_start * s->heads);
        clock.lap(ATTENTION);
        narrow_rows(o, ob, t * hd);
        clock.lap(REST);
        project(*k, layer.o, ob, y, t);
        clock.lap(PROJECTIONS);
        add_rows(h, y, t * e);
        k->rms_norm(h, e, layer.post_norm, x, t, e, s->eps);
        clock.lap(REST);
        project(*k, layer.gate_up, x, gu, t);
        clock.lap(PROJECTIONS);
        k->silu_mul(gu, act, t, inter);
        clock.lap(REST);
        project(*k, layer.down, act, y, t);
        clock.lap(PROJECTIONS);
        add_rows(h, y, t * e);
        clock.lap(REST);
    }
}
