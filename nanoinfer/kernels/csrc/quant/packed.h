// The repacked layout of the 32-value types (types.def's interleave 8): a weight's rows in
// groups of 8, and each group stored block by block, the 8 rows' block b side by side and
// interleaved 4 values at a time. One 32-byte vector then holds 4 values of each of 8
// outputs, so one multiply-add against 4 activation values broadcast to every lane works for
// 8 outputs at once, and the lane of output j ends a block holding its exact integer dot.
// (llama.cpp's Q4_0_8x8 and ik_llama.cpp's _R8 types interleave rows for the same reason.)
//
// A group's block b, 8 times the bytes of one block (rows j = 0..7):
//   d     8 x fp16, row j's scale
//   m     8 x fp16, row j's min (Q4_1, Q5_1)
//   qh    8 x u32 (Q5_0, Q5_1): word c < 4 has bit 4j + t = row j's high bit of value 4c + t;
//         word 4 + c bit 4j + t = its high bit of value 16 + 4c + t
//   qs    4-bit types: 4 vectors of 32 bytes, byte 32c + 4j + t = row j's qs[4c + t] (low
//         nibble: value 4c + t, high nibble: value 16 + 4c + t);
//         Q8_0: 8 vectors, byte 32c + 4j + t = row j's value 4c + t
// The K-quants, 8 times a 256-block:
//   Q4_K, Q5_K  d 8 x fp16, dmin 8 x fp16, then the 12 scale bytes as 3 vectors (vector w: bytes
//               4j..4j+3 = row j's bytes 4w..4w+3, so the scales unpack for 8 rows at once),
//               Q5_K: qh as 8 vectors (byte 32v + 4j + t = row j's qh[4v + t]), then qs as 32
//               vectors, chunk c (qs[32c..32c+31]: sub-blocks 2c low, 2c + 1 high) vector v at
//               32 (8c + v): byte 4j + t = row j's qs[32c + 4v + t]
//   Q6_K        the 6-bit values as 48 vectors, three per (h, v) (h = 0..1, v = 0..7) at
//               32 (3 (8h + v) + c), c = 0..2: byte 4j + k = row j's value 128h + 32c + 4v + k in
//               bits 0..5, and bits 2c, 2c + 1 of its value 128h + 96 + 4v + k in bits 6, 7 (so
//               three values come out with one AND, the fourth from the three bytes' tops); the
//               16 int8 scales as 4 vectors (vector w: bytes 4j..4j+3 = row j's scales 4w..4w+3),
//               d 8 x fp16
// A weight of N rows keeps its first N - N % 8 rows in groups and the rest as stored, after
// them: row n < N - N % 8 is row n % 8 of the group at (n / 8) * 8 * row_bytes; a later row
// is at n * row_bytes, where it was.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernel.h"
#include "types.h"

namespace {

constexpr int kGroup = 8;  // rows per group

template <int T>
struct Packed32 {
    static constexpr bool has_min = T == Q4_1 || T == Q5_1;
    static constexpr bool has_qh = T == Q5_0 || T == Q5_1;
    static constexpr int m = 16, qh = m + (has_min ? 16 : 0), qs = qh + (has_qh ? 32 : 0);  // offsets in a group block
    // and in a block as stored
    static constexpr int row_m = 2, row_qh = has_min ? 4 : 2, row_qs = row_qh + (has_qh ? 4 : 0);
    static constexpr int group_bytes = kGroup * int(block_bytes(T));
};

// Block b of 8 rows (blocks[j]: row j's block as stored) into its group block.
template <int T>
void pack32(const uint8_t* const* blocks, uint8_t* out) {
    using L = Packed32<T>;
    for (int j = 0; j < kGroup; j++) {
        std::memcpy(out + 2 * j, blocks[j], 2);
        if constexpr (L::has_min) std::memcpy(out + L::m + 2 * j, blocks[j] + L::row_m, 2);
    }
    if constexpr (L::has_qh) {
        uint32_t words[8] = {};
        for (int j = 0; j < kGroup; j++) {
            const uint32_t h = rd32(blocks[j] + L::row_qh);
            for (int c = 0; c < 4; c++)
                for (int t = 0; t < 4; t++) {
                    words[c] |= ((h >> (4 * c + t)) & 1u) << (4 * j + t);
                    words[4 + c] |= ((h >> (16 + 4 * c + t)) & 1u) << (4 * j + t);
                }
        }
        std::memcpy(out + L::qh, words, 32);
    }
    constexpr int vectors = T == Q8_0 ? 8 : 4;
    for (int c = 0; c < vectors; c++)
        for (int j = 0; j < kGroup; j++) std::memcpy(out + L::qs + 32 * c + 4 * j, blocks[j] + L::row_qs + 4 * c, 4);
}

// Row j's block as stored, out of a group block (pack32 undone).
template <int T>
void unpack32(const uint8_t* g, int j, uint8_t* out) {
    using L = Packed32<T>;
    std::memcpy(out, g + 2 * j, 2);
    if constexpr (L::has_min) std::memcpy(out + L::row_m, g + L::m + 2 * j, 2);
    if constexpr (L::has_qh) {
        uint32_t h = 0;
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 4; t++) {
                h |= ((rd32(g + L::qh + 4 * c) >> (4 * j + t)) & 1u) << (4 * c + t);
                h |= ((rd32(g + L::qh + 16 + 4 * c) >> (4 * j + t)) & 1u) << (16 + 4 * c + t);
            }
        std::memcpy(out + L::row_qh, &h, 4);
    }
    constexpr int vectors = T == Q8_0 ? 8 : 4;
    for (int c = 0; c < vectors; c++) std::memcpy(out + L::row_qs + 4 * c, g + L::qs + 32 * c + 4 * j, 4);
}

// Where a K-quant's parts lie: in a block as stored (row_*) and in a group block.
template <int T>
struct PackedK {
    static constexpr int group_bytes = kGroup * int(block_bytes(T));
    // Q4_K, Q5_K: as stored [d][dmin][scales 12]([qh 32])[qs 128]; grouped [d x8][dmin x8][scales 96]([qh 256])[qs 1024]
    static constexpr int row_qh = 16, row_qs = T == Q5_K ? 48 : 16;
    static constexpr int sc = 32, qh = 128, qs = T == Q5_K ? 384 : 128;
    // Q6_K: as stored [ql 128][qh 64][scales 16][d]; grouped [values 1536][scales 128][d x8]
    static constexpr int q6_sc = 1536, q6_d = 1664;
};

// Q6_K's 256 6-bit values of a block as stored (ql, then qh): value 128h + 32t + l (h < 2,
// t < 4, l < 32) is (ql[64h + 32(t & 1) + l] >> 4(t >> 1)) & 15 | ((qh[32h + l] >> 2t) & 3) << 4.
inline void q6_values(const uint8_t* b, uint8_t* q) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++)
                q[128 * h + 32 * t + l] = uint8_t(((ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15) |
                                                  (((qh[32 * h + l] >> (2 * t)) & 3) << 4));
}
// ... and back into ql, qh.
inline void q6_store_values(const uint8_t* q, uint8_t* b) {
    std::memset(b, 0, 192);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++) {
                const uint8_t v = q[128 * h + 32 * t + l];
                b[64 * h + 32 * (t & 1) + l] |= uint8_t((v & 15) << (4 * (t >> 1)));
                b[128 + 32 * h + l] |= uint8_t((v >> 4) << (2 * t));
            }
}
// The byte offset in a group block of the grouped values' vector (h, v, c).
constexpr int q6_vector(int h, int v, int c) { return 32 * (3 * (8 * h + v) + c); }
// Byte 4j + k of vector (h, v, c), from row j's 256 values q ...
inline uint8_t q6_group_byte(const uint8_t* q, int h, int v, int c, int k) {
    const int i = 128 * h + 4 * v + k;
    return uint8_t(q[i + 32 * c] | ((q[i + 96] >> (2 * c)) & 3) << 6);
}
// ... and back: that byte's share of row j's values (q zeroed first: the fourth value's bits
// come from three bytes).
inline void q6_ungroup_byte(uint8_t byte, int h, int v, int c, int k, uint8_t* q) {
    const int i = 128 * h + 4 * v + k;
    q[i + 32 * c] = byte & 63;
    q[i + 96] |= uint8_t((byte >> 6) << (2 * c));
}

// Row j's bytes [from, from + 4 * vectors) as `vectors` vectors of 4 bytes per row, at out.
inline void interleave4(const uint8_t* const* rows, int from, int vectors, uint8_t* out) {
    for (int v = 0; v < vectors; v++)
        for (int j = 0; j < kGroup; j++) std::memcpy(out + 32 * v + 4 * j, rows[j] + from + 4 * v, 4);
}
inline void deinterleave4(const uint8_t* in, int j, int vectors, uint8_t* row, int from) {
    for (int v = 0; v < vectors; v++) std::memcpy(row + from + 4 * v, in + 32 * v + 4 * j, 4);
}

template <int T>
void packk(const uint8_t* const* blocks, uint8_t* out) {
    using L = PackedK<T>;
    if constexpr (T == Q6_K) {
        for (int j = 0; j < kGroup; j++) {
            uint8_t q[256];
            q6_values(blocks[j], q);
            for (int h = 0; h < 2; h++)
                for (int v = 0; v < 8; v++)
                    for (int c = 0; c < 3; c++)
                        for (int k = 0; k < 4; k++) out[q6_vector(h, v, c) + 4 * j + k] = q6_group_byte(q, h, v, c, k);
        }
        interleave4(blocks, 192, 4, out + L::q6_sc);
        for (int j = 0; j < kGroup; j++) std::memcpy(out + L::q6_d + 2 * j, blocks[j] + 208, 2);
    } else {
        for (int j = 0; j < kGroup; j++) {
            std::memcpy(out + 2 * j, blocks[j], 2);
            std::memcpy(out + 16 + 2 * j, blocks[j] + 2, 2);
        }
        interleave4(blocks, 4, 3, out + L::sc);
        if constexpr (T == Q5_K) interleave4(blocks, L::row_qh, 8, out + L::qh);
        interleave4(blocks, L::row_qs, 32, out + L::qs);
    }
}

template <int T>
void unpackk(const uint8_t* g, int j, uint8_t* out) {
    using L = PackedK<T>;
    if constexpr (T == Q6_K) {
        uint8_t q[256] = {};
        for (int h = 0; h < 2; h++)
            for (int v = 0; v < 8; v++)
                for (int c = 0; c < 3; c++)
                    for (int k = 0; k < 4; k++) q6_ungroup_byte(g[q6_vector(h, v, c) + 4 * j + k], h, v, c, k, q);
        q6_store_values(q, out);
        deinterleave4(g + L::q6_sc, j, 4, out, 192);
        std::memcpy(out + 208, g + L::q6_d + 2 * j, 2);
    } else {
        std::memcpy(out, g + 2 * j, 2);
        std::memcpy(out + 2, g + 16 + 2 * j, 2);
        deinterleave4(g + L::sc, j, 3, out, 4);
        if constexpr (T == Q5_K) deinterleave4(g + L::qh, j, 8, out, L::row_qh);
        deinterleave4(g + L::qs, j, 32, out, L::row_qs);
    }
}

template <int T>
void pack_block(const uint8_t* const* blocks, uint8_t* out) {
    if constexpr (block_values(T) == 32) pack32<T>(blocks, out);
    else packk<T>(blocks, out);
}

template <int T>
void unpack_block(const uint8_t* g, int j, uint8_t* out) {
    if constexpr (block_values(T) == 32) unpack32<T>(g, j, out);
    else unpackk<T>(g, j, out);
}

// Row n's block b as stored, from a weight in the repacked layout (rows_in_groups: N - N % 8).
template <int T>
void stored_block(const uint8_t* w, int64_t rb, int64_t rows_in_groups, int64_t n, int64_t b, uint8_t* out) {
    if (n >= rows_in_groups) {
        std::memcpy(out, w + n * rb + b * block_bytes(T), block_bytes(T));
        return;
    }
    unpack_block<T>(w + (n / kGroup) * kGroup * rb + b * kGroup * block_bytes(T), int(n % kGroup), out);
}

// src (N rows as stored) into dst in the repacked layout (unpack: the other way).
template <int T>
void repack_rows(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb, bool unpack) {
    constexpr int64_t size = block_bytes(T);
    const int64_t rb = nb * size, grouped = N - N % kGroup;
    for (int64_t g = 0; g < grouped; g += kGroup)
        for (int64_t b = 0; b < nb; b++) {
            if (unpack) {
                for (int j = 0; j < kGroup; j++) unpack_block<T>(src + g * rb + b * kGroup * size, j, dst + (g + j) * rb + b * size);
            } else {
                const uint8_t* blocks[kGroup];
                for (int j = 0; j < kGroup; j++) blocks[j] = src + (g + j) * rb + b * size;
                pack_block<T>(blocks, dst + g * rb + b * kGroup * size);
            }
        }
    std::memcpy(dst + grouped * rb, src + grouped * rb, (N - grouped) * rb);
}

}  // namespace
