// BLAKE3 (the plain hash, no key) of a byte buffer on the GPU, where the bytes are.
//
// BLAKE3 is a tree: the input is cut into 1024-byte chunks, each chunk is
// hashed on its own into a chaining value (CV), and CVs are merged pairwise by
// parent nodes up to the root. Merging level by level, an odd last CV carried up
// unchanged, gives exactly BLAKE3's left-balanced tree.
//
//   blake3_blocks  one thread per run of `per` consecutive chunks (`per` a
//                  power of two: one chunk, but for inputs of more than
//                  MAX_RUNS chunks), its CV merged as BLAKE3's own hasher does
//                  (a stack of CVs); then a block's 128 runs merged level by
//                  level in shared memory: one CV per block (the root output
//                  for an input of one block)
//   blake3_parents one thread per pair: the next level's CVs (the root output
//                  once two CVs are left)
//
// A block covers an aligned run of 128 * per chunks (a power of two): whole, a
// complete subtree of BLAKE3's tree; the last, shorter one, the tree of its own
// chunks. So the blocks' CVs merged level by level give the same root as the
// chunks' CVs would, and only one CV per block (32 bytes per 128 runs) is kept
// between launches.
//
// The root output's first 16 bytes are the digest (BLAKE3's output is a prefix
// stream: any length is a prefix of the longer ones). The same source builds on
// the host as C++ (tests/native/blake3_host.cpp), so the kernels' logic is checked
// against the reference implementation without a GPU.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

#define BLAKE3_CHUNK 1024
#define BLAKE3_BLOCK 64
#define CHUNK_START 1u
#define CHUNK_END 2u
#define PARENT 4u
#define ROOT 8u

#ifndef BLAKE3_THREAD
#define BLAKE3_THREAD (blockIdx.x * (u64)blockDim.x + threadIdx.x)
#endif

__device__ __forceinline__ u32 iv(int i) {
    const u32 words[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                          0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};
    return words[i];
}

__device__ __forceinline__ u32 rotr(u32 x, int n) { return (x >> n) | (x << (32 - n)); }

#define G(a, b, c, d, x, y)                 \
    s[a] = s[a] + s[b] + (x);               \
    s[d] = rotr(s[d] ^ s[a], 16);           \
    s[c] = s[c] + s[d];                     \
    s[b] = rotr(s[b] ^ s[c], 12);           \
    s[a] = s[a] + s[b] + (y);               \
    s[d] = rotr(s[d] ^ s[a], 8);            \
    s[c] = s[c] + s[d];                     \
    s[b] = rotr(s[b] ^ s[c], 7);

// The compression function; out[0..7] is the new chaining value, out[0..15] the
// extended output (used for the root only).
__device__ void compress(const u32 cv[8], const u32 block[16], u64 counter, u32 block_len, u32 flags,
                         u32 out[16]) {
    const int perm[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
    u32 s[16], m[16], t[16];
    for (int i = 0; i < 8; ++i) s[i] = cv[i];
    for (int i = 0; i < 4; ++i) s[8 + i] = iv(i);
    s[12] = (u32)counter;
    s[13] = (u32)(counter >> 32);
    s[14] = block_len;
    s[15] = flags;
    for (int i = 0; i < 16; ++i) m[i] = block[i];
    for (int r = 0; r < 7; ++r) {
        G(0, 4, 8, 12, m[0], m[1]);
        G(1, 5, 9, 13, m[2], m[3]);
        G(2, 6, 10, 14, m[4], m[5]);
        G(3, 7, 11, 15, m[6], m[7]);
        G(0, 5, 10, 15, m[8], m[9]);
        G(1, 6, 11, 12, m[10], m[11]);
        G(2, 7, 8, 13, m[12], m[13]);
        G(3, 4, 9, 14, m[14], m[15]);
        for (int i = 0; i < 16; ++i) t[i] = m[perm[i]];
        for (int i = 0; i < 16; ++i) m[i] = t[i];
    }
    for (int i = 0; i < 8; ++i) {
        out[i] = s[i] ^ s[i + 8];
        out[i + 8] = s[i + 8] ^ cv[i];
    }
}

// Block `b` of the input at `data` (length `n` bytes) as 16 little-endian words,
// zero-padded; returns its length in bytes.
__device__ u32 load_block(const u8 *data, u64 n, u64 start, u32 words[16]) {
    u64 left = n > start ? n - start : 0;
    u32 len = left < BLAKE3_BLOCK ? (u32)left : BLAKE3_BLOCK;
    if (len == BLAKE3_BLOCK && ((unsigned long long)(data + start) & 3) == 0) {
        const u32 *w = (const u32 *)(data + start);  // little-endian, as every CUDA GPU
        for (int i = 0; i < 16; ++i) words[i] = w[i];
        return len;
    }
    for (int i = 0; i < 16; ++i) words[i] = 0;
    for (u32 i = 0; i < len; ++i) words[i / 4] |= (u32)data[start + i] << (8 * (i % 4));
    return len;
}

#define BLAKE3_MAX_DEPTH 40  // CVs on a thread's stack: runs of up to 2**39 chunks

// The output of chunk `c` of the input at `data` (length `n` bytes): out[0..7] its CV (the root output's words
// with `root`).
__device__ void chunk_output(const u8 *data, u64 n, u64 c, bool root, u32 out[16]) {
    u64 start = c * BLAKE3_CHUNK;
    u64 end = start + BLAKE3_CHUNK < n ? start + BLAKE3_CHUNK : n;
    int blocks = end > start ? (int)((end - start + BLAKE3_BLOCK - 1) / BLAKE3_BLOCK) : 1;
    u32 cv[8], block[16];
    for (int i = 0; i < 8; ++i) cv[i] = iv(i);
    for (int b = 0; b < blocks; ++b) {
        u32 len = load_block(data, end, start + (u64)b * BLAKE3_BLOCK, block);
        u32 flags = (b == 0 ? CHUNK_START : 0u) | (b == blocks - 1 ? CHUNK_END : 0u);
        if (b == blocks - 1 && root) flags |= ROOT;
        compress(cv, block, c, len, flags, out);
        for (int i = 0; i < 8; ++i) cv[i] = out[i];
    }
}

// The output of a parent node over CVs `left` and `right` (out[0..7]: its CV).
__device__ void parent_output(const u32 left[8], const u32 right[8], bool root, u32 out[16]) {
    u32 key[8], block[16];
    for (int i = 0; i < 8; ++i) key[i] = iv(i);
    for (int i = 0; i < 8; ++i) block[i] = left[i];
    for (int i = 0; i < 8; ++i) block[8 + i] = right[i];
    compress(key, block, 0, BLAKE3_BLOCK, root ? PARENT | ROOT : PARENT, out);
}

#define BLAKE3_THREADS 128  // threads per block: the launches' block size (cudarecv.cuda.digest)

// Where a block's threads take turns: on the device each thread runs the body once, as itself, and
// BLAKE3_SYNC() is __syncthreads(); the host build (tests/native/blake3_host.cpp) runs the body for
// every thread of the block in turn, which is the same between two syncs.
#ifndef BLAKE3_EACH_THREAD
#define BLAKE3_EACH_THREAD(tid) for (unsigned tid = threadIdx.x, once = 1; once; once = 0)
#define BLAKE3_SYNC() __syncthreads()
#define BLAKE3_SHARED __shared__
#endif

// The output of run `r`: chunks r * per .. min((r + 1) * per, chunks) - 1, merged with a stack as
// BLAKE3's hasher merges them (out[0..7]: the run's CV; with `root`, the root output's words).
__device__ void run_output(const u8 *data, u64 n, u64 chunks, u64 per, u64 r, bool root,
                           u32 out[16]) {
    u64 first = r * per;
    u64 last = first + per < chunks ? first + per : chunks;  // one past
    u32 stack[BLAKE3_MAX_DEPTH][8];
    int depth = 0;
    for (u64 c = first; c + 1 < last; ++c) {  // every chunk but the last: merged once a subtree is full
        chunk_output(data, n, c, false, out);
        for (u64 done = c - first + 1; (done & 1) == 0; done >>= 1) {
            --depth;
            parent_output(stack[depth], out, false, out);
        }
        for (int i = 0; i < 8; ++i) stack[depth][i] = out[i];
        ++depth;
    }
    chunk_output(data, n, last - 1, root && depth == 0, out);  // the last, then up the stack
    while (depth > 0) {
        --depth;
        parent_output(stack[depth], out, root && depth == 0, out);
    }
}

// cvs[8 * b ...] = the CV of block b: runs 128 b .. 128 b + 127 (fewer for the last block) of `per`
// chunks each; with a single block (`runs <= 128`), root[0..3] = the digest words instead. Launched
// with ceil(runs / 128) blocks of 128 threads.
extern "C" __global__ void blake3_blocks(const u8 *data, u64 n, u64 chunks, u64 per, u32 *cvs,
                                         u32 *root) {
    BLAKE3_SHARED u32 level[BLAKE3_THREADS][8];
    BLAKE3_SHARED u32 next[BLAKE3_THREADS][8];
    u64 runs = (chunks + per - 1) / per;
    u64 first = (u64)blockIdx.x * BLAKE3_THREADS;
    u64 count = runs - first < BLAKE3_THREADS ? runs - first : BLAKE3_THREADS;
    bool whole = runs <= BLAKE3_THREADS;  // one block: the top of its tree is the root
    BLAKE3_EACH_THREAD(tid) {
        if (tid < count) {
            u32 out[16];
            run_output(data, n, chunks, per, first + tid, whole && count == 1, out);
            for (int i = 0; i < 8; ++i) level[tid][i] = out[i];
        }
    }
    BLAKE3_SYNC();
    for (u64 c = count; c > 1; c = (c + 1) / 2) {  // level by level; an odd last CV goes up as it is
        BLAKE3_EACH_THREAD(tid) {
            if (tid < c / 2) {
                u32 out[16];
                parent_output(level[2 * tid], level[2 * tid + 1], whole && c == 2, out);
                for (int i = 0; i < 8; ++i) next[tid][i] = out[i];
            } else if (tid == c / 2 && c % 2 == 1) {
                for (int i = 0; i < 8; ++i) next[tid][i] = level[c - 1][i];
            }
        }
        BLAKE3_SYNC();
        BLAKE3_EACH_THREAD(tid) {
            if (tid < (c + 1) / 2) {
                for (int i = 0; i < 8; ++i) level[tid][i] = next[tid][i];
            }
        }
        BLAKE3_SYNC();
    }
    BLAKE3_EACH_THREAD(tid) {
        if (tid == 0) {
            u32 *to = whole ? root : cvs + 8 * (u64)blockIdx.x;
            for (int i = 0; i < (whole ? 4 : 8); ++i) to[i] = level[0][i];
        }
    }
}

// One level of the tree: `count` CVs in `in` become ceil(count / 2) in `out`; with
// `count == 2`, root[0..3] = the digest words.
extern "C" __global__ void blake3_parents(const u32 *in, u64 count, u32 *out, u32 *root) {
    u64 p = BLAKE3_THREAD;
    u64 pairs = count / 2;
    if (p > pairs || (p == pairs && count % 2 == 0)) return;
    if (p == pairs) {  // the odd last CV goes up as it is
        for (int i = 0; i < 8; ++i) out[8 * p + i] = in[8 * (2 * p) + i];
        return;
    }
    u32 key[8], block[16], result[16];
    for (int i = 0; i < 8; ++i) key[i] = iv(i);
    for (int i = 0; i < 16; ++i) block[i] = in[16 * p + i];
    compress(key, block, 0, BLAKE3_BLOCK, count == 2 ? PARENT | ROOT : PARENT, result);
    if (count == 2) {
        for (int i = 0; i < 4; ++i) root[i] = result[i];
        return;
    }
    for (int i = 0; i < 8; ++i) out[8 * p + i] = result[i];
}
