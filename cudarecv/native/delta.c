/* Delta pushes' codec on host memory (cudarecv.weights.delta loads this with ctypes; its docstring has the
 * patch's format, and its torch version does the same on any device).
 *
 * Storages are compared as words of 1, 2, 4 or 8 bytes in blocks of block_words words (the last may be short).
 * Kinds: 0 SAME, 1 SPARSE (int32 index in the block + value per changed word), 2 BITMASK (a bit per word, bit i
 * of byte j for word 8j + i, then the changed values), 3 FULL (the block's words).
 *
 * One pass counts each block's changed words (cudarecv_delta_counts); the caller picks the kinds; a second pass
 * writes the sections (cudarecv_delta_gather). cudarecv_delta_check checks a received patch's indices and bits
 * against its counts without writing; cudarecv_delta_apply then writes it.
 */
#include <stdint.h>
#include <string.h>

enum { SAME = 0, SPARSE = 1, BITMASK = 2, FULL = 3 };

#define BLOCK_LEN(k) ((k) == blocks - 1 && words % block_words ? words % block_words : block_words)

/* the number of words in [x, x + n) that differ from y, for one word type */
#define COUNT(T)                                                                                              \
    static int64_t count_##T(const T *x, const T *y, int64_t n) {                                             \
        int64_t c = 0;                                                                                        \
        for (int64_t i = 0; i < n; i++)                                                                       \
            c += x[i] != y[i];                                                                                \
        return c;                                                                                             \
    }
COUNT(uint8_t)
COUNT(uint16_t)
COUNT(uint32_t)
COUNT(uint64_t)

static int64_t count(const char *x, const char *y, int64_t n, int word) {
    if (memcmp(x, y, (size_t)(n * word)) == 0)
        return 0;
    switch (word) {
    case 1: return count_uint8_t((const uint8_t *)x, (const uint8_t *)y, n);
    case 2: return count_uint16_t((const uint16_t *)x, (const uint16_t *)y, n);
    case 4: return count_uint32_t((const uint32_t *)x, (const uint32_t *)y, n);
    default: return count_uint64_t((const uint64_t *)x, (const uint64_t *)y, n);
    }
}

/* counts[k]: the words of block k of new that differ from base, for blocks first..last - 1 */
void cudarecv_delta_counts(const char *new_, const char *base, int64_t words, int word, int64_t block_words,
                           int64_t first, int64_t last, int64_t *counts) {
    int64_t blocks = (words + block_words - 1) / block_words;
    for (int64_t k = first; k < last; k++) {
        int64_t at = k * block_words;
        counts[k] = count(new_ + at * word, base + at * word, BLOCK_LEN(k), word);
    }
}

#define GROUP 16

/* the changed words of one block into the index (SPARSE) or bits (BITMASK) section, and their values; with
 * advance, each changed word is written into the base too (the base then holds the new version) */
#define GATHER(T)                                                                                             \
    static void gather_##T(const T *x, T *y, int64_t n, int sparse, int advance, int32_t **index,             \
                           uint8_t *bits, T **values) {                                                       \
        T *v = *values;                                                                                       \
        int32_t *ix = sparse ? *index : NULL;                                                                 \
        for (int64_t g = 0; g < n; g += GROUP) {                                                              \
            int64_t end = g + GROUP < n ? g + GROUP : n;                                                      \
            T any = 0;                                                                                        \
            for (int64_t i = g; i < end; i++) /* a group of equal words is passed over at once */             \
                any |= x[i] ^ y[i];                                                                           \
            if (!any)                                                                                         \
                continue;                                                                                     \
            for (int64_t i = g; i < end; i++) {                                                               \
                if (x[i] == y[i])                                                                             \
                    continue;                                                                                 \
                if (sparse)                                                                                   \
                    *ix++ = (int32_t)i;                                                                       \
                else                                                                                          \
                    bits[i >> 3] |= (uint8_t)(1u << (i & 7));                                                \
                *v++ = x[i];                                                                                  \
                if (advance)                                                                                  \
                    y[i] = x[i];                                                                              \
            }                                                                                                 \
        }                                                                                                     \
        if (sparse)                                                                                           \
            *index = ix;                                                                                      \
        *values = v;                                                                                          \
    }
GATHER(uint8_t)
GATHER(uint16_t)
GATHER(uint32_t)
GATHER(uint64_t)

static void gather(const char *x, char *y, int64_t n, int word, int sparse, int advance, int32_t **index,
                   uint8_t *bits, char **values) {
    switch (word) {
    case 1:
        gather_uint8_t((const uint8_t *)x, (uint8_t *)y, n, sparse, advance, index, bits, (uint8_t **)values);
        break;
    case 2:
        gather_uint16_t((const uint16_t *)x, (uint16_t *)y, n, sparse, advance, index, bits, (uint16_t **)values);
        break;
    case 4:
        gather_uint32_t((const uint32_t *)x, (uint32_t *)y, n, sparse, advance, index, bits, (uint32_t **)values);
        break;
    default:
        gather_uint64_t((const uint64_t *)x, (uint64_t *)y, n, sparse, advance, index, bits, (uint64_t **)values);
    }
}

/* the patch's sections of new against base for blocks first..last - 1, for the kinds given, each section from
 * the pointer given (bits: zeroed by the caller) */
void cudarecv_delta_gather(const char *new_, char *base, int advance, int64_t words, int word, int64_t block_words,
                           int64_t first, int64_t last, const uint8_t *kinds, int32_t *index, uint8_t *bits,
                           char *sparse_values, char *marked_values, char *full) {
    int64_t blocks = (words + block_words - 1) / block_words;
    for (int64_t k = first; k < last; k++) {
        int64_t at = k * block_words, n = BLOCK_LEN(k);
        const char *x = new_ + at * word;
        char *y = base + at * word;
        switch (kinds[k]) {
        case SPARSE: gather(x, y, n, word, 1, advance, &index, NULL, &sparse_values); break;
        case BITMASK:
            gather(x, y, n, word, 0, advance, NULL, bits, &marked_values);
            bits += (n + 7) / 8;
            break;
        case FULL:
            memcpy(full, x, (size_t)(n * word));
            if (advance)
                memcpy(y, x, (size_t)(n * word));
            full += n * word;
            break;
        default: break;
        }
    }
}

static int popcount8(uint8_t b) { return __builtin_popcount(b); }

/* 0 if every SPARSE index lies in its block (and they rise) and every BITMASK block's bits match its count and
 * stay inside it; else -1 - the first bad block */
int64_t cudarecv_delta_check(int64_t words, int64_t block_words, const uint8_t *kinds, const int64_t *counts,
                             const int32_t *index, const uint8_t *bits) {
    int64_t blocks = (words + block_words - 1) / block_words;
    for (int64_t k = 0; k < blocks; k++) {
        int64_t n = BLOCK_LEN(k);
        if (kinds[k] == SPARSE) {
            int64_t last = -1;
            for (int64_t i = 0; i < counts[k]; i++, index++) {
                if (*index <= last || *index >= n)
                    return -1 - k;
                last = *index;
            }
        } else if (kinds[k] == BITMASK) {
            int64_t bytes = (n + 7) / 8, c = 0;
            for (int64_t j = 0; j < bytes; j++)
                c += popcount8(bits[j]);
            if (c != counts[k] || (n % 8 && bits[bytes - 1] >> (n % 8)))
                return -1 - k;
            bits += bytes;
        }
    }
    return 0;
}

#define PUT(T)                                                                                                \
    static void put_##T(T *into, const int32_t **index, const uint8_t *bits, int64_t n, int64_t count,       \
                        const T **values) {                                                                   \
        const T *v = *values;                                                                                 \
        if (index) {                                                                                          \
            for (int64_t i = 0; i < count; i++)                                                               \
                into[(*index)[i]] = *v++;                                                                     \
            *index += count;                                                                                  \
        } else {                                                                                              \
            for (int64_t j = 0; j < (n + 7) / 8; j++)                                                         \
                for (uint8_t b = bits[j]; b; b &= (uint8_t)(b - 1))                                           \
                    into[8 * j + __builtin_ctz(b)] = *v++;                                                    \
        }                                                                                                     \
        *values = v;                                                                                          \
    }
PUT(uint8_t)
PUT(uint16_t)
PUT(uint32_t)
PUT(uint64_t)

static void put(char *into, int word, const int32_t **index, const uint8_t *bits, int64_t n, int64_t count,
                const char **values) {
    switch (word) {
    case 1: put_uint8_t((uint8_t *)into, index, bits, n, count, (const uint8_t **)values); break;
    case 2: put_uint16_t((uint16_t *)into, index, bits, n, count, (const uint16_t **)values); break;
    case 4: put_uint32_t((uint32_t *)into, index, bits, n, count, (const uint32_t **)values); break;
    default: put_uint64_t((uint64_t *)into, index, bits, n, count, (const uint64_t **)values);
    }
}

/* write a checked patch (cudarecv_delta_check returned 0) into the base version */
void cudarecv_delta_apply(char *into, int64_t words, int word, int64_t block_words, const uint8_t *kinds,
                          const int64_t *counts, const int32_t *index, const uint8_t *bits,
                          const char *sparse_values, const char *marked_values, const char *full) {
    int64_t blocks = (words + block_words - 1) / block_words;
    for (int64_t k = 0; k < blocks; k++) {
        int64_t n = BLOCK_LEN(k);
        char *x = into + k * block_words * word;
        switch (kinds[k]) {
        case SPARSE: put(x, word, &index, NULL, n, counts[k], &sparse_values); break;
        case BITMASK:
            put(x, word, NULL, bits, n, counts[k], &marked_values);
            bits += (n + 7) / 8;
            break;
        case FULL:
            memcpy(x, full, (size_t)(n * word));
            full += n * word;
            break;
        default: break;
        }
    }
}
