/*
 * Compiled kernels for statefulset.index.compiled, loaded with ctypes (no Python.h here).
 *
 * Built at install time (setup.py: the wheel's statefulset/index/_kernels.<abi>.so) or, as a
 * fallback, into the user's private folder, always with -ffp-contract=off and never fast-math: no
 * fused multiply-add, so every double expression below rounds exactly like megatron-core's
 * helpers.cpp and like the Python fallbacks beside each caller.
 *
 * The Python side validates shapes, dtypes and scalar ranges and allocates every buffer; these
 * functions only read and write inside the lengths they are given, and report bad array contents
 * through their return code. They do not trust their callers for memory safety either: scalar
 * arguments out of range (negative lengths, a zero domain, sizes whose byte count overflows a
 * size_t) are refused with an error code before anything is read, written or allocated, and no
 * loop can run forever on bad input. tests/sanitize_kernels.sh runs the kernel tests with this
 * file built under AddressSanitizer and UndefinedBehaviorSanitizer.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SF_KERNELS_ABI 11

/* The walk reads lengths[] at random (one read per document_index entry): ask for the entry
 * SF_PREFETCH_AHEAD positions on early. Only a hint, it never changes a result; ~30% faster on
 * 100M entries over 1M sequences. */
#define SF_PREFETCH_AHEAD 16
#if defined(__GNUC__) || defined(__clang__)
#define SF_PREFETCH(address) __builtin_prefetch(address)
#else
#define SF_PREFETCH(address) ((void)0)
#endif

#define SF_OK 0
#define SF_BAD_DOCUMENT 1 /* document_index[*where] is outside [0, num_lengths) */
#define SF_NEGATIVE_LENGTH 2 /* sequence_lengths[document_index[*where]] < 0 */
#define SF_TOKEN_MISMATCH 3 /* the document index holds *where tokens, not epochs * tokens_per_epoch */
#define SF_BAD_ARGUMENT 4 /* a length, size or count out of range: nothing was read or written */

/* Room for `count` items of `item` bytes, or NULL when count is negative or the byte count does not
 * fit a size_t (never a short buffer from a wrapped multiplication). */
static void *sf_alloc(int64_t count, size_t item) {
    if (count < 0 || (uint64_t)count > SIZE_MAX / item) return NULL;
    return malloc(count > 0 ? (size_t)count * item : 1);
}

/* The index of the lowest set bit of a non-zero word. */
static inline int64_t sf_lowest_bit(uint64_t word) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(word);
#else
    int64_t bit = 0;
    while (!(word & 1ULL)) {
        word >>= 1;
        ++bit;
    }
    return bit;
#endif
}

/* Loads from arrays that may sit at any byte offset: the sequence lengths and pointers of a .idx
 * file are read straight from its memory map, where they follow a 34-byte header (int32 at offsets
 * = 2 mod 4, int64 at offsets = 2 or 6 mod 8). A misaligned int32_t/int64_t read is undefined
 * behaviour (UBSan reports it); memcpy is not, and compiles to the same single load on x86-64 and
 * arm64. */
static inline int32_t sf_load_i32(const int32_t *at) {
    int32_t value;
    memcpy(&value, at, sizeof value);
    return value;
}

static inline int64_t sf_load_i64(const int64_t *at) {
    int64_t value;
    memcpy(&value, at, sizeof value);
    return value;
}

/* Whether a Feistel network of 2 * half bits covers [0, n): cycle walking from any x < n ends. */
static inline int sf_feistel_domain_ok(int64_t n, int32_t half) {
    if (n < 1 || half < 1 || half > 32) return 0;
    return half == 32 || (uint64_t)n <= (1ULL << (2 * half));
}

/* The SHA-256 (hex) of the kernels.c this library was built from, passed by the build
 * (-DSF_SOURCE_SHA256="..."): the loader refuses a library built from another source. */
#ifndef SF_SOURCE_SHA256
#define SF_SOURCE_SHA256 ""
#endif

int32_t sf_abi_version(void) { return SF_KERNELS_ABI; }

const char *sf_source_sha256(void) { return SF_SOURCE_SHA256; }

/* Row `row` of the sample index, in the caller's width. */
static inline void sf_store(void *out, int32_t wide, int64_t row, int64_t position, int64_t offset) {
    if (wide) {
        ((int64_t *)out)[2 * row] = position;
        ((int64_t *)out)[2 * row + 1] = offset;
    } else {
        ((int32_t *)out)[2 * row] = (int32_t)position;
        ((int32_t *)out)[2 * row + 1] = (int32_t)offset;
    }
}

/* The length of the sequence at document_index[position], or -1 with *code set. */
static inline int64_t sf_length_at(const int32_t *lengths, int64_t num_lengths, const int32_t *document_index,
                                   int64_t num_documents, int64_t position, int32_t *code) {
    int32_t document, length;
    if (position + SF_PREFETCH_AHEAD < num_documents) {
        int32_t ahead = sf_load_i32(&document_index[position + SF_PREFETCH_AHEAD]);
        if (ahead >= 0 && ahead < num_lengths) SF_PREFETCH(&lengths[ahead]); /* never an out-of-bounds pointer */
    }
    document = sf_load_i32(&document_index[position]);
    if (document < 0 || document >= num_lengths) {
        *code = SF_BAD_DOCUMENT;
        return -1;
    }
    length = sf_load_i32(&lengths[document]);
    if (length < 0) {
        *code = SF_NEGATIVE_LENGTH;
        return -1;
    }
    return length;
}

/*
 * Sample index, one sequential pass over document_index and O(1) extra memory.
 *
 * With C[j] the number of tokens before document_index position j and x = extra, row k is
 * (j_k, k*S - C[j_k]) where j_k is the last position (at most L-1) with C[j_k] <= k*S + x - 1
 * (<= 0 for row 0). Those bounds only grow with k, so one cursor walks document_index once.
 * With final_row_is_partial (no drop_last and the float32 sample count overshoots the stream)
 * the last row is (L-1, length of the last sequence - x). The walk then finishes the pass to
 * check every entry and the token total. out: int32 or int64 (wide) [num_samples + 1, 2].
 */
int32_t sf_sample_index(const int32_t *lengths, int64_t num_lengths, const int32_t *document_index,
                        int64_t num_documents, int64_t seq_length, int64_t expected_tokens, int64_t extra,
                        int64_t num_samples, int32_t final_row_is_partial, void *out, int32_t wide, int64_t *where) {
    int32_t code = SF_OK;
    int64_t position = 0; /* cursor into document_index */
    int64_t start = 0;    /* C[position] */
    int64_t length, end;
    *where = 0;
    /* Every token offset below is at most num_samples * seq_length + extra: it must fit. */
    if (num_documents < 1 || num_lengths < 0 || seq_length < 1 || num_samples < 0 || extra < 0 ||
        num_samples > (INT64_MAX - extra) / seq_length - 1) {
        return SF_BAD_ARGUMENT;
    }
    length = sf_length_at(lengths, num_lengths, document_index, num_documents, 0, &code);
    end = start + length; /* C[position + 1] */
    if (code != SF_OK) {
        *where = 0;
        return code;
    }
    for (int64_t k = 0; k <= num_samples; ++k) {
        int64_t token = k * seq_length;
        int64_t bound = k == 0 ? 0 : token + extra - 1;
        while (end <= bound && position + 1 < num_documents) {
            ++position;
            length = sf_length_at(lengths, num_lengths, document_index, num_documents, position, &code);
            if (code != SF_OK) {
                *where = position;
                return code;
            }
            start = end;
            end = start + length;
        }
        sf_store(out, wide, k, position, token - start);
    }
    /* The rest of the pass: check the remaining entries and total the tokens. */
    while (position + 1 < num_documents) {
        ++position;
        length = sf_length_at(lengths, num_lengths, document_index, num_documents, position, &code);
        if (code != SF_OK) {
            *where = position;
            return code;
        }
        end += length;
    }
    if (end != expected_tokens) {
        *where = end;
        return SF_TOKEN_MISMATCH;
    }
    if (final_row_is_partial) {
        sf_store(out, wide, num_samples, num_documents - 1, length - extra);
    }
    return SF_OK;
}

/*
 * Weighted blending: sample i goes to the dataset d maximising weights[d] * max(i, 1) - count[d],
 * the first one on ties; dataset_sample_index[i] is count[d] before the increment.
 * counts: caller-provided scratch of num_datasets zeros.
 */
int32_t sf_blending_indices(const double *weights, int64_t num_datasets, int64_t size, int16_t *dataset_index,
                            int64_t *dataset_sample_index, int64_t *counts) {
    if (num_datasets < 1 || num_datasets > INT16_MAX + 1 || size < 0) return SF_BAD_ARGUMENT;
    for (int64_t i = 0; i < size; ++i) {
        double x = i > 1 ? (double)i : 1.0;
        int64_t best = 0;
        double best_error = weights[0] * x - (double)counts[0];
        for (int64_t d = 1; d < num_datasets; ++d) {
            double error = weights[d] * x - (double)counts[d];
            if (error > best_error) {
                best_error = error;
                best = d;
            }
        }
        dataset_index[i] = (int16_t)best;
        dataset_sample_index[i] = counts[best];
        counts[best] += 1;
    }
    return SF_OK;
}

/*
 * Exhaustive blending: the same rule with weights sizes[d] / total, over the datasets that still
 * have samples left, until dataset d has given exactly sizes[d] samples. Datasets of size zero
 * never take part (megatron-core would pick them and never retire them).
 * Scratch from the caller: counts (num_datasets zeros), weights (num_datasets doubles),
 * active (num_datasets int32s).
 */
int32_t sf_exhaustive_blending_indices(const int64_t *sizes, int64_t num_datasets, int16_t *dataset_index,
                                       int64_t *dataset_sample_index, int64_t *counts, double *weights,
                                       int32_t *active) {
    int64_t total = 0;
    int64_t num_active = 0;
    if (num_datasets < 0 || num_datasets > INT16_MAX + 1) return SF_BAD_ARGUMENT;
    for (int64_t d = 0; d < num_datasets; ++d) {
        if (sizes[d] < 0 || sizes[d] > INT64_MAX - total) return SF_BAD_ARGUMENT;
        total += sizes[d];
    }
    for (int64_t d = 0; d < num_datasets; ++d) {
        weights[d] = (double)sizes[d] / (double)total;
        if (sizes[d] > 0) {
            active[num_active++] = (int32_t)d; /* ascending, like megatron's std::set */
        }
    }
    for (int64_t i = 0; num_active > 0; ++i) {
        double x = i > 1 ? (double)i : 1.0;
        int64_t best_slot = 0;
        int32_t best = active[0];
        double best_error = weights[best] * x - (double)counts[best];
        for (int64_t slot = 1; slot < num_active; ++slot) {
            int32_t d = active[slot];
            double error = weights[d] * x - (double)counts[d];
            if (error > best_error) {
                best_error = error;
                best = d;
                best_slot = slot;
            }
        }
        dataset_index[i] = (int16_t)best;
        dataset_sample_index[i] = counts[best];
        counts[best] += 1;
        if (counts[best] == sizes[best]) {
            for (int64_t slot = best_slot + 1; slot < num_active; ++slot) {
                active[slot - 1] = active[slot];
            }
            --num_active;
        }
    }
    return SF_OK;
}

/* The keyed Feistel permutation of statefulset.permutation, for the few indices of one batch:
 * numpy needs ~40 array operations per call whatever the count, which dominated native batch
 * assembly. Same arithmetic (splitmix64 finaliser as round function, wrapping uint64, cycle
 * walking until the value is below n); `inverse` runs the rounds backwards. */
static inline uint64_t sf_mix(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t sf_rounds(uint64_t x, int32_t half, uint64_t mask, const uint64_t *keys, int32_t rounds,
                                 int32_t inverse) {
    uint64_t left = x >> half, right = x & mask, t;
    if (!inverse) {
        for (int32_t r = 0; r < rounds; r++) {
            t = left ^ (sf_mix(right ^ keys[r]) & mask);
            left = right;
            right = t;
        }
    } else {
        for (int32_t r = rounds - 1; r >= 0; r--) {
            t = right ^ (sf_mix(left ^ keys[r]) & mask);
            right = left;
            left = t;
        }
    }
    return (left << half) | right;
}

/* Returns 0, or SF_BAD_ARGUMENT (before writing anything) for a domain the network does not cover or
 * an x outside [0, n): cycle walking from such an x might never end. */
int32_t sf_feistel(const int64_t *x, int64_t count, int64_t n, int32_t half, const uint64_t *keys, int32_t rounds,
                   int32_t inverse, int64_t *out) {
    uint64_t mask = (1ULL << half) - 1;
    if (!sf_feistel_domain_ok(n, half) || rounds < 0 || count < 0) return SF_BAD_ARGUMENT;
    for (int64_t i = 0; i < count; i++) {
        if (x[i] < 0 || x[i] >= n) return SF_BAD_ARGUMENT;
    }
    for (int64_t i = 0; i < count; i++) {
        uint64_t y = sf_rounds((uint64_t)x[i], half, mask, keys, rounds, inverse);
        while (y >= (uint64_t)n) y = sf_rounds(y, half, mask, keys, rounds, inverse);
        out[i] = (int64_t)y;
    }
    return SF_OK;
}

/* splitmix64's finaliser with its increment: permutation.mix64. */
static inline uint64_t sf_mix64(uint64_t value) { return sf_mix(value + 0x9E3779B97F4A7C15ULL); }

/* permutation.derive_key(a, b). */
static inline uint64_t sf_derive2(uint64_t a, uint64_t b) { return sf_mix64(sf_mix64(0x243F6A8885A308D3ULL ^ a) ^ b); }

/* native.WindowSource.window_starts without the per-epoch Python objects: sample `local[i]` is
 * window `local[i] % windows` of epoch `local[i] / windows`, permuted by the epoch's keyed
 * Feistel network (key derive_key(key, epoch), round keys derive_key(that, r)). Random
 * positions touch a new epoch per sample, where building one permutation object each in Python
 * cost more than the rest of the batch. */
int32_t sf_window_permute(const int64_t *local, int64_t count, int64_t windows, int32_t half, uint64_t key,
                          int32_t rounds, int64_t *out) {
    uint64_t keys[64];
    int64_t current = -1;
    uint64_t mask = (1ULL << half) - 1;
    if (!sf_feistel_domain_ok(windows, half) || rounds < 0 || rounds > 64 || count < 0) return SF_BAD_ARGUMENT;
    for (int64_t i = 0; i < count; i++) {
        if (local[i] < 0) return SF_BAD_ARGUMENT;
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t epoch = local[i] / windows, j = local[i] % windows;
        if (epoch != current) {
            uint64_t epoch_key = sf_derive2(key, (uint64_t)epoch);
            for (int32_t r = 0; r < rounds; r++) keys[r] = sf_derive2(epoch_key, (uint64_t)r);
            current = epoch;
        }
        uint64_t y = sf_rounds((uint64_t)j, half, mask, keys, rounds, 0);
        while (y >= (uint64_t)windows) y = sf_rounds(y, half, mask, keys, rounds, 0);
        out[i] = (int64_t)y;
    }
    return SF_OK;
}

/*
 * Best-fit decreasing of one window's items into bins of `capacity` tokens (packing: bestfit).
 *
 * Items are taken in decreasing size, ties in index order (a counting sort over sizes). Each goes
 * to the open bin with the least room that still holds it; among bins with equal room, the one
 * that reached that room last; with none, a new bin. Items of size 0 get no bin (-1). bin_of[i]
 * is item i's bin, bins numbered in opening order. Returns the number of bins, or -1 for a size
 * outside [0, capacity], -2 when memory runs out, -3 for a count or capacity out of range. index.bestfit.packing.pack_window is the same
 * algorithm in Python, result for result.
 */
static int64_t sf_pack_one(const int64_t *sizes, int64_t n, int64_t capacity, int64_t *bin_of, int64_t *count,
                           int64_t *order, int64_t *head, int64_t *next, int64_t *room, uint64_t *bits) {
    int64_t words = capacity / 64 + 1, bins = 0;
    memset(count, 0, (size_t)(capacity + 2) * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        if (sizes[i] < 0 || sizes[i] > capacity) return -1;
        count[sizes[i]]++;
    }
    /* Start of each size's run in decreasing order. */
    int64_t at = 0;
    for (int64_t s = capacity; s >= 1; s--) {
        int64_t c = count[s];
        count[s] = at;
        at += c;
    }
    for (int64_t i = 0; i < n; i++) {
        bin_of[i] = -1;
        if (sizes[i] > 0) order[count[sizes[i]]++] = i;
    }
    for (int64_t r = 0; r <= capacity; r++) head[r] = -1;
    memset(bits, 0, (size_t)words * sizeof(uint64_t));
    for (int64_t k = 0; k < at; k++) {
        int64_t item = order[k], size = sizes[item], found = -1;
        /* Least room >= size among the rooms that have a bin: the first set bit at or after size. */
        int64_t w = size / 64;
        uint64_t word = bits[w] & (~0ULL << (size % 64));
        while (1) {
            if (word) {
                found = w * 64 + sf_lowest_bit(word);
                break;
            }
            if (++w >= words) break;
            word = bits[w];
        }
        int64_t bin;
        if (found < 0) {
            bin = bins++;
            room[bin] = capacity;
        } else {
            bin = head[found];
            head[found] = next[bin];
            if (head[found] < 0) bits[found / 64] &= ~(1ULL << (found % 64));
        }
        bin_of[item] = bin;
        room[bin] -= size;
        if (room[bin] > 0) {
            int64_t r = room[bin];
            next[bin] = head[r];
            head[r] = bin;
            bits[r / 64] |= 1ULL << (r % 64);
        }
    }
    return bins;
}

#define SF_BAD_SIZES (-3)
#define SF_MAX_CAPACITY (INT64_MAX / 2) /* capacity + 2 (and its byte count, checked by sf_alloc) fits */

static int64_t sf_pack_windows(const int64_t *sizes, int64_t n, int64_t window, int64_t capacity, int64_t *bin_of,
                               int64_t *bins_out) {
    if (n < 0 || window < 1 || capacity < 0 || capacity > SF_MAX_CAPACITY) return SF_BAD_SIZES;
    int64_t largest = window < n ? window : n;
    int64_t words = capacity / 64 + 1;
    int64_t *count = sf_alloc(capacity + 2, sizeof(int64_t));
    int64_t *head = sf_alloc(capacity + 1, sizeof(int64_t));
    int64_t *order = sf_alloc(largest + 1, sizeof(int64_t));
    int64_t *next = sf_alloc(largest + 1, sizeof(int64_t));
    int64_t *room = sf_alloc(largest + 1, sizeof(int64_t));
    int64_t *scratch = bin_of ? NULL : sf_alloc(largest + 1, sizeof(int64_t));
    uint64_t *bits = sf_alloc(words, sizeof(uint64_t));
    int64_t result = 0;
    if (!count || !head || !order || !next || !room || !bits || (!bin_of && !scratch)) {
        result = -2;
    } else {
        for (int64_t first = 0, j = 0; first < n; first += window, j++) {
            int64_t size = n - first < window ? n - first : window;
            int64_t *target = bin_of ? bin_of + first : scratch;
            int64_t bins = sf_pack_one(sizes + first, size, capacity, target, count, order, head, next, room, bits);
            if (bins < 0) {
                result = bins;
                break;
            }
            bins_out[j] = bins;
        }
    }
    free(count);
    free(head);
    free(order);
    free(next);
    free(room);
    free(scratch);
    free(bits);
    return result;
}

/* Bins of every window of `window` items (the last one may be shorter): bins_out[j]. */
int64_t sf_bestfit_counts(const int64_t *sizes, int64_t n, int64_t window, int64_t capacity, int64_t *bins_out) {
    return sf_pack_windows(sizes, n, window, capacity, 0, bins_out);
}

/* One window: bin_of[i] for each of its n items; returns the bin count (or a negative code). */
int64_t sf_bestfit_window(const int64_t *sizes, int64_t n, int64_t capacity, int64_t *bin_of) {
    int64_t bins = 0;
    if (n < 0) return SF_BAD_SIZES;
    if (n == 0) return 0;
    int64_t code = sf_pack_windows(sizes, n, n, capacity, bin_of, &bins);
    return code < 0 ? code : bins;
}

/* p[0..n) = 0..n-1 (int64) and c[0..n) = value (int32): a row's position_ids and its cu_seqlens padding,
 * the bulk of the document fields' bytes, stored from registers 16 bytes at a time (SSE2's width, which
 * every x86-64 has; other targets get the compiler's lowering). Measured on this project's machine
 * (AMD EPYC, glibc 2.36): 6.2 us for a batch's 131 KB of position_ids into memory not in cache, where
 * memcpy from a constant row (rep movsb at these ~3 KB sizes) took 14 us; in cache 2.4 against 1.6-3.6
 * us (memcpy depends on the destination's alignment). */
#if defined(__GNUC__) || defined(__clang__)
typedef int64_t sf_v2i64 __attribute__((vector_size(16)));
typedef int32_t sf_v4i32 __attribute__((vector_size(16)));
static inline void sf_iota64(int64_t *p, int64_t n) {
    sf_v2i64 a = {0, 1}, b = {2, 3};
    const sf_v2i64 step = {4, 4};
    int64_t j = 0;
    for (; j + 4 <= n; j += 4, a += step, b += step) {
        memcpy(p + j, &a, sizeof a);
        memcpy(p + j + 2, &b, sizeof b);
    }
    for (; j < n; j++) p[j] = j;
}
static inline void sf_fill32(int32_t *c, int64_t n, int32_t value) {
    const sf_v4i32 v = {value, value, value, value};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        memcpy(c + j, &v, sizeof v);
        memcpy(c + j + 4, &v, sizeof v);
    }
    for (; j < n; j++) c[j] = value;
}
#else
static inline void sf_iota64(int64_t *p, int64_t n) {
    for (int64_t j = 0; j < n; j++) p[j] = j;
}
static inline void sf_fill32(int32_t *c, int64_t n, int32_t value) {
    for (int64_t j = 0; j < n; j++) c[j] = value;
}
#endif

/*
 * Document fields of `rows` samples from their pieces (streams.documents.document_fields, the same
 * rule): segments are a row's pieces then its padding (width - used, if any); the last loses the
 * extra token and goes if that empties it; cu (int32 [rows, S+1], padded with S), max_out
 * (int32 [rows]) and pos (int64 [rows, S], restarting at every segment). Returns 0; 1 + r when
 * row r has more than S segments; -(1 + r) when its last segment is empty or its tokens do not
 * add up to S + 1, or its pieces run past the num_packed values of packed. Arguments out of range:
 * -1, nothing read. The values are written from registers (sf_iota64, sf_fill32), nothing is copied.
 */
int64_t sf_document_fields(const int64_t *packed, int64_t num_packed, int64_t rows, int64_t seq_length, int32_t *cu,
                           int32_t *max_out, int64_t *pos) {
    /* packed: counts [rows], used [rows], then the lengths (one address instead of three). */
    if (rows < 0 || seq_length < 1 || seq_length >= INT32_MAX || num_packed < 0 || rows > num_packed / 2) return -1;
    const int64_t *counts = packed, *used = packed + rows, *lengths = packed + 2 * rows;
    int64_t width = seq_length + 1, at = 0, num_lengths = num_packed - 2 * rows;
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = counts[r], pad = width - used[r];
        int64_t m = n + (pad > 0 ? 1 : 0);
        if (n < 0 || n > num_lengths - at || pad < 0 || pad > width || m < 1) return -(1 + r);
        int64_t last = pad > 0 ? pad : lengths[at + n - 1];
        if (last < 1) return -(1 + r);
        int64_t segments = last - 1 == 0 ? m - 1 : m;
        if (segments > seq_length) return 1 + r;
        int32_t *c = cu + r * width;
        int64_t *p = pos + r * seq_length;
        int64_t end = 0, longest = 0;
        c[0] = 0;
        for (int64_t i = 0; i < segments; i++) {
            int64_t length = i == m - 1 ? last - 1 : (i < n ? lengths[at + i] : pad);
            if (length < 0 || end + length > seq_length) return -(1 + r);
            sf_iota64(p + end, length);
            end += length;
            c[i + 1] = (int32_t)end;
            if (length > longest) longest = length;
        }
        if (end != seq_length) return -(1 + r);
        sf_fill32(c + segments + 1, seq_length - segments, (int32_t)seq_length);
        max_out[r] = (int32_t)longest;
        at += n;
    }
    return 0;
}

/*
 * sf_document_fields over `batches` batches of `rows` rows each, as they travel from a DataLoader
 * worker (statefulset.streams.documents.fields_from_wire): batch b's packed input (counts, used,
 * lengths) at wire + b * stride, its outputs at cu + b * rows * (seq_length + 1), max_out + b * rows
 * and pos + b * rows * seq_length. One call per bundle of batches: the trainer's copy out of the ring.
 * Returns 0, or sf_document_fields's code for row b * rows + r (same sign); -1 for bad arguments.
 */
int64_t sf_document_fields_batches(const int64_t *wire, int64_t batches, int64_t stride, int64_t rows,
                                   int64_t seq_length, int32_t *cu, int32_t *max_out, int64_t *pos) {
    if (batches < 0 || rows < 0 || seq_length < 1 || seq_length >= INT32_MAX || stride < 2 * rows) return -1;
    for (int64_t b = 0; b < batches; b++) {
        int64_t code = sf_document_fields(wire + b * stride, stride, rows, seq_length, cu + b * rows * (seq_length + 1),
                                          max_out + b * rows, pos + b * rows * seq_length);
        if (code != 0) return code > 0 ? code + b * rows : code - b * rows;
    }
    return 0;
}

/*
 * Pieces of the token windows [starts[r], starts[r] + width) over sequences whose first tokens are
 * pointers[k] / itemsize (k < n, increasing; pointers may be misaligned: a .idx memory map): cut where a sequence starts strictly inside a window,
 * empty pieces dropped. counts[r] and lengths (room for rows * width) receive them; returns the
 * number of pieces written, or -1 (nothing written) when an argument or a start is out of range.
 */
int64_t sf_window_pieces(const int64_t *pointers, int64_t n, int64_t itemsize, const int64_t *starts, int64_t rows,
                         int64_t width, int64_t *counts, int64_t *lengths) {
    int64_t written = 0;
    if (n < 0 || itemsize < 1 || rows < 0 || width < 1 || width > INT64_MAX / itemsize) return -1;
    for (int64_t r = 0; r < rows; r++) { /* (start + width) * itemsize must fit */
        if (starts[r] < 0 || starts[r] > INT64_MAX / itemsize - width) return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t s = starts[r], lo = 0, hi = n, previous = 0, before = written;
        int64_t first_byte = s * itemsize, stop_byte = (s + width) * itemsize;
        while (lo < hi) { /* first k with pointers[k] > first_byte */
            int64_t mid = lo + (hi - lo) / 2;
            if (sf_load_i64(&pointers[mid]) > first_byte) hi = mid; else lo = mid + 1;
        }
        for (int64_t k = lo; k < n && sf_load_i64(&pointers[k]) < stop_byte; k++) {
            int64_t cut = sf_load_i64(&pointers[k]) / itemsize - s;
            if (cut > previous) lengths[written++] = cut - previous;
            previous = cut;
        }
        if (width > previous) lengths[written++] = width - previous;
        counts[r] = written - before;
    }
    return written;
}

/*
 * One window of packing bestfit, for its stored index: the items (sizes[i] tokens, 0 = no item)
 * packed as sf_bestfit_window does, then listed bin after bin, each bin's items in the order they
 * were placed. entries[] receives the item numbers (room for n), bin_end[m] the number of entries
 * through bin m (room for n). Returns the number of bins, or a negative code as sf_bestfit_window.
 */
int64_t sf_bestfit_entries(const int64_t *sizes, int64_t n, int64_t capacity, uint32_t *entries, uint32_t *bin_end) {
    /* Entry numbers and bin ends are uint32: more items would wrap them. */
    if (n < 0 || (uint64_t)n > UINT32_MAX || capacity < 0 || capacity > SF_MAX_CAPACITY) return SF_BAD_SIZES;
    if (n == 0) return 0;
    int64_t words = capacity / 64 + 1;
    int64_t *count = sf_alloc(capacity + 2, sizeof(int64_t));
    int64_t *head = sf_alloc(capacity + 1, sizeof(int64_t));
    int64_t *order = sf_alloc(n, sizeof(int64_t));
    int64_t *next = sf_alloc(n, sizeof(int64_t));
    int64_t *room = sf_alloc(n, sizeof(int64_t));
    int64_t *bin_of = sf_alloc(n, sizeof(int64_t));
    uint64_t *bits = sf_alloc(words, sizeof(uint64_t));
    int64_t bins = -2;
    if (count && head && order && next && room && bin_of && bits) {
        bins = sf_pack_one(sizes, n, capacity, bin_of, count, order, head, next, room, bits);
        if (bins >= 0) {
            /* order[0..placed) is the placement order; a counting sort by bin keeps it within bins. */
            int64_t placed = 0;
            for (int64_t b = 0; b < bins; b++) bin_end[b] = 0;
            for (int64_t i = 0; i < n; i++) {
                if (bin_of[i] >= 0) {
                    bin_end[bin_of[i]]++;
                    placed++;
                }
            }
            uint32_t total = 0;
            for (int64_t b = 0; b < bins; b++) {
                total += bin_end[b];
                bin_end[b] = total;
            }
            /* room[] is free again: the next slot of each bin (its start). */
            for (int64_t b = 0; b < bins; b++) room[b] = b ? bin_end[b - 1] : 0;
            for (int64_t k = 0; k < placed; k++) {
                int64_t item = order[k];
                entries[room[bin_of[item]]++] = (uint32_t)item;
            }
        }
    }
    free(count);
    free(head);
    free(order);
    free(next);
    free(room);
    free(bin_of);
    free(bits);
    return bins;
}

/* Integer kinds of token arrays: what sf_gather_masked reads and writes (statefulset.streams.label_masks). */
#define SF_KINDS 6 /* 0 uint8, 1 int8, 2 int16, 3 uint16, 4 int32, 5 int64 */
static const int64_t sf_kind_size[SF_KINDS] = {1, 1, 2, 2, 4, 8};

#define SF_CONVERT(ST, DT)                                                                     \
    {                                                                                          \
        const ST *s = (const ST *)src + at;                                                    \
        DT *d = (DT *)dst + to;                                                                \
        for (int64_t i = 0; i < n; i++) d[i] = (DT)s[i];                                       \
    }
#define SF_TO(ST)                                                                              \
    switch (dst_kind) {                                                                        \
    case 0: SF_CONVERT(ST, uint8_t) break;                                                     \
    case 1: SF_CONVERT(ST, int8_t) break;                                                      \
    case 2: SF_CONVERT(ST, int16_t) break;                                                     \
    case 3: SF_CONVERT(ST, uint16_t) break;                                                    \
    case 4: SF_CONVERT(ST, int32_t) break;                                                     \
    default: SF_CONVERT(ST, int64_t) break;                                                    \
    }

/* n values of src from item at into dst from item to, converted (the caller's dtypes hold them). */
static void sf_copy_kind(const void *src, int32_t src_kind, int64_t at, void *dst, int32_t dst_kind, int64_t to,
                         int64_t n) {
    if (src_kind == dst_kind) {
        int64_t size = sf_kind_size[src_kind];
        memcpy((char *)dst + to * size, (const char *)src + at * size, (size_t)(n * size));
        return;
    }
    switch (src_kind) {
    case 0: SF_TO(uint8_t) break;
    case 1: SF_TO(int8_t) break;
    case 2: SF_TO(int16_t) break;
    case 3: SF_TO(uint16_t) break;
    case 4: SF_TO(int32_t) break;
    default: SF_TO(int64_t) break;
    }
}

/* pad converted to the kind of dst, into items [to, to + n). */
static void sf_pad_kind(void *dst, int32_t dst_kind, int64_t to, int64_t n, int64_t pad) {
    for (int64_t i = 0; i < n; i++) {
        switch (dst_kind) {
        case 0: ((uint8_t *)dst)[to + i] = (uint8_t)pad; break;
        case 1: ((int8_t *)dst)[to + i] = (int8_t)pad; break;
        case 2: ((int16_t *)dst)[to + i] = (int16_t)pad; break;
        case 3: ((uint16_t *)dst)[to + i] = (uint16_t)pad; break;
        case 4: ((int32_t *)dst)[to + i] = (int32_t)pad; break;
        default: ((int64_t *)dst)[to + i] = pad; break;
        }
    }
}

/* Start loading every cache line of the ranges at once, a range's token and mask lines side by side:
 * the loads, and the page walks of memory maps read at random, then overlap instead of waiting one
 * after the other (the mask shard's lines would otherwise add their latency to the tokens'). */
static void sf_prefetch_ranges(const int64_t *starts, const int64_t *lengths, int64_t count, const char *tokens,
                               int64_t item, const uint8_t *mask) {
    for (int64_t k = 0; k < count; k++) {
        const char *t = tokens + starts[k] * item;
        int64_t bytes = lengths[k] * item;
        for (int64_t b = 0; b < lengths[k]; b += 64) {
            for (int64_t j = b * item; j < (b + 64) * item && j < bytes; j += 64) SF_PREFETCH(t + j);
            if (mask != NULL) SF_PREFETCH(mask + starts[k] + b);
        }
    }
}

/*
 * A batch's tokens and its loss_mask in one pass over its token ranges (CONTRACT §16): the ranges
 * of a token shard (num_tokens values of kind src_kind, memory-mapped at address tokens) and the
 * same ranges of its loss-mask shard (its uint8 values, as many, at address mask; 0 for a source
 * without one: every token has loss). packed holds (one address to pass instead of twelve, ~0.3 µs
 * each through ctypes) SF_HEADER values: count, with_used, rows, width, src_kind, num_tokens,
 * dst_kind, pad, tokens, mask; then count range starts, count lengths and (with_used) rows values
 * used[r]. The ranges fill the rows one after the other, row r's first used[r] tokens (width
 * without used); the rest of a row is padding. out (kind dst_kind, [rows, width]) receives the
 * tokens, pad after them; label (float32 [rows, width - 1]) for every token but a row's first (a
 * label's mask is its token's) 1 where the mask is nonzero, 0 where it is zero or padding. Returns
 * 0, or -1 with nothing written when an argument, a range or a used[r] is out of bounds or the
 * ranges do not hold exactly the tokens the rows use.
 */
#define SF_HEADER 10
int64_t sf_gather_masked(const int64_t *packed, void *out, float *label) {
    int64_t count = packed[0], rows = packed[2], width = packed[3], num_tokens = packed[5], pad = packed[7];
    int64_t with_used = packed[1], src_kind = packed[4], dst_kind = packed[6];
    const void *tokens = (const void *)(uintptr_t)packed[8];
    const uint8_t *mask = (const uint8_t *)(uintptr_t)packed[9];
    if (count < 0 || rows < 0 || width < 1 || num_tokens < 0 || src_kind < 0 || src_kind >= SF_KINDS ||
        dst_kind < 0 || dst_kind >= SF_KINDS || tokens == NULL || (rows > 0 && width > INT64_MAX / rows))
        return -1;
    const int64_t *starts = packed + SF_HEADER, *lengths = starts + count, *used = with_used ? lengths + count : NULL;
    int64_t total = 0, want = 0;
    for (int64_t k = 0; k < count; k++) {
        int64_t s = starts[k], n = lengths[k];
        if (s < 0 || n < 0 || s > num_tokens || n > num_tokens - s) return -1;
        total += n; /* at most count * num_tokens: no overflow for any real shard */
        if (total > INT64_MAX / 2) return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t u = used ? used[r] : width;
        if (u < 0 || u > width) return -1;
        want += u;
    }
    if (total != want) return -1;
    int64_t item = sf_kind_size[src_kind];
    sf_prefetch_ranges(starts, lengths, count, (const char *)tokens, item, mask);
    int64_t k = -1, at = 0, left = 0;
    for (int64_t r = 0; r < rows; r++) {
        float *row = label + r * (width - 1);
        int64_t u = used ? used[r] : width, col = 0;
        while (col < u) {
            while (left == 0) { /* a later range holds the row's next token: the totals match */
                k++;
                at = starts[k];
                left = lengths[k];
            }
            int64_t n = left < u - col ? left : u - col;
            sf_copy_kind(tokens, (int32_t)src_kind, at, out, (int32_t)dst_kind, r * width + col, n);
            int64_t skip = col == 0 ? 1 : 0, m = n - skip; /* the row's first token is no label */
            float *dst = row + col + skip - 1;
            if (mask == NULL) {
                for (int64_t i = 0; i < m; i++) dst[i] = 1.0f;
            } else {
                const uint8_t *src = mask + at + skip;
                for (int64_t i = 0; i < m; i++) dst[i] = src[i] != 0 ? 1.0f : 0.0f;
            }
            at += n;
            left -= n;
            col += n;
        }
        sf_pad_kind(out, (int32_t)dst_kind, r * width + u, width - u, pad);
        for (int64_t c = u > 1 ? u : 1; c < width; c++) row[c - 1] = 0.0f;
    }
    return 0;
}

/*
 * Fill-in-the-middle in token mode over a micro-batch, in place (statefulset.transforms.fim_rows):
 * the rules and draws of statefulset.transforms.fim_tokens, bit for bit, for rows whose draws come
 * from numpy's Philox keyed by (sample id, rng key) with counter 0 and an empty buffer (what the
 * loader's keyed generator is at the start of each encode_sample call).
 */

/* numpy's Philox4x64-10 (Random123): its 64-bit outputs in order, and its buffered 32-bit halves. */
typedef struct {
    uint64_t ctr[4], key[2], buffer[4];
    int pos, has32;
    uint32_t u32;
} sf_philox;

static inline uint64_t sf_mulhilo(uint64_t a, uint64_t b, uint64_t *hi) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 product = (unsigned __int128)a * b;
    *hi = (uint64_t)(product >> 64);
    return (uint64_t)product;
#else
    uint64_t a0 = a & 0xFFFFFFFFULL, a1 = a >> 32, b0 = b & 0xFFFFFFFFULL, b1 = b >> 32;
    uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    uint64_t middle = (p00 >> 32) + (p01 & 0xFFFFFFFFULL) + (p10 & 0xFFFFFFFFULL);
    *hi = p11 + (p01 >> 32) + (p10 >> 32) + (middle >> 32);
    return a * b;
#endif
}

static uint64_t sf_philox_next(sf_philox *g) {
    if (g->pos < 4) return g->buffer[g->pos++];
    if (++g->ctr[0] == 0 && ++g->ctr[1] == 0 && ++g->ctr[2] == 0) ++g->ctr[3];
    uint64_t c0 = g->ctr[0], c1 = g->ctr[1], c2 = g->ctr[2], c3 = g->ctr[3], k0 = g->key[0], k1 = g->key[1];
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B97F4A7C15ULL;
            k1 += 0xBB67AE8584CAA73BULL;
        }
        uint64_t hi0, hi1;
        uint64_t lo0 = sf_mulhilo(0xD2E7470EE14C6C93ULL, c0, &hi0);
        uint64_t lo1 = sf_mulhilo(0xCA5A826395121157ULL, c2, &hi1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    g->buffer[0] = c0, g->buffer[1] = c1, g->buffer[2] = c2, g->buffer[3] = c3;
    g->pos = 1;
    return c0;
}

static inline uint32_t sf_philox_next32(sf_philox *g) {
    if (g->has32) {
        g->has32 = 0;
        return g->u32;
    }
    uint64_t value = sf_philox_next(g);
    g->has32 = 1;
    g->u32 = (uint32_t)(value >> 32);
    return (uint32_t)value;
}

#define SF_FIM_TRIES 256 /* redraws before giving up: each is accepted with probability >= 1/2 */

/* Generator.binomial(1, p) (numpy's inversion; p given with qn and second for min(p, 1 - p), as
 * fim_draws computes them): 0 or 1, or -1 after SF_FIM_TRIES rejections (never, for real rates). */
static int sf_binomial(sf_philox *g, const double *rate) {
    double p = rate[0], qn = rate[1], second = rate[2];
    if (p == 0.0) return 0;
    int x = 0, tries = 0;
    double px = qn, u = (double)(sf_philox_next(g) >> 11) * (1.0 / 9007199254740992.0);
    while (u > px) {
        x++;
        if (x > 1) {
            if (++tries > SF_FIM_TRIES) return -1;
            x = 0;
            px = qn;
            u = (double)(sf_philox_next(g) >> 11) * (1.0 / 9007199254740992.0);
        } else {
            u -= px;
            px = second;
        }
    }
    return p <= 0.5 ? x : 1 - x;
}

/* numpy's buffered_bounded_lemire_uint32 for 0..r (r < 2**32 - 1); -1 after SF_FIM_TRIES rejections. */
static int64_t sf_bounded(sf_philox *g, uint64_t r) {
    uint64_t excl = r + 1, m = (uint64_t)sf_philox_next32(g) * excl;
    uint32_t left = (uint32_t)m;
    if (left < excl) {
        uint32_t threshold = (uint32_t)((0xFFFFFFFFULL - r) % excl);
        int tries = 0;
        while (left < threshold) {
            if (++tries > SF_FIM_TRIES) return -1;
            m = (uint64_t)sf_philox_next32(g) * excl;
            left = (uint32_t)m;
        }
    }
    return (int64_t)(m >> 32);
}

/* One row's walk: its input (in: the row's tokens, read in place; src: a copy of them, made only
 * where the gather needs one, and the three sentinels after width; token mask or NULL, token
 * documents, with room for the sentinels), its pieces (ranges of that input) and its FIMs. */
typedef struct {
    const int64_t *params;
    const double *rates;   /* rate, fragment_rate, spm_rate: (p, qn, second) each */
    const int64_t *no_prefix;
    int64_t width, tail, npieces, nfims, at_split, nsplits;
    const int64_t *in;
    int64_t *src, *docs, *starts, *lengths, *fims, *splits; /* fims: (first piece, spm, doc) */
    float *mask, *values; /* values: each FIM's sentinel mask value */
    sf_philox g;
} sf_fim_row;

/* params: rows, width, rng key, prefix, middle, suffix, has eod, eod, has split, split, no-prefix length. */
#define SF_FIM_PARAMS 11

static void sf_fim_keep(sf_fim_row *w, int64_t a, int64_t b) {
    if (b <= a) return;
    int64_t n = w->npieces;
    if (n > 0 && w->starts[n - 1] + w->lengths[n - 1] == a) {
        w->lengths[n - 1] += b - a;
        return;
    }
    w->starts[n] = a;
    w->lengths[n] = b - a;
    w->npieces = n + 1;
}

/* FIM [a, b) with probability rates[0..2]: 1 if FIM'd, 0 if kept, -1 on a failed draw. */
static int sf_fim_permute(sf_fim_row *w, int64_t a, int64_t b, int64_t doc, const double *rate) {
    int hit = sf_binomial(&w->g, rate);
    if (hit <= 0) {
        sf_fim_keep(w, a, b);
        return hit;
    }
    int64_t np = w->params[10];
    if (np > 0 && b - a >= np) {
        int64_t k = 0;
        while (k < np && w->in[a + k] == w->no_prefix[k]) k++;
        if (k == np) {
            sf_fim_keep(w, a, b);
            return 0;
        }
    }
    uint64_t n = (uint64_t)(b - a);
    int64_t lo = sf_bounded(&w->g, n), hi = sf_bounded(&w->g, n);
    if (lo < 0 || hi < 0) return -1;
    if (lo > hi) {
        int64_t t = lo;
        lo = hi;
        hi = t;
    }
    int spm = sf_binomial(&w->g, w->rates + 6);
    if (spm < 0) return -1;
    float value = 1.0f;
    if (w->mask != NULL) { /* numpy's max: NaN if any is NaN */
        value = w->mask[a];
        for (int64_t t = a + 1; t < b && value == value; t++)
            if (w->mask[t] > value || w->mask[t] != w->mask[t]) value = w->mask[t];
    }
    int64_t f = w->nfims++, p = w->npieces, x = w->width;
    w->fims[3 * f] = p, w->fims[3 * f + 1] = spm, w->fims[3 * f + 2] = doc;
    w->values[f] = value;
    int64_t psm_starts[6] = {x, a, x + 2, a + hi, x + 1, a + lo}, psm_lengths[6] = {1, lo, 1, (b - a) - hi, 1, hi - lo};
    int64_t spm_starts[6] = {x, x + 2, a + hi, x + 1, a, a + lo}, spm_lengths[6] = {1, 1, (b - a) - hi, 1, lo, hi - lo};
    memcpy(w->starts + p, spm ? spm_starts : psm_starts, sizeof psm_starts);
    memcpy(w->lengths + p, spm ? spm_lengths : psm_lengths, sizeof psm_lengths);
    w->npieces = p + 6;
    return 1;
}

/* A segment [a, b), split at the split token when it holds one (Megatron-LM's rule). */
static int sf_fim_segment(sf_fim_row *w, int64_t a, int64_t b, int64_t doc) {
    while (w->at_split < w->nsplits && w->splits[w->at_split] < a) w->at_split++;
    if (w->at_split == w->nsplits || w->splits[w->at_split] >= b) return sf_fim_permute(w, a, b, doc, w->rates);
    int hit = sf_binomial(&w->g, w->rates);
    if (hit <= 0) {
        if (hit == 0) sf_fim_keep(w, a, b);
        return hit;
    }
    int changed = 0;
    for (int64_t current = a;;) {
        int64_t loc = w->at_split < w->nsplits && w->splits[w->at_split] < b ? w->splits[w->at_split++] : b;
        if (loc > current) { /* an empty fragment is no FIM */
            int got = sf_fim_permute(w, current, loc, doc, w->rates + 3);
            if (got < 0) return -1;
            changed |= got;
        }
        if (loc == b) return changed;
        sf_fim_keep(w, loc, loc + 1);
        current = loc + 1;
    }
}

/* The row's walk over its documents' runs in [0, tail), EOD tokens kept in place: 1 if a segment
 * changed, 0 if none did, -1 on a failed draw. */
static int sf_fim_walk(sf_fim_row *w) {
    const int64_t *in = w->in;
    const int has_eod = w->params[6] != 0;
    const int64_t eod = w->params[7];
    int changed = 0;
    for (int64_t start = 0, end; start < w->tail; start = end) {
        int64_t doc = w->docs != NULL ? w->docs[start] : 0, current = start;
        for (end = w->docs != NULL ? start + 1 : w->tail; end < w->tail && w->docs[end] == doc;) end++;
        for (int64_t loc = start; has_eod; loc++) {
            while (loc < end && in[loc] != eod) loc++;
            if (loc == end) break;
            if (loc > current) {
                int got = sf_fim_segment(w, current, loc, doc);
                if (got < 0) return -1;
                changed |= got;
            }
            sf_fim_keep(w, loc, loc + 1);
            current = loc + 1;
        }
        if (end > current) {
            int got = sf_fim_segment(w, current, end, doc);
            if (got < 0) return -1;
            changed |= got;
        }
    }
    return changed;
}

/* A changed row's document fields from its tokens' documents (docs, width values), as
 * streams.documents.document_fields computes them for pieces of the runs' lengths using every token:
 * the last run loses the extra token (and goes if that empties it); cu int32 [width] (the rest of it
 * seq_length), top (int32, or NULL) the longest, pos int64 [width - 1] (or NULL) each token's place. */
static void sf_fim_fields(const int64_t *docs, int64_t width, int32_t *cu, int32_t *top, int64_t *pos) {
    int64_t k = 1, at = 0, longest = 0, limit = width - 1;
    cu[0] = 0;
    for (int64_t start = 0, end; start < limit; start = end) {
        for (end = start + 1; end < width && docs[end] == docs[start];) end++;
        int64_t n = (end < limit ? end : limit) - start; /* >= 1: start < limit */
        if (pos != NULL)
            for (int64_t t = 0; t < n; t++) pos[at + t] = t;
        at += n;
        cu[k++] = (int32_t)at;
        if (n > longest) longest = n;
    }
    for (; k < width; k++) cu[k] = (int32_t)limit;
    if (top != NULL) *top = (int32_t)longest;
}

/* The FIM'd row gathered from its pieces: tokens into text, mask values (after the first) into label,
 * and, with documents (out_docs not NULL), the tokens' documents into out_docs. The leading pieces
 * that are the row's own tokens in place (all before its first FIM) stay where they are; the rest of
 * the row is copied into src first, as the gather overwrites text. */
static void sf_fim_gather(sf_fim_row *w, int64_t *text, float *label, int64_t *out_docs, float *out_mask) {
    int64_t width = w->width, o = 0, f = -1, k = 0;
    for (; k < w->npieces && w->starts[k] == o && o < width; k++) o += w->lengths[k];
    if (o > width) o = width;
    if (out_docs != NULL) memcpy(out_docs, w->docs, (size_t)o * sizeof(int64_t));
    if (out_mask != NULL) memcpy(out_mask, w->mask, (size_t)o * sizeof(float));
    memcpy(w->src + o, text + o, (size_t)(width - o) * sizeof(int64_t));
    for (; k < w->npieces && o < width; k++) {
        while (f + 1 < w->nfims && w->fims[3 * (f + 1)] <= k) f++;
        int64_t s = w->starts[k], n = w->lengths[k];
        if (n <= 0) continue; /* an empty piece (a cut at a segment's end) */
        if (n > width - o) n = width - o;
        if (s >= width) { /* a sentinel: its FIM's document and mask value */
            text[o] = w->src[s];
            if (out_docs != NULL) out_docs[o] = w->fims[3 * f + 2];
            if (out_mask != NULL) out_mask[o] = w->values[f];
            o += n;
            continue;
        }
        memcpy(text + o, w->src + s, (size_t)n * sizeof(int64_t));
        if (out_docs != NULL) memcpy(out_docs + o, w->docs + s, (size_t)n * sizeof(int64_t));
        if (out_mask != NULL) memcpy(out_mask + o, w->mask + s, (size_t)n * sizeof(float));
        o += n;
    }
    if (label != NULL) memcpy(label, out_mask + 1, (size_t)(width - 1) * sizeof(float));
}

/* Row r's input into w: source tokens (sentinels after them), token mask, documents, tail, splits. */
static void sf_fim_load(sf_fim_row *w, const int64_t *text, const float *label, const int32_t *cu, int64_t cu_width) {
    const int64_t *params = w->params;
    int64_t width = w->width;
    w->in = text;
    w->src[width] = params[3], w->src[width + 1] = params[4], w->src[width + 2] = params[5];
    w->tail = width;
    if (w->mask != NULL) {
        w->mask[0] = label[0];
        memcpy(w->mask + 1, label, (size_t)(width - 1) * sizeof(float));
        w->mask[width] = w->mask[width + 1] = w->mask[width + 2] = 0.0f;
        int64_t t = width - 1;
        while (t >= 0 && w->mask[t] == 0.0f && text[t] == text[width - 1]) t--;
        w->tail = t + 1;
    }
    if (cu != NULL) { /* a token's document: how many document starts (0 < start < width - 1) lie at or before it */
        memset(w->docs, 0, (size_t)(width + 3) * sizeof(int64_t));
        for (int64_t k = 0; k < cu_width; k++)
            if (cu[k] > 0 && cu[k] < width - 1) w->docs[cu[k]] = 1;
        for (int64_t t = 1; t < width; t++) w->docs[t] += w->docs[t - 1];
        w->docs[width] = w->docs[width + 1] = w->docs[width + 2] = 0;
    }
    w->nsplits = w->at_split = w->npieces = w->nfims = 0;
    for (int64_t t = 0; params[8] && t < w->tail; t++)
        if (text[t] == params[9]) w->splits[w->nsplits++] = t;
}

/* The int64 values of work sf_fim_rows needs for rows of `width` tokens (its int64 and float32 arrays). */
static int64_t sf_fim_work(int64_t width) {
    int64_t room = width + 3, pieces = 6 * (width + 2);
    return 3 * room + 2 * pieces + 4 * width + (3 * room + width + 1) / 2;
}

/*
 * params (SF_FIM_PARAMS values): rows, width (seq_length + 1), rng key, prefix, middle and suffix
 * ids, has eod, eod id, has split, split id, no_prefix's length. rates: (p, qn, second) of rate,
 * fragment_rate and spm_rate (fim_draws' inversion constants of min(p, 1 - p)). ids: each row's
 * sample id (the Philox key is (id, rng key)). text int64 [rows, width] and label float32 [rows,
 * width - 1] (NULL: no loss mask) are FIM'd in place; cu int32 [rows, width] (NULL: one document a
 * row) gives the documents, and a changed row's cu_seqlens, max_seqlen (top int32 [rows], or NULL)
 * and position_ids (pos int64 [rows, width - 1], or NULL) are written again for its permuted
 * documents (fim's set_document_fields). work: work_size int64 values of scratch, at least
 * sf_fim_work(width) (the caller's, reused: no allocation per call). Returns 0; -1 for a bad
 * argument (nothing read or written); -2 when a draw was rejected SF_FIM_TRIES times (never for real
 * rates; rows before it are FIM'd).
 */
int64_t sf_fim_rows(const int64_t *params, const double *rates, const int64_t *ids, const int64_t *no_prefix,
                    int64_t *text, float *label, int32_t *cu, int32_t *top, int64_t *pos, int64_t *work,
                    int64_t work_size) {
    int64_t rows = params[0], width = params[1];
    if (rows < 0 || width < 2 || width > (INT64_C(1) << 31) || params[10] < 0 || (params[10] > 0 && no_prefix == NULL) ||
        (cu == NULL && (top != NULL || pos != NULL)) || work == NULL || work_size < sf_fim_work(width) ||
        (rows > 0 && width > INT64_MAX / 8 / rows))
        return -1;
    for (int k = 0; k < 3; k++) {
        const double *r = rates + 3 * k;
        if (!(r[0] >= 0.0 && r[0] <= 1.0) || (r[0] > 0.0 && !(r[1] >= 0.5 && r[1] <= 1.0 && r[2] >= 0.0 && r[2] <= 1.0)))
            return -1;
    }
    sf_fim_row w;
    memset(&w, 0, sizeof w);
    w.params = params, w.rates = rates, w.no_prefix = no_prefix, w.width = width;
    int64_t room = width + 3, pieces = 6 * (width + 2);
    w.src = work, w.docs = cu != NULL ? work + room : NULL, w.splits = work + 2 * room, w.starts = work + 3 * room;
    w.lengths = w.starts + pieces, w.fims = w.lengths + pieces;
    int64_t *out_docs = cu != NULL ? w.fims + 3 * width : NULL;
    float *floats = (float *)(w.fims + 4 * width);
    w.values = floats, w.mask = label != NULL ? floats + width : NULL;
    float *out_mask = label != NULL ? floats + width + room : NULL;
    for (int64_t r = 0; r < rows; r++) {
        float *row_label = label != NULL ? label + r * (width - 1) : NULL;
        int32_t *row_cu = cu != NULL ? cu + r * width : NULL;
        sf_fim_load(&w, text + r * width, row_label, row_cu, width);
        memset(&w.g, 0, sizeof w.g);
        w.g.key[0] = (uint64_t)ids[r], w.g.key[1] = (uint64_t)params[2], w.g.pos = 4;
        int changed = sf_fim_walk(&w);
        if (changed < 0) return -2;
        if (!changed) continue;
        if (w.tail < width) sf_fim_keep(&w, w.tail, width);
        sf_fim_gather(&w, text + r * width, row_label, out_docs, out_mask);
        if (row_cu != NULL)
            sf_fim_fields(out_docs, width, row_cu, top != NULL ? top + r : NULL, pos != NULL ? pos + r * (width - 1) : NULL);
    }
    return 0;
}

/* ----------------------------------------------------------------------------------------------
 * Batch assembly in one call (statefulset.streams.compiled_gather): plan every row's token ranges
 * from the stream's indices and copy (widening) them, the loss_mask beside them when asked for.
 * The Python versions (GPTSource.fill, WindowFiller.fill) give the same rows and pieces; every
 * index read is checked here, and anything out of range returns -1 with nothing written, so that
 * the caller runs the Python version, which names what is wrong.
 */

/* Index arrays a stream reads, by their kinds: int16, int32, int64, uint32. */
static inline int64_t sf_index_at(const void *array, int64_t kind, int64_t i) {
    switch (kind) {
    case 0: { int16_t v; memcpy(&v, (const int16_t *)array + i, sizeof v); return v; }
    case 1: return sf_load_i32((const int32_t *)array + i);
    case 2: return sf_load_i64((const int64_t *)array + i);
    default: { uint32_t v; memcpy(&v, (const uint32_t *)array + i, sizeof v); return v; }
    }
}

/* One row of `width` tokens from its ranges (their total is width) of src (kind src_kind), into
 * dst (kind dst_kind) from item `to`; with label (float32 [width - 1]), each token's mask but the
 * first's (1 without a mask shard). */
static void sf_fill_row(const void *src, int32_t src_kind, const uint8_t *mask, const int64_t *starts,
                        const int64_t *lengths, int64_t ranges, void *dst, int32_t dst_kind, int64_t to,
                        float *label) {
    int64_t col = 0;
    for (int64_t k = 0; k < ranges; k++) {
        int64_t at = starts[k], n = lengths[k];
        if (n == 0) continue;
        sf_copy_kind(src, src_kind, at, dst, dst_kind, to + col, n);
        if (label != NULL) {
            int64_t skip = col == 0 ? 1 : 0, m = n - skip;
            float *into = label + col + skip - 1;
            if (mask == NULL) {
                for (int64_t i = 0; i < m; i++) into[i] = 1.0f;
            } else {
                const uint8_t *from = mask + at + skip;
                for (int64_t i = 0; i < m; i++) into[i] = from[i] != 0 ? 1.0f : 0.0f;
            }
        }
        col += n;
    }
}

/* The fields of one source in a stream's table (SF_SOURCE values each, after SF_TABLE values). */
/* The table's header: sources, then (megatron) the blend's dataset_index (int16) and
 * dataset_sample_index (int64) addresses or 0, or (native) the addresses of a data schedule's
 * stages and blend trees (sf_schedule_locate; 0: the rows' sources are given); positions
 * (megatron), width, packing (0 megatron, 1 native). */
#define SF_TABLE 6
#define SF_SOURCE 18
enum {
    SF_SRC_TOKENS, SF_SRC_KIND, SF_SRC_NUM_TOKENS, SF_SRC_MASK, SF_SRC_POINTERS, SF_SRC_SEQUENCES, SF_SRC_ITEMSIZE,
    /* megatron */
    SF_SRC_SHUFFLE, SF_SRC_SHUFFLE_KIND, SF_SRC_SAMPLES, SF_SRC_SAMPLE, SF_SRC_SAMPLE_KIND, SF_SRC_DOCUMENT,
    SF_SRC_DOCUMENT_KIND, SF_SRC_DOCUMENTS, SF_SRC_LENGTHS, SF_SRC_SAMPLE_ROWS,
};
/* native: the same first seven fields, then */
enum { SF_NAT_WINDOWS = 7, SF_NAT_HALF, SF_NAT_KEY, SF_NAT_ROUNDS, SF_NAT_FIRST_TOKEN, SF_NAT_FIRST_SEQUENCE };

/* The batch block (this thread's scratch): rows, dst_kind, capacity, want (whether the pieces are
 * asked for: packing native skips cutting windows into them without), then `rows` positions (packing
 * megatron) or each row's source then each row's local sample (native: the blend is located in
 * Python, 2 * rows values); then the
 * outputs: the source of each row [rows], the ranges' starts [capacity], and the pieces as
 * streams.documents.Pieces.packed holds them: counts [rows], used [rows], lengths [capacity]. */
#define SF_BATCH 4

/* Bytes per value of the index kinds of sf_index_at. */
static const int64_t sf_index_size[4] = {2, 4, 8, 4};

/* Rows are planned SF_CHUNK at a time, each step of their index walks first started for every row
 * of the chunk: random positions miss the cache at every step (blend, shuffle, sample, document
 * index, then the .idx's pointers and lengths), and one row's misses come one after the other,
 * while the rows' are independent and overlap (~3x less time than row after row). */
#define SF_CHUNK 16

/* Start loading what packing megatron's plan of `count` (<= SF_CHUNK) positions reads, step by
 * step over the rows (only a hint: anything out of range is skipped here and refused by the plan). */
static void sf_warm_megatron(const int64_t *table, const int64_t *pos, int64_t count) {
    const int16_t *blend = (const int16_t *)(uintptr_t)table[1];
    const int64_t *blend_sample = (const int64_t *)(uintptr_t)table[2];
    const int64_t *src[SF_CHUNK];
    int64_t at[SF_CHUNK], first[SF_CHUNK], last[SF_CHUNK];
    for (int64_t r = 0; r < count; r++) {
        if (blend != NULL && pos[r] >= 0 && pos[r] < table[3]) {
            SF_PREFETCH(blend + pos[r]);
            SF_PREFETCH(blend_sample + pos[r]);
        }
    }
    for (int64_t r = 0; r < count; r++) { /* the shuffle index */
        int64_t p = pos[r], d = 0, local = p;
        src[r] = NULL;
        if (p < 0 || p >= table[3]) continue;
        if (blend != NULL) {
            d = sf_index_at(blend, 0, p);
            local = sf_index_at(blend_sample, 2, p);
        }
        if (d < 0 || d >= table[0]) continue;
        const int64_t *s = table + SF_TABLE + d * SF_SOURCE;
        if (local < 0 || local >= s[SF_SRC_SAMPLES] || s[SF_SRC_SHUFFLE_KIND] < 0 || s[SF_SRC_SHUFFLE_KIND] > 3) continue;
        src[r] = s;
        at[r] = local;
        SF_PREFETCH((const char *)(uintptr_t)s[SF_SRC_SHUFFLE] + local * sf_index_size[s[SF_SRC_SHUFFLE_KIND]]);
    }
    for (int64_t r = 0; r < count; r++) { /* rows k and k + 1 of the sample index */
        const int64_t *s = src[r];
        if (s == NULL) continue;
        int64_t k = sf_index_at((const void *)(uintptr_t)s[SF_SRC_SHUFFLE], s[SF_SRC_SHUFFLE_KIND], at[r]);
        if (k < 0 || k >= s[SF_SRC_SAMPLE_ROWS] - 1 || (s[SF_SRC_SAMPLE_KIND] != 1 && s[SF_SRC_SAMPLE_KIND] != 2)) {
            src[r] = NULL;
            continue;
        }
        int64_t size = sf_index_size[s[SF_SRC_SAMPLE_KIND]];
        const char *row = (const char *)(uintptr_t)s[SF_SRC_SAMPLE] + 2 * k * size;
        SF_PREFETCH(row);
        SF_PREFETCH(row + 4 * size - 1);
        at[r] = k;
    }
    for (int64_t r = 0; r < count; r++) { /* the document index entries */
        const int64_t *s = src[r];
        if (s == NULL) continue;
        const void *sample = (const void *)(uintptr_t)s[SF_SRC_SAMPLE];
        first[r] = sf_index_at(sample, s[SF_SRC_SAMPLE_KIND], 2 * at[r]);
        last[r] = sf_index_at(sample, s[SF_SRC_SAMPLE_KIND], 2 * at[r] + 2);
        if (first[r] < 0 || last[r] < first[r] || last[r] >= s[SF_SRC_DOCUMENTS] || s[SF_SRC_DOCUMENT_KIND] < 0 ||
            s[SF_SRC_DOCUMENT_KIND] > 3) {
            src[r] = NULL;
            continue;
        }
        int64_t size = sf_index_size[s[SF_SRC_DOCUMENT_KIND]];
        const char *document = (const char *)(uintptr_t)s[SF_SRC_DOCUMENT];
        for (int64_t i = first[r]; i <= last[r] && i < first[r] + 1024; i += 64 / size) SF_PREFETCH(document + i * size);
        SF_PREFETCH(document + last[r] * size);
    }
    for (int64_t r = 0; r < count; r++) { /* each document's pointer and length in the .idx */
        const int64_t *s = src[r];
        if (s == NULL) continue;
        const void *document = (const void *)(uintptr_t)s[SF_SRC_DOCUMENT];
        const int64_t *pointers = (const int64_t *)(uintptr_t)s[SF_SRC_POINTERS];
        const int32_t *lengths = (const int32_t *)(uintptr_t)s[SF_SRC_LENGTHS];
        for (int64_t i = first[r]; i <= last[r] && i < first[r] + 64; i++) {
            int64_t seq = sf_index_at(document, s[SF_SRC_DOCUMENT_KIND], i);
            if (seq < 0 || seq >= s[SF_SRC_SEQUENCES]) continue;
            SF_PREFETCH(pointers + seq);
            SF_PREFETCH(lengths + seq);
        }
    }
}

/* Plan of packing megatron's rows (GPTSource.fill): returns the pieces, -1 when an index or range
 * is out of bounds, or -(2 + pieces) when they do not fit the capacity (nothing copied). */
static int64_t sf_plan_megatron(const int64_t *table, int64_t *batch) {
    int64_t sources = table[0], positions = table[3], width = table[4], rows = batch[0], capacity = batch[2];
    const int16_t *blend = (const int16_t *)(uintptr_t)table[1];
    const int64_t *blend_sample = (const int64_t *)(uintptr_t)table[2];
    const int64_t *pos = batch + SF_BATCH;
    int64_t *source_of = batch + SF_BATCH + rows, *starts = source_of + rows, *counts = starts + capacity;
    int64_t *used = counts + rows, *lengths = used + rows, pieces = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (r % SF_CHUNK == 0) sf_warm_megatron(table, pos + r, rows - r < SF_CHUNK ? rows - r : SF_CHUNK);
        int64_t p = pos[r], d = 0, local = p, row_tokens = 0;
        if (p < 0 || p >= positions) return -1;
        if (blend != NULL) {
            d = sf_index_at(blend, 0, p);
            local = sf_index_at(blend_sample, 2, p);
        }
        if (d < 0 || d >= sources) return -1;
        const int64_t *s = table + SF_TABLE + d * SF_SOURCE;
        if (local < 0 || local >= s[SF_SRC_SAMPLES]) return -1;
        int64_t k = sf_index_at((const void *)(uintptr_t)s[SF_SRC_SHUFFLE], s[SF_SRC_SHUFFLE_KIND], local);
        const void *sample = (const void *)(uintptr_t)s[SF_SRC_SAMPLE];
        const void *document = (const void *)(uintptr_t)s[SF_SRC_DOCUMENT];
        if (k < 0 || k >= s[SF_SRC_SAMPLE_ROWS] - 1) return -1; /* rows k and k + 1 of sample_index */
        int64_t first = sf_index_at(sample, s[SF_SRC_SAMPLE_KIND], 2 * k);
        int64_t offset = sf_index_at(sample, s[SF_SRC_SAMPLE_KIND], 2 * k + 1);
        int64_t last = sf_index_at(sample, s[SF_SRC_SAMPLE_KIND], 2 * k + 2);
        int64_t end = sf_index_at(sample, s[SF_SRC_SAMPLE_KIND], 2 * k + 3);
        if (first < 0 || last < first || last >= s[SF_SRC_DOCUMENTS]) return -1;
        const int64_t *pointers = (const int64_t *)(uintptr_t)s[SF_SRC_POINTERS];
        const int32_t *seq_lengths = (const int32_t *)(uintptr_t)s[SF_SRC_LENGTHS];
        for (int64_t i = first; i <= last; i++) {
            int64_t seq = sf_index_at(document, s[SF_SRC_DOCUMENT_KIND], i);
            if (seq < 0 || seq >= s[SF_SRC_SEQUENCES]) return -1;
            int64_t lo = i == first ? offset : 0;
            int64_t hi = i == last ? end + 1 : sf_load_i32(&seq_lengths[seq]);
            int64_t start = sf_load_i64(&pointers[seq]) / s[SF_SRC_ITEMSIZE] + lo, n = hi - lo;
            if (start < 0 || n < 0 || start > s[SF_SRC_NUM_TOKENS] || n > s[SF_SRC_NUM_TOKENS] - start) return -1;
            row_tokens += n;
            if (pieces < capacity) {
                starts[pieces] = start;
                lengths[pieces] = n;
            }
            pieces++;
        }
        if (row_tokens != width) return -1;
        source_of[r] = d;
        counts[r] = last - first + 1;
        used[r] = width;
    }
    return pieces <= capacity ? pieces : -(2 + pieces);
}

/* floor(p * share / 2^32) as blend_tree._floor_scaled computes it (64-bit wrapping arithmetic). */
static inline int64_t sf_floor_scaled(uint64_t p, uint64_t share) {
    return (int64_t)((p >> 32) * share + (((p & 0xFFFFFFFFULL) * share) >> 32));
}

/* The source of position *q of a blend tree (BlendSchedule.flat_nodes: rows of share, left, right;
 * a leaf's share is -1 - source) walked from node `root`, *q becoming its local position there (the
 * rule of BlendSchedule.locate); -1 for a malformed tree. */
static int64_t sf_tree_locate(const int64_t *tree, int64_t nodes, int64_t root, int64_t *q) {
    int64_t node = root;
    for (int64_t steps = 0; steps < nodes; steps++) { /* a path never visits a node twice */
        if (node < 0 || node >= nodes) return -1;
        const int64_t *n = tree + 3 * node;
        if (n[0] < 0) return -1 - n[0];
        if (n[0] >= (1LL << 32)) return -1;
        int64_t before = sf_floor_scaled((uint64_t)*q, (uint64_t)n[0]);
        if (sf_floor_scaled((uint64_t)*q + 1, (uint64_t)n[0]) > before) {
            *q = before;
            node = n[1];
        } else {
            *q -= before;
            node = n[2];
        }
    }
    return -1;
}

/* The source of stream position *q in a data schedule (streams.stages.StagedStream._locate), *q
 * becoming its local sample: the last stage starting at or before it, its tree, then the source's
 * draws in earlier stages. schedule: the nodes, the stages, then per stage its start, its tree's
 * root and every source's offset (sources values). -1 for a negative position or bad tables. */
static int64_t sf_schedule_locate(const int64_t *schedule, const int64_t *tree, int64_t sources, int64_t *q) {
    int64_t nodes = schedule[0], stages = schedule[1], stage = -1;
    if (*q < 0) return -1;
    for (int64_t k = 0; k < stages; k++) {
        if (schedule[2 + k * (2 + sources)] <= *q) stage = k; /* starts increase */
    }
    if (stage < 0) return -1;
    const int64_t *row = schedule + 2 + stage * (2 + sources);
    *q -= row[0];
    int64_t d = sf_tree_locate(tree, nodes, row[1], q);
    if (d < 0 || d >= sources || row[2 + d] < 0 || *q > INT64_MAX - row[2 + d]) return -1;
    *q += row[2 + d];
    return d;
}

/* Plan of packing native's rows (WindowFiller.fill and _pieces): each row is the window its
 * source's keyed permutation gives the local sample (sf_window_permute), cut into pieces where a
 * sequence starts inside it (sf_window_pieces). Returns as sf_plan_megatron. */
static int64_t sf_plan_native(const int64_t *table, int64_t *batch) {
    int64_t sources = table[0], width = table[4], rows = batch[0], capacity = batch[2], want = batch[3], pieces = 0;
    const int64_t *which = batch + SF_BATCH, *locals = which + rows;
    const int64_t *schedule = (const int64_t *)(uintptr_t)table[1], *tree = (const int64_t *)(uintptr_t)table[2];
    int64_t *source_of = batch + SF_BATCH + 2 * rows, *starts = source_of + rows, *counts = starts + capacity;
    int64_t *used = counts + rows, *lengths = used + rows;
    int64_t window_start[SF_CHUNK], lo[SF_CHUNK], hi[SF_CHUNK];
    for (int64_t r0 = 0; r0 < rows; r0 += SF_CHUNK) {
        int64_t count = rows - r0 < SF_CHUNK ? rows - r0 : SF_CHUNK, searching = 0;
        for (int64_t c = 0; c < count; c++) { /* each row's window, its tokens' loads started */
            int64_t d = which[r0 + c], local = locals[r0 + c], window;
            if (schedule != NULL) d = sf_schedule_locate(schedule, tree, sources, &local); /* from positions */
            if (d < 0 || d >= sources || local < 0) return -1;
            const int64_t *s = table + SF_TABLE + d * SF_SOURCE;
            if (sf_window_permute(&local, 1, s[SF_NAT_WINDOWS], (int32_t)s[SF_NAT_HALF], (uint64_t)s[SF_NAT_KEY],
                                  (int32_t)s[SF_NAT_ROUNDS], &window) != SF_OK)
                return -1;
            int64_t start = s[SF_NAT_FIRST_TOKEN] + window * (width - 1), item = s[SF_SRC_ITEMSIZE];
            if (start < 0 || start > s[SF_SRC_NUM_TOKENS] - width || s[SF_NAT_FIRST_SEQUENCE] < 0) return -1;
            const char *tokens = (const char *)(uintptr_t)s[SF_SRC_TOKENS] + start * item;
            for (int64_t b = 0; b < width * item; b += 64) SF_PREFETCH(tokens + b);
            window_start[c] = start;
            lo[c] = 0;
            hi[c] = s[SF_SRC_SEQUENCES];
            source_of[r0 + c] = d;
        }
        if (!want) { /* no pieces asked for: a row is one piece, its window */
            for (int64_t c = 0; c < count; c++) {
                if (pieces < capacity) {
                    starts[pieces] = window_start[c];
                    lengths[pieces] = width;
                }
                pieces++;
                counts[r0 + c] = 1;
                used[r0 + c] = width;
            }
            continue;
        }
        do { /* the rows' binary searches in step: first k with pointers[k] > the window's first byte */
            searching = 0;
            for (int64_t c = 0; c < count; c++) {
                if (lo[c] >= hi[c]) continue;
                const int64_t *s = table + SF_TABLE + source_of[r0 + c] * SF_SOURCE;
                const int64_t *pointers = (const int64_t *)(uintptr_t)s[SF_SRC_POINTERS] + s[SF_NAT_FIRST_SEQUENCE];
                int64_t mid = lo[c] + (hi[c] - lo[c]) / 2;
                if (sf_load_i64(&pointers[mid]) > window_start[c] * s[SF_SRC_ITEMSIZE]) hi[c] = mid; else lo[c] = mid + 1;
                searching |= lo[c] < hi[c];
            }
        } while (searching);
        for (int64_t c = 0; c < count; c++) { /* cut where a sequence starts strictly inside (sf_window_pieces) */
            const int64_t *s = table + SF_TABLE + source_of[r0 + c] * SF_SOURCE;
            const int64_t *pointers = (const int64_t *)(uintptr_t)s[SF_SRC_POINTERS] + s[SF_NAT_FIRST_SEQUENCE];
            int64_t n = s[SF_SRC_SEQUENCES], item = s[SF_SRC_ITEMSIZE], start = window_start[c];
            int64_t previous = 0, before = pieces, stop_byte = (start + width) * item;
            for (int64_t k = lo[c]; k < n && sf_load_i64(&pointers[k]) < stop_byte; k++) {
                int64_t cut = sf_load_i64(&pointers[k]) / item - start;
                if (cut > previous) {
                    if (pieces < capacity) {
                        starts[pieces] = start + previous;
                        lengths[pieces] = cut - previous;
                    }
                    pieces++;
                }
                previous = cut;
            }
            if (width > previous) {
                if (pieces < capacity) {
                    starts[pieces] = start + previous;
                    lengths[pieces] = width - previous;
                }
                pieces++;
            }
            counts[r0 + c] = pieces - before;
            used[r0 + c] = width;
        }
    }
    return pieces <= capacity ? pieces : -(2 + pieces);
}

/* One load from every page of the ranges (each page's first byte in them, and the last byte),
 * independent of each other: the rows of random positions sit on pages whose translations are not
 * cached, and a prefetch that misses the TLB may be dropped, so the copy would wait for one page
 * walk after the other; loads overlap them (packing megatron: ~30% less time per batch of 8). */
static volatile int64_t sf_touch_sink;
static void sf_touch_pages(const int64_t *starts, const int64_t *lengths, int64_t count, const char *tokens,
                           int64_t item) {
    int64_t acc = 0;
    for (int64_t k = 0; k < count; k++) {
        if (lengths[k] == 0) continue;
        const char *first = tokens + starts[k] * item, *last = first + lengths[k] * item - 1;
        for (const char *p = first; p < last; p += 4096) acc += *p;
        acc += *last;
    }
    sf_touch_sink = acc;
}

/* The document fields of a gathered batch (streams.documents.gather_fields), asked for by
 * sf_gather_batch's `fields`: the addresses of cu (int32 [rows, S+1]), max_out (int32 [rows]) and pos
 * (int64 [rows, S]), then the value the kernel writes: sf_document_fields's code for the batch's pieces
 * (0: the fields are written), or -1 when nothing was written (the rows refused, or their pieces not
 * asked for). */
enum { SF_FIELDS_CU, SF_FIELDS_MAX, SF_FIELDS_POS, SF_FIELDS_CODE };

/*
 * The rows of one batch (kind dst_kind, [rows, width]) into out and, when label is not NULL, their
 * loss_mask (float32 [rows, width - 1]): planned by packing (table[5]: 0 megatron, 1 native) from
 * the stream's table and the batch block (layouts above), then copied row by row from each row's
 * source, every range's cache lines prefetched first. Returns the number of pieces (written to the
 * batch block), -1 when anything is out of range, or -(2 + pieces) when the pieces do not fit the
 * block's capacity; in both cases nothing is written to out or label. With `fields` (not NULL, the
 * layout above; the batch block's `want` set), the rows' document fields are written in the same
 * call, from the pieces the plan found, while the ranges' first loads are under way: the values of
 * sf_document_fields (one call fewer per batch, and no pieces handed to Python and back).
 */
int64_t sf_gather_batch(const int64_t *table, int64_t *batch, void *out, float *label, int64_t *fields) {
    int64_t sources = table[0], width = table[4], rows = batch[0], dst_kind = batch[1], capacity = batch[2];
    if (sources < 1 || width < 2 || rows < 0 || capacity < 0 || dst_kind < 0 || dst_kind >= SF_KINDS ||
        (rows > 0 && width > INT64_MAX / rows))
        return -1;
    for (int64_t d = 0; d < sources; d++) {
        const int64_t *s = table + SF_TABLE + d * SF_SOURCE;
        if (s[SF_SRC_KIND] < 0 || s[SF_SRC_KIND] >= SF_KINDS || s[SF_SRC_TOKENS] == 0 || s[SF_SRC_ITEMSIZE] < 1)
            return -1;
    }
    if (fields != NULL) fields[SF_FIELDS_CODE] = -1;
    int64_t pieces = table[5] == 0 ? sf_plan_megatron(table, batch) : sf_plan_native(table, batch);
    if (pieces < 0) return pieces;
    int64_t *source_of = batch + SF_BATCH + (table[5] == 0 ? 1 : 2) * rows, *starts = source_of + rows;
    int64_t *counts = starts + capacity, *lengths = counts + 2 * rows;
    for (int64_t r = 0, at = 0; r < rows; at += counts[r], r++) {
        const int64_t *s = table + SF_TABLE + source_of[r] * SF_SOURCE;
        sf_touch_pages(starts + at, lengths + at, counts[r], (const char *)(uintptr_t)s[SF_SRC_TOKENS],
                       sf_kind_size[s[SF_SRC_KIND]]);
    }
    for (int64_t r = 0, at = 0; r < rows; at += counts[r], r++) {
        const int64_t *s = table + SF_TABLE + source_of[r] * SF_SOURCE;
        sf_prefetch_ranges(starts + at, lengths + at, counts[r], (const char *)(uintptr_t)s[SF_SRC_TOKENS],
                           sf_kind_size[s[SF_SRC_KIND]], label ? (const uint8_t *)(uintptr_t)s[SF_SRC_MASK] : NULL);
    }
    if (fields != NULL && batch[3]) /* counts, used and lengths lie back to back: the fields' packed input */
        fields[SF_FIELDS_CODE] = sf_document_fields(
            counts, 2 * rows + pieces, rows, width - 1, (int32_t *)(uintptr_t)fields[SF_FIELDS_CU],
            (int32_t *)(uintptr_t)fields[SF_FIELDS_MAX], (int64_t *)(uintptr_t)fields[SF_FIELDS_POS]);
    for (int64_t r = 0, at = 0; r < rows; at += counts[r], r++) {
        const int64_t *s = table + SF_TABLE + source_of[r] * SF_SOURCE;
        /* A native row is one range, its pieces back to back from its first token. */
        int64_t whole = width, ranges = table[5] == 0 ? counts[r] : 1;
        sf_fill_row((const void *)(uintptr_t)s[SF_SRC_TOKENS], (int32_t)s[SF_SRC_KIND],
                    (const uint8_t *)(uintptr_t)s[SF_SRC_MASK], starts + at, table[5] == 0 ? lengths + at : &whole,
                    ranges, out, (int32_t)dst_kind, r * width, label ? label + r * (width - 1) : NULL);
    }
    return pieces;
}

/*
 * n int64 tokens (an encoded micro-batch's text) narrowed into dst, of kind dst_kind (SF_KINDS), in one
 * pass that also checks they fit: what the range check and the narrowing copy into a batch ring's slot
 * did in two (statefulset.loading.encoded_ring). Returns 0 after writing all n; 1 when a token lies
 * outside the kind's range (dst then holds an undefined prefix: the caller sends the batch another
 * way); -1, nothing written, for a bad argument. Blocks of SF_NARROW_BLOCK tokens, each checked as it
 * is written, so that a token out of range stops the copy within a block.
 */
#define SF_NARROW_BLOCK 2048
/* A token v fits a kind of BITS bits iff v + BIAS (BIAS: 0 unsigned, 2^(BITS-1) signed), as a uint64, has no
 * bit at or above BITS (a negative token wraps to a value with its top bits set): one OR over a block
 * says whether all fit, a loop the compiler vectorises with the narrowing (a compare per token did not). */
#define SF_NARROW(DT, BIAS, BITS)                                                              \
    {                                                                                          \
        DT *d = (DT *)dst;                                                                     \
        for (int64_t b = 0; b < n; b += SF_NARROW_BLOCK) {                                     \
            int64_t e = n - b < SF_NARROW_BLOCK ? n : b + SF_NARROW_BLOCK;                     \
            uint64_t seen = 0;                                                                 \
            for (int64_t i = b; i < e; i++) {                                                  \
                uint64_t v = (uint64_t)src[i];                                                 \
                seen |= v + (uint64_t)(BIAS);                                                  \
                d[i] = (DT)v;                                                                  \
            }                                                                                  \
            if (seen >> (BITS)) return 1;                                                      \
        }                                                                                      \
    }
int64_t sf_narrow_tokens(const int64_t *src, int64_t n, void *dst, int32_t dst_kind) {
    if (n < 0 || n > INT64_MAX / 8 || dst_kind < 0 || dst_kind >= SF_KINDS || (n > 0 && (src == NULL || dst == NULL)))
        return -1;
    switch (dst_kind) {
    case 0: SF_NARROW(uint8_t, 0, 8) break;
    case 1: SF_NARROW(int8_t, 1 << 7, 8) break;
    case 2: SF_NARROW(int16_t, 1 << 15, 16) break;
    case 3: SF_NARROW(uint16_t, 0, 16) break;
    case 4: SF_NARROW(int32_t, 1ULL << 31, 32) break;
    default: memcpy(dst, src, (size_t)n * sizeof(int64_t)); break;
    }
    return 0;
}

/* --------------------------------------------------------------------------------------------------
 * numpy's legacy RandomState.shuffle of a 1-D array, bit for bit (megatron-core shuffles its document
 * and shuffle indices with it): MT19937 (numpy's mt19937_gen / mt19937_next) and the legacy
 * random_interval (the smallest mask >= i, rejection on next_uint32; arrays of at most 2^32 items),
 * then for i = n-1 down to 1 swap x[i] with x[random_interval(i)]. The caller hands over the
 * generator's state (key[624], pos) and puts the state left here back into the generator.
 * Faster than numpy's loop (a generic memcpy per move) by drawing SF_SHUFFLE_AHEAD positions at a
 * time and prefetching them before the swaps; the draws never depend on the array, so the order of
 * draws and swaps, and every result, is numpy's. */
#define SF_MT_N 624
#define SF_MT_M 397
#define SF_SHUFFLE_AHEAD 32

static void sf_mt_generate(uint32_t *key) {
    int i;
    uint32_t y;
    for (i = 0; i < SF_MT_N - SF_MT_M; i++) {
        y = (key[i] & 0x80000000U) | (key[i + 1] & 0x7fffffffU);
        key[i] = key[i + SF_MT_M] ^ (y >> 1) ^ ((0U - (y & 1U)) & 0x9908b0dfU);
    }
    for (; i < SF_MT_N - 1; i++) {
        y = (key[i] & 0x80000000U) | (key[i + 1] & 0x7fffffffU);
        key[i] = key[i + (SF_MT_M - SF_MT_N)] ^ (y >> 1) ^ ((0U - (y & 1U)) & 0x9908b0dfU);
    }
    y = (key[SF_MT_N - 1] & 0x80000000U) | (key[0] & 0x7fffffffU);
    key[SF_MT_N - 1] = key[SF_MT_M - 1] ^ (y >> 1) ^ ((0U - (y & 1U)) & 0x9908b0dfU);
}

static inline uint32_t sf_mt_next(uint32_t *key, int64_t *pos) {
    if (*pos >= SF_MT_N) {
        sf_mt_generate(key);
        *pos = 0;
    }
    uint32_t y = key[(*pos)++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
}

/* A draw in [0, max] for max < 2^32: numpy's random_interval on its next_uint32 path. */
static inline uint32_t sf_mt_interval(uint32_t *key, int64_t *pos, uint32_t max) {
    uint32_t mask = max, value;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    while ((value = (sf_mt_next(key, pos) & mask)) > max) {
    }
    return value;
}

/* Shuffle x[0..n) (itemsize 4 or 8) in place; key/pos: the MT19937 state, updated. SF_BAD_ARGUMENT
 * (nothing read or written) for another itemsize, a negative n, n > 2^32 (numpy then draws on its
 * 64-bit path, left to numpy) or a position outside [0, 624]. */
int32_t sf_legacy_shuffle(uint32_t *key, int64_t *pos, void *x, int64_t n, int64_t itemsize) {
    if (n < 0 || n > 0x100000000LL || *pos < 0 || *pos > SF_MT_N || (itemsize != 4 && itemsize != 8))
        return SF_BAD_ARGUMENT;
    uint64_t drawn[SF_SHUFFLE_AHEAD];
    int64_t i = n - 1;
    while (i >= 1) {
        int64_t count = i < SF_SHUFFLE_AHEAD ? i : SF_SHUFFLE_AHEAD;
        for (int64_t k = 0; k < count; k++) {
            drawn[k] = sf_mt_interval(key, pos, (uint32_t)(i - k));
            SF_PREFETCH((char *)x + drawn[k] * (uint64_t)itemsize);
        }
        if (itemsize == 4) {
            uint32_t *items = (uint32_t *)x;
            for (int64_t k = 0; k < count; k++) {
                uint32_t held = items[drawn[k]];
                items[drawn[k]] = items[i - k];
                items[i - k] = held;
            }
        } else {
            uint64_t *items = (uint64_t *)x;
            for (int64_t k = 0; k < count; k++) {
                uint64_t held = items[drawn[k]];
                items[drawn[k]] = items[i - k];
                items[i - k] = held;
            }
        }
        i -= count;
    }
    return SF_OK;
}
