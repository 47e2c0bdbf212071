// The packed layout of gguf_matmul.cpp's quantized kinds, and the packing of a file's rows into it.
//
// Output rows go in tiles of 16; a tile holds its blocks of 32 inputs in order, each block its 16 rows' quants
// interleaved 4 bytes a row (one 64-byte load is 16 rows x 4 inputs), then the 16 rows' scales d, then (the kinds
// with a minimum) their minimums m, then (Q6_K) its sub-scales:
//
//   kind        quants             d, m                   a weight                file bits / ours
//   Q4_0        nibbles            f16 d                  d (q - 8)               4.5 / 4.5
//   Q4_1        nibbles            f16 d, m               d q + m                 5.0 / 5.0
//   Q8_0        bytes, q + 128     f16 d                  d q                     8.5 / 8.5
//   Q5_0        bytes              f16 d                  d (q - 16)              5.5 / 8.5
//   Q5_1        bytes              f16 d, m               d q + m                 6.0 / 9.0
//   Q4_K        nibbles            f32 d sc, -dmin mn     d sc q - dmin mn        4.5 / 6.0
//   Q5_K        bytes              f32 d sc, -dmin mn     d sc q - dmin mn        5.5 / 10.0
//   Q6_K        bytes              f16 d, i8 sc per 16    d sc (q - 32)           6.56 / 9.0
//
// Nibbles keep the file's order (input j low, j + 16 high). The 5-bit kinds (their fifth bit in a plane of its
// own in the file) are widened to a byte a weight, and the K-quants' super-blocks of 256 become 8 blocks of 32
// whose d sc and dmin mn (a float16 times a 6-bit integer) are exact in float32, not in float16: so every kind is
// a block of 32 quants with a scale (and a minimum), and the kernel's integer dot products and float steps are
// the same for all. Ours is the wider of the two where the table says so: the 5-bit kinds read ~1.6x their
// file's bytes at decode, which a bit plane of their own would save.

#pragma once

#include <cstdint>
#include <cstring>

#include "kvs_abi.h"

namespace {

constexpr int64_t TILE = 16;                   // output rows per tile
constexpr int64_t QK = 32;                     // weights per block

#define KVS_KIND(kind, name, weights, bytes) name = kind,
enum Kind : int { KVS_GGUF_TYPES(KVS_KIND) };     // BF16: bf16_tiles.h
#undef KVS_KIND

constexpr bool nibbles(int kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q4_K; }
constexpr bool byte_quants(int kind) { return !nibbles(kind); }
constexpr bool wide_scales(int kind) { return kind == Q4_K || kind == Q5_K; }     // float32 d and m
constexpr bool has_min(int kind) { return kind == Q4_1 || kind == Q5_1 || wide_scales(kind); }
constexpr int64_t data_bytes(int kind) { return nibbles(kind) ? 256 : 512; }
constexpr int64_t scale_bytes(int kind) { return wide_scales(kind) ? 4 : 2; }    // of one row's d (and m)
constexpr int64_t d_at(int kind) { return data_bytes(kind); }
constexpr int64_t m_at(int kind) { return data_bytes(kind) + TILE * scale_bytes(kind); }   // Q6_K: its sc
constexpr int64_t block_stride(int kind) {
    return data_bytes(kind) + TILE * scale_bytes(kind) * (has_min(kind) ? 2 : 1) + (kind == Q6_K ? 32 : 0);
}
constexpr int32_t offset_of(int kind) {
    return kind == Q8_0 ? 128 : kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : kind == Q6_K ? 32 : 0;
}
#define KVS_FACT(kind, name, weights, bytes) {weights, bytes},
constexpr int64_t SOURCE[][2] = {KVS_GGUF_TYPES(KVS_FACT)};      // a file block's weights and bytes, by kind
#undef KVS_FACT
constexpr int64_t source_weights(int kind) { return SOURCE[kind][0]; }
constexpr int64_t source_bytes(int kind) { return SOURCE[kind][1]; }

inline float half_to_float(const uint8_t* p) {
    _Float16 h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
}

// One row's block in a packed block `blk` (row l of its tile): its quants q[0..32) (0..15 for the nibble kinds).
inline void place_quants(int kind, uint8_t* blk, int64_t l, const uint8_t* q) {
    if (nibbles(kind)) {
        for (int64_t i = 0; i < 16; ++i) blk[(i / 4) * 64 + l * 4 + i % 4] = q[i] | static_cast<uint8_t>(q[i + 16] << 4);
    } else {
        for (int64_t i = 0; i < QK; ++i) blk[(i / 4) * 64 + l * 4 + i % 4] = q[i];
    }
}

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j of a super-block's 12 scale bytes (ggml's order).
inline void k_scale_min(int j, const uint8_t* s, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Row l's source block `src` of a Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K matrix into the packed blocks
// `blks` (one per 32 of its weights).
inline void pack_source_block(int kind, const uint8_t* src, int64_t l, uint8_t* const* blks) {
    uint8_t q[256];
    if (kind == Q4_K || kind == Q5_K) {
        // {f16 d, f16 dmin, u8 scales[12], (Q5_K: u8 qh[32],) u8 qs[128]}: each 64 weights' low nibbles, then highs
        const uint8_t* qh = src + 16;
        const uint8_t* qs = src + (kind == Q5_K ? 48 : 16);
        for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 32; ++i) {
                const int lo = qs[32 * c + i] & 0x0F, hi = qs[32 * c + i] >> 4;
                q[64 * c + i] = static_cast<uint8_t>(kind == Q5_K ? lo | (((qh[i] >> (2 * c)) & 1) << 4) : lo);
                q[64 * c + 32 + i] = static_cast<uint8_t>(kind == Q5_K ? hi | (((qh[i] >> (2 * c + 1)) & 1) << 4) : hi);
            }
        const float d = half_to_float(src), dmin = half_to_float(src + 2);
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            k_scale_min(j, src + 4, &sc, &mn);
            const float dj = d * static_cast<float>(sc), mj = -(dmin * static_cast<float>(mn));   // exact
            place_quants(kind, blks[j], l, q + 32 * j);
            std::memcpy(blks[j] + d_at(kind) + 4 * l, &dj, 4);
            std::memcpy(blks[j] + m_at(kind) + 4 * l, &mj, 4);
        }
        return;
    }
    const int64_t scales = has_min(kind) ? 4 : 2;                // f16 d (and m) lead the block
    const uint8_t* qs = src + scales + (kind == Q5_0 || kind == Q5_1 ? 4 : 0);
    if (kind == Q8_0) {
        for (int i = 0; i < 32; ++i) q[i] = qs[i] ^ 0x80;
    } else {
        uint32_t qh = 0;                                         // Q5: the fifth bits, 32 of them
        if (kind == Q5_0 || kind == Q5_1) std::memcpy(&qh, src + scales, 4);
        for (int i = 0; i < 16; ++i) {
            q[i] = static_cast<uint8_t>((qs[i] & 0x0F) | (((qh >> i) & 1) << 4));
            q[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
    }
    place_quants(kind, blks[0], l, q);
    std::memcpy(blks[0] + d_at(kind) + 2 * l, src, 2);                              // d
    if (has_min(kind)) std::memcpy(blks[0] + m_at(kind) + 2 * l, src + 2, 2);        // m
}

// Row l's Q6_K block {u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d} into its 8 packed blocks: each 128 weights' low
// nibbles in ql, their high pairs in qh.
inline void pack_q6_k(const uint8_t* src, int64_t l, uint8_t* const* blks) {
    uint8_t q[256];
    for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = src + 64 * n;
        const uint8_t* qh = src + 128 + 32 * n;
        for (int i = 0; i < 32; ++i) {
            q[128 * n + i] = (ql[i] & 0x0F) | ((qh[i] & 3) << 4);
            q[128 * n + i + 32] = (ql[i + 32] & 0x0F) | (((qh[i] >> 2) & 3) << 4);
            q[128 * n + i + 64] = (ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4);
            q[128 * n + i + 96] = (ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4);
        }
    }
    for (int64_t bb = 0; bb < 8; ++bb) {
        place_quants(Q6_K, blks[bb], l, q + bb * QK);
        std::memcpy(blks[bb] + d_at(Q6_K) + 2 * l, src + 208, 2);                    // d
        blks[bb][m_at(Q6_K) + l] = src[192 + 2 * bb];                                 // sc, inputs 0-15
        blks[bb][m_at(Q6_K) + 16 + l] = src[192 + 2 * bb + 1];                        // sc, inputs 16-31
    }
}

}  // namespace
