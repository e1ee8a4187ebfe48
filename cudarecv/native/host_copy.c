/* Host memory copies of the same-host transport (cudarecv.core.host_copy loads this with ctypes).
 *
 * With streaming on (cudarecv_copy_streaming(1), which _host_copy chooses where it
 * measures faster), a large copy streams its stores past the caches
 * (non-temporal stores), four pages at a time as glibc does for copies larger
 * than its threshold: at about 1 MiB a piece, glibc's memcpy keeps ordinary
 * stores, which on some machines read every line they write and, with two
 * processes copying at once (a sender filling a segment, a receiver emptying
 * one), share the memory bus at half the speed. On others glibc is faster at
 * every size. A streamed copy ends with a store fence, so a later store (a
 * version stamp, a READY message) is never seen before the bytes.
 *
 * A progress word in a segment says how many of a transfer's bytes are in it:
 * the writer publishes it (a release store) after the bytes it counts, the reader
 * observes it (an acquire load) before it reads them.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PAGE 4096
#define LINE 64
/* below this a copy takes ordinary stores: its bytes stay in the caches for whoever reads them next */
#define STREAM_MIN (256 * 1024)

#if defined(__x86_64__)
/* d aligned to LINE; copies the largest multiple of 4 * PAGE of n bytes, returns it */
__attribute__((target("avx2"))) static size_t stream_avx2(char *d, const char *s, size_t n) {
    size_t done = 0;
    for (; n - done >= 4 * PAGE; done += 4 * PAGE)
        for (size_t off = 0; off < PAGE; off += LINE)
            for (int p = 0; p < 4; p++) {
                const char *from = s + done + p * PAGE + off;
                char *to = d + done + p * PAGE + off;
                __builtin_prefetch(from + 4 * LINE);
                __m256i a = _mm256_loadu_si256((const __m256i *)from);
                __m256i b = _mm256_loadu_si256((const __m256i *)(from + 32));
                _mm256_stream_si256((__m256i *)to, a);
                _mm256_stream_si256((__m256i *)(to + 32), b);
            }
    return done;
}

static int avx2 = -1;
#endif
static int streaming = 0;

/* stream large copies (1) or leave every copy to glibc (0); returns whether streaming is on (AVX2 only) */
int cudarecv_copy_streaming(int on) {
#if defined(__x86_64__)
    if (avx2 < 0)
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    streaming = on && avx2;
#else
    streaming = 0;
#endif
    return streaming;
}

/* memcpy(dst, src, n) for buffers that do not overlap */
void cudarecv_copy(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
    if (n >= STREAM_MIN && streaming) { /* (set only with AVX2) */
        char *d = dst;
        const char *s = src;
        size_t head = (LINE - ((uintptr_t)d & (LINE - 1))) & (LINE - 1);
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        size_t done = stream_avx2(d, s, n);
        memcpy(d + done, s + done, n - done);
        _mm_sfence();
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* count copies, each three words of table: destination, source, length */
void cudarecv_copy_many(const uint64_t *table, size_t count) {
    for (size_t i = 0; i < count; i++)
        cudarecv_copy((void *)(uintptr_t)table[3 * i], (const void *)(uintptr_t)table[3 * i + 1],
                      (size_t)table[3 * i + 2]);
}

/* the writer's store of a progress word, after the bytes it counts (release: ordered after them) */
void cudarecv_publish(uint64_t *word, uint64_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

/* a wake word moved by one (a futex's word, which two threads may move at once: none of their moves is lost),
   ordered after every store before it and before every load after it (a full barrier) */
uint64_t cudarecv_bump(uint64_t *word) {
    return __atomic_add_fetch(word, 1, __ATOMIC_SEQ_CST);
}

/* the reader's load of a progress word, before the bytes it counts (acquire: ordered before them) */
uint64_t cudarecv_observe(const uint64_t *word) {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

/* replace the word with `desired` if it holds `expected`; the value it held (== expected: replaced), as a full
   barrier either way: two ends that each store one word and then read the other's (a store, then a read, both
   by this call) never both miss the other's store */
uint64_t cudarecv_swap_if(uint64_t *word, uint64_t expected, uint64_t desired) {
    __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
