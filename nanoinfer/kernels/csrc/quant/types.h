// The records of types.def read as C++: the type ids, each type's block size, bytes and
// activation format, and the checks a record must pass to compile. Nothing per type is written
// here: every function below is generated from the table.
#pragma once
#include <cstdint>

namespace {

// GGML's type ids, one enumerator per record: F16 = 1, Q4_0 = 2, ...
enum : int {
#define QUANT_TYPE(name, ggml, ...) name = ggml,
#include "types.def"
#undef QUANT_TYPE
};

// The activations' formats (types.def's `acts`).
enum class ActsFormat : int { f32, q8_0, q8_1, q8_K32, q8_K16 };

// Values per block of quantised activations (1: fp32, each value as it is).
constexpr int64_t acts_block(ActsFormat f) {
    return f == ActsFormat::q8_0 || f == ActsFormat::q8_1 ? 32 : f == ActsFormat::q8_K32 || f == ActsFormat::q8_K16 ? 256 : 1;
}

// Values per block of type t; 0 for an id without a record.
constexpr int64_t block_values(int t) {
    switch (t) {
#define QUANT_TYPE(name, ggml, values, ...) case name: return values;
#include "types.def"
#undef QUANT_TYPE
        default: return 0;
    }
}

// Bytes per block of type t; 0 for an id without a record (no kernel).
constexpr int64_t block_bytes(int t) {
    switch (t) {
#define QUANT_TYPE(name, ggml, values, bytes, ...) case name: return bytes;
#include "types.def"
#undef QUANT_TYPE
        default: return 0;
    }
}

// The activation format type t takes (f32 for an id without a record).
constexpr ActsFormat acts_of(int t) {
    switch (t) {
#define QUANT_TYPE(name, ggml, values, bytes, acts, ...) case name: return ActsFormat::acts;
#include "types.def"
#undef QUANT_TYPE
        default: return ActsFormat::f32;
    }
}

// Rows per interleaved group of type t's repacked layout (1: rows as stored).
constexpr int64_t interleave_of(int t) {
    switch (t) {
#define QUANT_TYPE(name, ggml, values, bytes, acts, interleave, ...) case name: return interleave;
#include "types.def"
#undef QUANT_TYPE
        default: return 1;
    }
}

// A record's sizes: the kernels index a row's activations by weight block, so a block of
// quantised activations is exactly as long as the weight's block.
#define QUANT_TYPE(name, ggml, values, bytes, acts, interleave, ...)                                   \
    static_assert(values > 0 && bytes > 0, #name ": a block has values and bytes");                  \
    static_assert(interleave == 1 || (interleave == 8 && values > 1),                                 \
                  #name ": the repacked layout (quant/packed.h) is 8 rows of a block type");          \
    static_assert(ActsFormat::acts == ActsFormat::f32 || acts_block(ActsFormat::acts) == values,     \
                  #name ": q8_0 and q8_1 activations come in blocks of 32 values, q8_K in 256");
#include "types.def"
#undef QUANT_TYPE

}  // namespace
