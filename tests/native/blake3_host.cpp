// The BLAKE3 kernels of cudarecv/kernels/blake3.cu run on the host: each "thread" is one
// call, the launches of cudarecv.cuda.digest replayed in the same order. Built by
// tests/test_digest.py with the system C++ compiler.
#include <cstring>
#include <utility>
#include <vector>

struct Index { unsigned long long x; };
static Index blockIdx, blockDim = {1}, threadIdx = {0};
#define __global__
#define __device__
#define __forceinline__ inline
#include "blake3.cu"

extern "C" void blake3_host(const u8 *data, u64 n, u8 digest[16]) {
    u64 chunks = n ? (n + BLAKE3_CHUNK - 1) / BLAKE3_CHUNK : 1;
    std::vector<u32> level(8 * chunks), next(8 * ((chunks + 1) / 2));
    u32 root[4] = {0, 0, 0, 0};
    for (u64 c = 0; c < chunks; ++c) {
        blockIdx.x = c;
        blake3_chunks(data, n, chunks, level.data(), root);
    }
    for (u64 count = chunks; count > 1; count = (count + 1) / 2) {
        for (u64 p = 0; p < (count + 1) / 2; ++p) {
            blockIdx.x = p;
            blake3_parents(level.data(), count, next.data(), root);
        }
        std::swap(level, next);
    }
    std::memcpy(digest, root, 16);
}
