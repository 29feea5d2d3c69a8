// Memory that a later step of the decoder stack will read, prefetched a line at a time from
// inside the block GEMM's weight-streaming loops. At decode batch sizes past one the GEMMs are
// bound by their integer multiply-adds and leave the memory bus part idle, while attention,
// which follows them, waits on its keys and values from DRAM. So while a layer's projections
// run, each thread prefetches the next layer's KV rows that its own attention items will read
// (decoder_stack.cpp sets the ranges, paged_attention.cpp says which). Per thread; empty, it
// does nothing. Only where data sits changes, never a value.
#pragma once
#include <cstdint>
#include <vector>

namespace nanoinfer {

struct SidePrefetch {
    std::vector<const char*> start;
    std::vector<int64_t> bytes;
    size_t next = 0;
    int64_t off = 0;

    void clear() { start.clear(), bytes.clear(), next = 0, off = 0; }
    void add(const void* p, int64_t n) {
        if (n > 0) start.push_back(static_cast<const char*>(p)), bytes.push_back(n);
    }
    bool pending() const { return next < start.size(); }
    // The next `lines` cache lines of the ranges, into L2 (not L1: the GEMM's weights live there).
    void step(int lines) {
        for (; lines > 0 && next < start.size(); lines--) {
            __builtin_prefetch(start[next] + off, 0, 2);
            if ((off += 64) >= bytes[next]) next++, off = 0;
        }
    }
};

// The calling thread's ranges.
inline SidePrefetch& side_prefetch() {
    static thread_local SidePrefetch side;
    return side;
}

}  // namespace nanoinfer
