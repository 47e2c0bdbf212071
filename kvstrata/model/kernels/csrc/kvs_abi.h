// The C interface of every kernel library, declared once: each source includes this header (so the compiler
// checks each definition against its declaration), and kvstrata/model/kernels/abi.py reads this very text to
// make the ctypes signatures and structs (so Python and C++ cannot drift: a drift through raw pointers is
// memory corruption, not an error). Keep to the forms abi.py reads: one `KVS_API` declaration per entry point,
// `struct Kvs... { type name, name; ... };` with one type per line, and the GGUF type table below.
//
// A library is built once per ISA level (kvstrata/model/kernels/isa.py picks the level, build.py the flags):
// the code chooses its paths by the compiler's own macros (__AVX512VNNI__, __AVX2__, ...), and every library
// answers `kvs_abi()` (this header's hash, which the loader compares) and `kvs_level()`.

#pragma once

#include <cstdint>

#define KVS_API extern "C" __attribute__((visibility("default")))

// The GGUF types our GGUF kernel runs at their own bits, the one table of their facts (kvstrata/model/formats
// reads it from here): X(kind, name, weights a block, bytes a block in the file).
#define KVS_GGUF_TYPES(X) \
    X(0, Q4_0, 32, 18)    \
    X(1, Q4_1, 32, 20)    \
    X(2, Q8_0, 32, 34)    \
    X(3, Q6_K, 256, 210)  \
    X(4, BF16, 1, 2)      \
    X(5, Q5_0, 32, 22)    \
    X(6, Q5_1, 32, 24)    \
    X(7, Q4_K, 256, 144)  \
    X(8, Q5_K, 256, 176)

// ---- every library ------------------------------------------------------------------------------------------
KVS_API int64_t kvs_abi();       // KVS_ABI_HASH, this header's hash as the build saw it
KVS_API int64_t kvs_level();     // KVS_LEVEL, the ISA level the library was built for

// ---- paged_attention.cpp ------------------------------------------------------------------------------------
KVS_API int64_t kvs_max_group();
KVS_API int64_t kvs_supports_head_dim(int64_t d);
KVS_API int64_t kvs_lanes();
KVS_API void kvs_paged_decode(const float* q, const void* kv, int64_t bf16, const int64_t* tables,
                              int64_t table_stride, const int64_t* first, const int64_t* lens, int64_t n, int64_t kvh,
                              int64_t g, int64_t d, int64_t num_blocks, int64_t bs, float scale, float* out,
                              float* lse);
KVS_API void kvs_paged_rows(const float* q, const void* kv, int64_t bf16, const int64_t* tables,
                            int64_t table_stride, const int64_t* starts, const int64_t* lens, int64_t segments,
                            int64_t window, int64_t kvh, int64_t g, int64_t d, int64_t num_blocks, int64_t bs,
                            float scale, float* out, float* lse);

// ---- norm_act.cpp -------------------------------------------------------------------------------------------
KVS_API int64_t kvs_rope_max_head_dim();
KVS_API void kvs_rms_norm(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* out, int64_t rows,
                          int64_t n, float eps);
KVS_API void kvs_rms_norm_wide(const uint16_t* x, int64_t x_stride, const float* w, uint16_t* out, int64_t rows,
                               int64_t n, float eps);
KVS_API void kvs_silu_mul(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n);
KVS_API void kvs_rope_store(const void* qkv, int64_t qkv_stride, int64_t bf16, const void* cos, const void* sin,
                            const int64_t* slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, void* kv,
                            int64_t plane_slots, float* q);

// ---- lora.cpp -----------------------------------------------------------------------------------------------
KVS_API void kvs_lora_apply(uint16_t* y, int64_t y_stride, const uint16_t* x, int64_t x_stride, int64_t in,
                            int64_t out, int64_t groups, const int64_t* offsets, const int64_t* rows,
                            const uint16_t* const* a, const uint16_t* const* bt, const int64_t* ranks);

// ---- gguf_matmul.cpp ----------------------------------------------------------------------------------------
KVS_API int64_t kvs_gguf_packed_bytes(int64_t kind, int64_t out, int64_t in);
KVS_API void kvs_gguf_pack(int64_t kind, const uint8_t* raw, int64_t out, int64_t in, uint8_t* packed);
KVS_API void kvs_gguf_matmul(int64_t kind, const uint8_t* packed, int64_t out, int64_t in, const void* x,
                             int64_t x_stride, void* y, int64_t y_stride, int64_t rows, int64_t is_bf16);

// ---- decoder_layers.cpp: a step's layers, calling the entry points above by their addresses ------------------
struct KvsKernels {
    decltype(&kvs_rms_norm) rms_norm;
    decltype(&kvs_silu_mul) silu_mul;
    decltype(&kvs_rope_store) rope_store;
    decltype(&kvs_gguf_matmul) gguf_matmul;
    decltype(&kvs_paged_decode) paged_decode;
    decltype(&kvs_paged_rows) paged_rows;
};

struct KvsProjection {           // a GGUF projection without bias, packed by kvs_gguf_pack
    const uint8_t* packed;
    int64_t kind, out, in;
};

struct KvsLayer {
    const uint16_t* input_norm;
    const uint16_t* post_norm;
    KvsProjection qkv;
    KvsProjection o;
    KvsProjection gate_up;
    KvsProjection down;
    void* kv;                    // the layer's (2, kv_heads, num_blocks, block_size, head_dim) bf16 cache
};

struct KvsStep {                 // one forward's shapes and attention plan (kvstrata.model.network.attention)
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size;
    float eps, scale;
    const uint16_t* cos;         // (rows, head_dim) each
    const uint16_t* sin;
    const int64_t* slots;        // (rows,)
    int64_t decodes;             // rows [0, decodes): the paged kernel's decodes
    const int64_t* decode_tables;
    int64_t decode_table_stride;
    const int64_t* first;
    const int64_t* decode_lens;
    int64_t rows_start, segments;   // rows [rows_start, rows): prefill segments
    const int64_t* row_tables;
    int64_t row_table_stride;
    const int64_t* starts;
    const int64_t* row_lens;
    double* seconds;             // null, or [projections, attention, the rest] to add this call's time to
};

KVS_API int64_t kvs_sizeof_step();       // sizeof(KvsStep), sizeof(KvsLayer): checked against ctypes at load
KVS_API int64_t kvs_sizeof_layer();
KVS_API void kvs_decoder_layers(const KvsKernels* k, const KvsLayer* layers, int64_t n_layers, const KvsStep* s,
                                uint16_t* h);

// Every library's own answers (one definition per library: each is built from one source).
#ifdef KVS_LEVEL
KVS_API int64_t kvs_abi() { return KVS_ABI_HASH; }
KVS_API int64_t kvs_level() { return KVS_LEVEL; }
#endif
