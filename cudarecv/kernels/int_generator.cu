// tensordict.utils._int_generator on the GPU, one thread per seed.
//
//   int.from_bytes(np.random.default_rng(seed).bytes(8), "big") % 10000
//
// = numpy SeedSequence(seed) -> generate_state(4, uint64) -> PCG64 seeding
// (pcg64_set_seed / srandom) -> one XSL-RR 64-bit draw, byte-swapped, mod 10000.
// Seeds are < 2**32 (one entropy word), which covers the tag map domain 0..10000.
// 128-bit arithmetic uses two 64-bit limbs (no __int128 needed).

typedef unsigned int u32;
typedef unsigned long long u64;

#define INIT_A 0x43b0d7e5u
#define MULT_A 0x931e8875u
#define INIT_B 0x8b51f9ddu
#define MULT_B 0x58f38dedu
#define MIX_MULT_L 0xca01f9ddu
#define MIX_MULT_R 0x4973f715u
#define XSHIFT 16
#define MAX_TAG 10000ull
// PCG_DEFAULT_MULTIPLIER_128
#define PCG_MULT_HI 2549297995355413924ull
#define PCG_MULT_LO 4865540595714422341ull

__device__ __forceinline__ u32 hashmix(u32 value, u32 *hash_const) {
    value ^= *hash_const;
    *hash_const *= MULT_A;
    value *= *hash_const;
    value ^= value >> XSHIFT;
    return value;
}

__device__ __forceinline__ u32 mix(u32 x, u32 y) {
    u32 result = MIX_MULT_L * x - MIX_MULT_R * y;
    result ^= result >> XSHIFT;
    return result;
}

// (hi, lo) = (hi, lo) * PCG_MULT + (inc_hi, inc_lo)  mod 2**128
__device__ __forceinline__ void pcg_step(u64 *hi, u64 *lo, u64 inc_hi, u64 inc_lo) {
    u64 l = *lo, h = *hi;
    u64 new_lo = l * PCG_MULT_LO;
    u64 new_hi = __umul64hi(l, PCG_MULT_LO) + l * PCG_MULT_HI + h * PCG_MULT_LO;
    u64 sum_lo = new_lo + inc_lo;
    new_hi += inc_hi + (sum_lo < new_lo ? 1ull : 0ull);
    *lo = sum_lo;
    *hi = new_hi;
}

__device__ __forceinline__ u64 bswap64(u64 x) {
    u32 a = (u32)x, b = (u32)(x >> 32);
    return ((u64)__byte_perm(a, 0, 0x0123) << 32) | (u64)__byte_perm(b, 0, 0x0123);
}

__device__ __forceinline__ long long int_generator(u32 seed) {
    // SeedSequence.mix_entropy, entropy = [seed], pool of 4 words.
    u32 hash_const = INIT_A;
    u32 pool[4];
    pool[0] = hashmix(seed, &hash_const);
#pragma unroll
    for (int i = 1; i < 4; ++i) pool[i] = hashmix(0u, &hash_const);
#pragma unroll
    for (int i_src = 0; i_src < 4; ++i_src) {
#pragma unroll
        for (int i_dst = 0; i_dst < 4; ++i_dst) {
            if (i_src != i_dst) pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src], &hash_const));
        }
    }
    // SeedSequence.generate_state(4, uint64): 8 words cycling over the pool.
    u32 st[8];
    u32 hb = INIT_B;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 v = pool[i & 3];
        v ^= hb;
        hb *= MULT_B;
        v *= hb;
        v ^= v >> XSHIFT;
        st[i] = v;
    }
    u64 w0 = (u64)st[0] | ((u64)st[1] << 32);
    u64 w1 = (u64)st[2] | ((u64)st[3] << 32);
    u64 w2 = (u64)st[4] | ((u64)st[5] << 32);
    u64 w3 = (u64)st[6] | ((u64)st[7] << 32);
    // pcg64_set_seed: initstate = w0 << 64 | w1, initseq = w2 << 64 | w3.
    // srandom: inc = initseq << 1 | 1; state = 0; step; state += initstate; step.
    u64 inc_hi = (w2 << 1) | (w3 >> 63);
    u64 inc_lo = (w3 << 1) | 1ull;
    u64 lo = inc_lo + w1;
    u64 hi = inc_hi + w0 + (lo < inc_lo ? 1ull : 0ull);
    pcg_step(&hi, &lo, inc_hi, inc_lo);
    // Generator.bytes(8): one 64-bit draw (step, then XSL-RR), little-endian bytes.
    pcg_step(&hi, &lo, inc_hi, inc_lo);
    u64 x = hi ^ lo;
    unsigned rot = (unsigned)(hi >> 58);
    u64 out = (x >> rot) | (x << ((64u - rot) & 63u));
    // int.from_bytes(..., "big") reads those bytes big-endian.
    return (long long)(bswap64(out) % MAX_TAG);
}

// out[i] = _int_generator(seeds[i]) for i < n.
extern "C" __global__ void int_generator_seeds(const u32 *__restrict__ seeds, long long *__restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = int_generator(seeds[i]);
}

// out[i] = _int_generator(first + i) for i < n (the tag map: first = 0, n = 10001).
extern "C" __global__ void int_generator_range(u32 first, long long *__restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = int_generator(first + (u32)i);
}
