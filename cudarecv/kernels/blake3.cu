// BLAKE3 (the plain hash, no key) of a byte buffer on the GPU, where the bytes are.
//
// BLAKE3 is a tree: the input is cut into 1024-byte chunks, each chunk is
// hashed on its own into a chaining value (CV), and CVs are merged pairwise by
// parent nodes up to the root. Merging level by level, an odd last CV carried up
// unchanged, gives exactly BLAKE3's left-balanced tree.
//
//   blake3_chunks  one thread per chunk: the chunk's CV (or, for a single
//                  chunk, the root output)
//   blake3_parents one thread per pair: the next level's CVs (the root output
//                  once two CVs are left)
//
// The root output's first 16 bytes are the digest (BLAKE3's output is a prefix
// stream: any length is a prefix of the longer ones). The same source builds on
// the host as C++ (tests/blake3_host.cpp), so the kernels' logic is checked
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

// cvs[8 * c ...] = the CV of chunk c; with `chunks == 1`, root[0..3] = the digest words.
extern "C" __global__ void blake3_chunks(const u8 *data, u64 n, u64 chunks, u32 *cvs, u32 *root) {
    u64 c = BLAKE3_THREAD;
    if (c >= chunks) return;
    u64 start = c * BLAKE3_CHUNK;
    u64 end = start + BLAKE3_CHUNK < n ? start + BLAKE3_CHUNK : n;
    int blocks = end > start ? (int)((end - start + BLAKE3_BLOCK - 1) / BLAKE3_BLOCK) : 1;
    u32 cv[8], block[16], out[16];
    for (int i = 0; i < 8; ++i) cv[i] = iv(i);
    for (int b = 0; b < blocks; ++b) {
        u32 len = load_block(data, end, start + (u64)b * BLAKE3_BLOCK, block);
        u32 flags = (b == 0 ? CHUNK_START : 0u) | (b == blocks - 1 ? CHUNK_END : 0u);
        if (b == blocks - 1 && chunks == 1) flags |= ROOT;
        compress(cv, block, c, len, flags, out);
        for (int i = 0; i < 8; ++i) cv[i] = out[i];
    }
    if (chunks == 1) {
        for (int i = 0; i < 4; ++i) root[i] = out[i];
        return;
    }
    for (int i = 0; i < 8; ++i) cvs[8 * c + i] = cv[i];
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
