// The BLAKE3 kernels of cudarecv/kernels/blake3.cu run on the host: a launch runs its blocks in
// turn, and within blake3_blocks every thread of a block in turn between two syncs (the launches
// of cudarecv.cuda.digest replayed in the same order). Built by tests/test_digest.py with the
// system C++ compiler.
#include <cstring>
#include <utility>
#include <vector>

struct Index { unsigned long long x; };
static Index blockIdx, blockDim = {1}, threadIdx = {0};
#define __global__
#define __device__
#define __forceinline__ inline
#define BLAKE3_EACH_THREAD(tid) for (unsigned tid = 0; tid < BLAKE3_THREADS; ++tid)
#define BLAKE3_SYNC()
#define BLAKE3_SHARED static
#include "blake3.cu"

// One launch of blake3_blocks (`blocks` blocks) and of blake3_parents (`threads` threads): what a
// fake cupy replays for cudarecv.cuda.digest's own launches in tests/test_digest.py.
extern "C" void launch_blocks(u64 blocks, const u8 *data, u64 n, u64 chunks, u64 per, u32 *cvs,
                              u32 *root) {
    for (u64 b = 0; b < blocks; ++b) {
        blockIdx.x = b;
        blake3_blocks(data, n, chunks, per, cvs, root);
    }
}

extern "C" void launch_parents(u64 threads, const u32 *in, u64 count, u32 *out, u32 *root) {
    for (u64 t = 0; t < threads; ++t) {
        blockIdx.x = t;
        blake3_parents(in, count, out, root);
    }
}

// The digest of `n` bytes as cudarecv.cuda.digest plans it: runs of `per` chunks, `per` the least
// power of two that leaves at most `max_runs` runs.
extern "C" void blake3_host(const u8 *data, u64 n, u64 max_runs, u8 digest[16]) {
    u64 chunks = n ? (n + BLAKE3_CHUNK - 1) / BLAKE3_CHUNK : 1;
    u64 per = 1;
    while ((chunks + per - 1) / per > max_runs) per *= 2;
    u64 runs = (chunks + per - 1) / per;
    u64 blocks = (runs + BLAKE3_THREADS - 1) / BLAKE3_THREADS;
    std::vector<u32> level(8 * blocks), next(8 * ((blocks + 1) / 2));
    u32 root[4] = {0, 0, 0, 0};
    launch_blocks(blocks, data, n, chunks, per, level.data(), root);
    for (u64 count = blocks; count > 1; count = (count + 1) / 2) {
        launch_parents((count + 1) / 2, level.data(), count, next.data(), root);
        std::swap(level, next);
    }
    std::memcpy(digest, root, 16);
}
