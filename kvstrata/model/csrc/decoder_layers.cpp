// A step's decoder layers in one call (see kvstrata/model/fused_layers.py): for a bf16 model whose every
// projection our GGUF kernel runs, the Python loop over layers dispatched ~12 calls a layer (norms, four
// projections, RoPE with the K/V write, attention, the residual adds), each a few microseconds of
// interpreter and ctypes around a few microseconds of work at one row. Here the loop is C++, and it calls
// the same entry points of the other libraries (their addresses come in `Kernels`), so every result has the
// bits of the Python loop: the only arithmetic of its own is the bf16 rounding of attention's output and
// the residual adds, each rounded to nearest even as torch rounds.

#include <cstdint>
#include <ctime>
#include <vector>

#include "vec16.h"

namespace {

struct Kernels {                 // the other libraries' entry points (the C signatures in their sources)
    void (*rms_norm)(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                     float eps);
    void (*silu_mul)(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n);
    void (*rope_store)(const void* qkv, int64_t qkv_stride, int bf16, const void* cos, const void* sin,
                       const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, void* kv,
                       int64_t plane_slots, float* q);
    void (*gguf_matmul)(int kind, int level, const uint8_t* packed, int64_t out, int64_t in, const void* x,
                        int64_t x_stride, void* y, int64_t y_stride, int64_t rows, int is_bf16);
    void (*paged_decode)(const float* q, const void* kv, int bf16, const int64_t* tables, int64_t table_stride,
                         const int64_t* first, const int64_t* lens, int64_t n, int64_t kvh, int64_t g, int64_t d,
                         int64_t num_blocks, int64_t bs, float scale, float* out, float* lse);
    void (*paged_rows)(const float* q, const void* kv, int bf16, const int64_t* tables, int64_t table_stride,
                       const int64_t* starts, const int64_t* lens, int64_t segments, int64_t kvh, int64_t g, int64_t d,
                       int64_t num_blocks, int64_t bs, float scale, float* out, float* lse);
};

struct Projection {              // a GGUFLinear without bias
    const uint8_t* packed;
    int64_t kind, level, out, in;
};

struct Layer {
    const uint16_t* input_norm;
    const uint16_t* post_norm;
    Projection qkv, o, gate_up, down;
    void* kv;                    // the layer's (2, kv_heads, num_blocks, block_size, head_dim) bf16 cache
};

struct Step {                    // one forward's shapes and attention plan (kvstrata.model.attention.AttentionPlan)
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size;
    float eps, scale;
    const uint16_t* cos;         // (rows, head_dim) each
    const uint16_t* sin;
    const int64_t* slots;        // (rows,)
    int64_t decodes;             // rows [0, decodes): the paged kernel's decodes (KernelCall)
    const int64_t* decode_tables;
    int64_t decode_table_stride;
    const int64_t* first;
    const int64_t* decode_lens;
    int64_t rows_start, segments;   // rows [rows_start, rows): prefill segments (KernelRows)
    const int64_t* row_tables;
    int64_t row_table_stride;
    const int64_t* starts;
    const int64_t* row_lens;
    double* seconds;             // null, or [projections, attention, the rest] to add this call's time to
};

double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Clock {                   // splits the call's time between the parts of `Step::seconds`
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

void project(const Kernels& k, const Projection& p, const uint16_t* x, uint16_t* y, int64_t rows) {
    k.gguf_matmul(static_cast<int>(p.kind), static_cast<int>(p.level), p.packed, p.out, p.in, x, p.in, y, p.out, rows, 1);
}

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void add_rows(uint16_t* h, const uint16_t* y, int64_t n) {          // h += y in bf16: float sum, rounded
    for (int64_t i = 0; i < n; i += 16) store(h + i, load(h + i) + load(y + i));
}

__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void narrow_rows(const float* x, uint16_t* out, int64_t n) {         // float32 -> bf16
    for (int64_t i = 0; i < n; i += 16) store(out + i, load(x + i));
}

}  // namespace

extern "C" {

// h (rows, hidden) bf16, contiguous: the residual stream after the embeddings, replaced by the last layer's
// output. hidden, heads * head_dim and intermediate are multiples of 16.
void kvs_decoder_layers(const Kernels* k, const Layer* layers, int64_t n_layers, const Step* s, uint16_t* h) {
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
        const Layer& layer = layers[l];
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
                          s->row_lens, s->segments, kvh, g, s->head_dim, s->num_blocks, s->block_size, s->scale,
                          o + s->rows_start * hd, lse + s->rows_start * s->heads);
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

}  // extern "C"
