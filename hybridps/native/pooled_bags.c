/*
 * The owner's fused kernel for bags pooled at the owner (CPython extension
 * hybridps.native._pooled_bags; the Python side is hybridps/pooled_bags.py).
 *
 * One call per unit (worker/embedding/groups.py: a block of rows holding one or more tables) does
 * what the torch path does in several ops, in the same float32 arithmetic:
 *  - forward: dedupe the ids the requesters sent (a stable radix sort of the unit's row
 *    ids: torch.unique(sorted) and the order that groups each row's occurrences), gather
 *    each distinct row once (fp32, or bf16 widened exactly), add its weight prediction
 *    (worker/updates/staleness.py: rows[i] + offsets[p] where the row is keys[p], as
 *    hybridps/row_deltas.py add_offsets_ does), and sum every bag's rows
 *    (F.embedding_bag(mode="sum"): from +0.0, row by row in the bag's order);
 *  - backward: each distinct row's gradient, the sum of the gradients of the bags its
 *    occurrences fell in, from +0.0, in the order the ids arrived (the torch path's
 *    F.embedding_bag over the bags grouped by row).
 * The requester's side of such an entry is one call too (`requests`: each id's owner and
 * row there, the ids grouped by owner with a stable counting sort, each owner's share of
 * each bag), the integer work of worker/embedding/input_dist.py make_requests' torch path.
 * The forward also writes what the backward needs (the distinct rows, where each row's
 * occurrences start, the bag of each occurrence grouped by row), which are the torch
 * path's OwnerPool fields (worker/embedding/input_dist.py). Results are bitwise the torch path's:
 * every sum starts from +0.0 and adds in the same order, and the file is built with
 * -ffp-contract=off (no fused multiply-add) and without -ffast-math (no reassociation).
 *
 * Raw addresses as ints and the GIL released around the loops, like fused_adam.c; shapes,
 * dtypes and sizes are checked in Python, the ids and the bag lengths here (before any
 * output is written). Single-threaded: a pooled lookup of a training step is ~20k ids,
 * 1-3 ms of work, on ranks that run one torch thread each. Where the time goes and what
 * was tried: docs/performance-log.md, the section on "the owner's fused pooled-bags kernel".
 */
#include "kernels.h" /* Python.h, RESTRICT, MULTIVERSION and CLONES, PTR */

#include <stdlib.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3) /* read, into L1 */
#else
#define PREFETCH(p) ((void)0)
#endif

#if !defined(__STDC_NO_ATOMICS__) && !defined(_MSC_VER)
#define HAVE_ATOMICS 1
#include <stdatomic.h>
#else
#define HAVE_ATOMICS 0
#endif

/* Fields of one entry of the entries table (int64, [n_entries, ENTRY_FIELDS]). */
enum { E_IDS, E_NUM_IDS, E_LENGTHS, E_NUM_BAGS, E_OFFSET, E_ROWS, ENTRY_FIELDS };

/* Rows ahead the gather prefetches (fbgemm's embedding kernels use 16). */
#define GATHER_AHEAD 16
/* Radix digit bits at most (2048 counters: in L1). */
#define RADIX_BITS 11
/* Fewer keys than this: an insertion sort (no counters to clear). */
#define SMALL_SORT 48

static int bit_length(uint64_t x) {
    int n = 0;
    while (x) {
        n++;
        x >>= 1;
    }
    return n;
}

/* Stable sort of (key, pos) pairs by key, keys in [0, 2^bits). The result is in
 * (*key, *pos); the other pair of buffers is scratch. */
static void sort_pairs(uint64_t **key, int32_t **pos, uint64_t **key_tmp, int32_t **pos_tmp,
                       int64_t n, int bits, uint32_t *count) {
    uint64_t *k = *key, *kt = *key_tmp;
    int32_t *p = *pos, *pt = *pos_tmp;
    if (n < SMALL_SORT) {
        for (int64_t i = 1; i < n; i++) {
            const uint64_t kv = k[i];
            const int32_t pv = p[i];
            int64_t j = i;
            while (j > 0 && k[j - 1] > kv) {
                k[j] = k[j - 1];
                p[j] = p[j - 1];
                j--;
            }
            k[j] = kv;
            p[j] = pv;
        }
        return;
    }
    const int passes = bits <= 0 ? 0 : (bits + RADIX_BITS - 1) / RADIX_BITS;
    const int digit = passes ? (bits + passes - 1) / passes : 0;
    const uint64_t mask = ((uint64_t)1 << digit) - 1;
    for (int pass = 0; pass < passes; pass++) {
        const int shift = pass * digit;
        const size_t buckets = (size_t)1 << digit;
        memset(count, 0, buckets * sizeof(uint32_t));
        for (int64_t i = 0; i < n; i++) count[(k[i] >> shift) & mask]++;
        if (count[(k[0] >> shift) & mask] == (uint32_t)n) continue; /* one digit: in order */
        uint32_t at = 0;
        for (size_t b = 0; b < buckets; b++) {
            const uint32_t c = count[b];
            count[b] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            const uint32_t to = count[(k[i] >> shift) & mask]++;
            kt[to] = k[i];
            pt[to] = p[i];
        }
        uint64_t *sk = k;
        k = kt;
        kt = sk;
        int32_t *sp = p;
        p = pt;
        pt = sp;
    }
    *key = k;
    *key_tmp = kt;
    *pos = p;
    *pos_tmp = pt;
}

/* Sums are accumulated BLOCK floats of the width at a time in vector registers: the
 * vectors run across the width, never across the rows summed, so every element is still
 * +0 + its rows in order. */
#define BLOCK 32

#if defined(__GNUC__) || defined(__clang__)
/* 8 floats (two SSE registers, or one AVX one); the adds are IEEE float adds lane by
 * lane, as the scalar ones. */
typedef float vf8 __attribute__((vector_size(32)));
#define VECTORS (BLOCK / 8)
#endif

static inline void prefetch_row(const char *row, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) PREFETCH(row + b);
}

/* rows[u] = the block's row uniq[u] as the dense model sees it: float32, or bf16 widened
 * (exact), plus its prediction where it has one (keys sorted and distinct, like uniq; one
 * float add per element, as the torch path's add_offsets_). In row order, prefetching
 * GATHER_AHEAD rows ahead: random rows of a table far larger than the caches. */
MULTIVERSION
static void gather_rows(float *RESTRICT rows, const void *weight, int row_bf16,
                        const uint64_t *uniq, int64_t n_uniq, int64_t dim,
                        const int64_t *keys, int64_t n_keys, const float *offsets) {
    const size_t row_bytes = (size_t)dim * (row_bf16 ? 2 : 4);
    const char *base = (const char *)weight;
    for (int64_t u = 0; u < n_uniq && u < GATHER_AHEAD; u++)
        prefetch_row(base + uniq[u] * row_bytes, row_bytes);
    int64_t p = 0;
    for (int64_t u = 0; u < n_uniq; u++) {
        if (u + GATHER_AHEAD < n_uniq)
            prefetch_row(base + uniq[u + GATHER_AHEAD] * row_bytes, row_bytes);
        float *RESTRICT r = rows + u * dim;
        if (row_bf16) {
            const uint16_t *w = (const uint16_t *)weight + uniq[u] * dim;
            for (int64_t d = 0; d < dim; d++) {
                const uint32_t bits = (uint32_t)w[d] << 16;
                memcpy(r + d, &bits, sizeof(float));
            }
        } else {
            memcpy(r, (const float *)weight + uniq[u] * dim, (size_t)dim * sizeof(float));
        }
        while (p < n_keys && (uint64_t)keys[p] < uniq[u]) p++;
        if (p < n_keys && (uint64_t)keys[p] == uniq[u]) {
            const float *RESTRICT o = offsets + p * dim;
            for (int64_t d = 0; d < dim; d++) r[d] = r[d] + o[d];
        }
    }
}

/* out[0:dim] = +0 + src[index(k)] for k in [k0, k1), in order (index: index32 or index64). */
static inline void sum_indexed(float *RESTRICT out, const float *RESTRICT src,
                               const int32_t *index32, const int64_t *index64, int64_t k0,
                               int64_t k1, int64_t dim) {
    int64_t d0 = 0;
#if defined(__GNUC__) || defined(__clang__)
    for (; d0 + BLOCK <= dim; d0 += BLOCK) {
        vf8 acc[VECTORS];
        for (int i = 0; i < VECTORS; i++) acc[i] = (vf8){0.0f};
        for (int64_t k = k0; k < k1; k++) {
            const float *s = src + (index32 ? (int64_t)index32[k] : index64[k]) * dim + d0;
            for (int i = 0; i < VECTORS; i++) {
                vf8 v;
                memcpy(&v, s + 8 * i, sizeof(v));
                acc[i] = acc[i] + v;
            }
        }
        memcpy(out + d0, acc, sizeof(acc));
    }
#endif
    for (; d0 < dim; d0 += BLOCK) {
        const int64_t width = dim - d0 < BLOCK ? dim - d0 : BLOCK;
        float acc[BLOCK];
        for (int64_t i = 0; i < width; i++) acc[i] = 0.0f;
        for (int64_t k = k0; k < k1; k++) {
            const float *s = src + (index32 ? (int64_t)index32[k] : index64[k]) * dim + d0;
            for (int64_t i = 0; i < width; i++) acc[i] = acc[i] + s[i];
        }
        memcpy(out + d0, acc, (size_t)width * sizeof(float));
    }
}

/* out[b] = +0 + rows[inverse[j]] for the positions j of bag b, in order; the bags of
 * every entry, one after the other. */
MULTIVERSION
static void sum_bags(float *RESTRICT out, const float *RESTRICT rows, const int32_t *inverse,
                     const int64_t *entries, int64_t n_entries, int64_t dim) {
    int64_t j = 0;
    float *o = out;
    for (int64_t e = 0; e < n_entries; e++) {
        const int64_t *f = entries + e * ENTRY_FIELDS;
        const int64_t *lengths = PTR(const int64_t *, f[E_LENGTHS]);
        for (int64_t b = 0; b < f[E_NUM_BAGS]; b++, o += dim) {
            sum_indexed(o, rows, inverse, NULL, j, j + lengths[b], dim);
            j += lengths[b];
        }
    }
}

/* grad_rows[u] = +0 + grad_bags[bags_by_row[k]] for k in [starts[u], starts[u+1]), in
 * order. */
MULTIVERSION
static void sum_rows(float *RESTRICT grad_rows, const float *RESTRICT grad_bags,
                     const int64_t *starts, const int64_t *bags_by_row, int64_t n_uniq,
                     int64_t dim) {
    for (int64_t u = 0; u < n_uniq; u++)
        sum_indexed(grad_rows + u * dim, grad_bags, NULL, bags_by_row, starts[u], starts[u + 1],
                    dim);
}

/* Scratch of a forward call: kept between calls (grown to the largest call, never
 * shrunk: a few bytes per id plus the distinct rows, ~2 MB for a step of ids20), since
 * fresh buffers of that size cost page faults on every call. */
typedef struct {
    void *p;
    size_t cap;
} buffer_t;

typedef struct {
    buffer_t keys_a, keys_b, pos_a, pos_b, bag_of, inverse, count, rows;
} scratch_t;

static void *grow(buffer_t *b, size_t bytes) {
    if (b->cap < bytes) {
        free(b->p);
        b->p = malloc(bytes);
        b->cap = b->p ? bytes : 0;
    }
    return b->p;
}

static void release(scratch_t *sc) {
    buffer_t *all[] = {&sc->keys_a, &sc->keys_b, &sc->pos_a, &sc->pos_b, &sc->bag_of,
                       &sc->inverse, &sc->count, &sc->rows};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        free(all[i]->p);
        all[i]->p = NULL;
        all[i]->cap = 0;
    }
}

#if HAVE_ATOMICS
static scratch_t shared_scratch;
static atomic_flag shared_busy = ATOMIC_FLAG_INIT;
#endif

PyDoc_STRVAR(forward_doc,
             "forward(weight, n_rows, dim, row_bf16, entries, n_entries, keys, n_keys, offsets,\n"
             "        out, uniq, starts, bags_by_row) -> n_uniq\n--\n\n"
             "A unit's pooled entries at their owner, in one pass. weight: the unit's block\n"
             "[n_rows, dim] (float32, or bf16 when row_bf16); entries: int64 [n_entries, 6],\n"
             "per entry (ids address, ids, lengths address, bags, row offset in the block,\n"
             "rows of its table): ids int64 in [0, rows), lengths int64 summing to ids;\n"
             "keys (sorted, distinct, int64 block rows) and offsets ([n_keys, dim] float32):\n"
             "the weight prediction (n_keys 0: none). Writes out [bags, dim] float32 (the\n"
             "bags' sums, entry after entry), uniq (the distinct block rows, sorted), starts\n"
             "(n_uniq + 1: where each row's occurrences start) and bags_by_row (the bag of\n"
             "every occurrence, grouped by row, in arrival order), each sized for every id;\n"
             "returns how many distinct rows. ValueError on a bad id or bag length.");

static PyObject *py_forward(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pweight, pentries, pkeys, poffsets, pout, puniq, pstarts, pbags;
    long long n_rows, dim, n_entries, n_keys;
    int row_bf16;
    if (!PyArg_ParseTuple(args, "KLLpKLKLKKKKK", &pweight, &n_rows, &dim, &row_bf16,
                          &pentries, &n_entries, &pkeys, &n_keys, &poffsets, &pout, &puniq,
                          &pstarts, &pbags))
        return NULL;
    if (dim <= 0 || n_rows < 0 || n_entries < 0 || n_keys < 0) {
        PyErr_Format(PyExc_ValueError, "bad sizes: %lld rows x %lld, %lld entries, %lld keys",
                     n_rows, dim, n_entries, n_keys);
        return NULL;
    }
    const int64_t *entries = PTR(const int64_t *, pentries);
    int64_t total = 0, total_bags = 0;
    for (int64_t e = 0; e < n_entries; e++) {
        const int64_t *f = entries + e * ENTRY_FIELDS;
        const int64_t *lengths = PTR(const int64_t *, f[E_LENGTHS]);
        if (f[E_NUM_IDS] < 0 || f[E_NUM_BAGS] < 0 || f[E_OFFSET] < 0 || f[E_ROWS] < 0 ||
            f[E_OFFSET] + f[E_ROWS] > n_rows) {
            PyErr_Format(PyExc_ValueError, "entry %lld: bad layout (%lld ids, %lld bags, "
                         "rows [%lld, +%lld) of %lld)", (long long)e, (long long)f[E_NUM_IDS],
                         (long long)f[E_NUM_BAGS], (long long)f[E_OFFSET], (long long)f[E_ROWS],
                         n_rows);
            return NULL;
        }
        int64_t sum = 0;
        for (int64_t b = 0; b < f[E_NUM_BAGS]; b++) {
            if (lengths[b] < 0) {
                PyErr_Format(PyExc_ValueError, "entry %lld: bag %lld has length %lld",
                             (long long)e, (long long)b, (long long)lengths[b]);
                return NULL;
            }
            sum += lengths[b];
        }
        if (sum != f[E_NUM_IDS]) {
            PyErr_Format(PyExc_ValueError, "entry %lld: bag lengths sum to %lld, not its %lld "
                         "ids", (long long)e, (long long)sum, (long long)f[E_NUM_IDS]);
            return NULL;
        }
        total += f[E_NUM_IDS];
        total_bags += f[E_NUM_BAGS];
    }
    if (total >= INT32_MAX || total_bags >= INT32_MAX || n_keys >= INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%lld ids in %lld bags, %lld predicted rows: more "
                     "than the kernel's 2^31", (long long)total, (long long)total_bags,
                     (long long)n_keys);
        return NULL;
    }
    float *out = PTR(float *, pout);
    uint64_t *uniq = PTR(uint64_t *, puniq); /* int64 >= 0 */
    int64_t *starts = PTR(int64_t *, pstarts);
    int64_t *bags_by_row = PTR(int64_t *, pbags);
    const size_t n = (size_t)total;
    /* The shared scratch when free (the usual case: one training thread), else this
     * call's own. */
    scratch_t own = {0}, *sc = &own;
#if HAVE_ATOMICS
    const int shared = !atomic_flag_test_and_set(&shared_busy);
    if (shared) sc = &shared_scratch;
#endif
    uint64_t *keys_a = grow(&sc->keys_a, (n + 1) * sizeof(uint64_t));
    uint64_t *keys_b = grow(&sc->keys_b, (n + 1) * sizeof(uint64_t));
    int32_t *pos_a = grow(&sc->pos_a, (n + 1) * sizeof(int32_t));
    int32_t *pos_b = grow(&sc->pos_b, (n + 1) * sizeof(int32_t));
    int32_t *bag_of = grow(&sc->bag_of, (n + 1) * sizeof(int32_t));
    int32_t *inverse = grow(&sc->inverse, (n + 1) * sizeof(int32_t));
    uint32_t *count = grow(&sc->count, ((size_t)1 << RADIX_BITS) * sizeof(uint32_t));
    float *rows = NULL;
    int64_t n_uniq = 0, bad_entry = -1, bad_id = 0;
    int failed = !keys_a || !keys_b || !pos_a || !pos_b || !bag_of || !inverse || !count;
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        int64_t j = 0, bag = 0;
        for (int64_t e = 0; e < n_entries; e++) {
            const int64_t *f = entries + e * ENTRY_FIELDS;
            const int64_t *ids = PTR(const int64_t *, f[E_IDS]);
            const int64_t *lengths = PTR(const int64_t *, f[E_LENGTHS]);
            uint64_t bad = 0; /* ids checked here, in the pass that reads them anyway */
            for (int64_t i = 0; i < f[E_NUM_IDS]; i++) {
                bad |= (uint64_t)ids[i] >= (uint64_t)f[E_ROWS];
                keys_a[j + i] = (uint64_t)(ids[i] + f[E_OFFSET]);
                pos_a[j + i] = (int32_t)(j + i);
            }
            if (bad) {
                for (int64_t i = 0; i < f[E_NUM_IDS] && bad_entry < 0; i++)
                    if ((uint64_t)ids[i] >= (uint64_t)f[E_ROWS]) {
                        bad_entry = e;
                        bad_id = ids[i];
                    }
                break;
            }
            int64_t at = j;
            for (int64_t b = 0; b < f[E_NUM_BAGS]; b++, bag++)
                for (int64_t end = at + lengths[b]; at < end; at++) bag_of[at] = (int32_t)bag;
            j += f[E_NUM_IDS];
        }
        if (bad_entry >= 0) goto unlock;
        sort_pairs(&keys_a, &pos_a, &keys_b, &pos_b, (int64_t)n,
                   bit_length(n_rows > 0 ? (uint64_t)(n_rows - 1) : 0), count);
        for (int64_t k = 0; k < (int64_t)n; k++) {
            if (k == 0 || keys_a[k] != keys_a[k - 1]) {
                uniq[n_uniq] = keys_a[k];
                starts[n_uniq++] = k;
            }
            inverse[pos_a[k]] = (int32_t)(n_uniq - 1);
            bags_by_row[k] = bag_of[pos_a[k]];
        }
        starts[n_uniq] = (int64_t)n;
        rows = grow(&sc->rows, ((size_t)n_uniq * (size_t)dim + 1) * sizeof(float));
        if (rows) {
            gather_rows(rows, PTR(const void *, pweight), row_bf16, uniq, n_uniq, dim,
                        PTR(const int64_t *, pkeys), n_keys, PTR(const float *, poffsets));
            sum_bags(out, rows, inverse, entries, n_entries, dim);
        }
    unlock:
        Py_END_ALLOW_THREADS
        failed = bad_entry < 0 && rows == NULL;
    }
    if (sc == &own) release(&own);
#if HAVE_ATOMICS
    if (shared) atomic_flag_clear(&shared_busy);
#endif
    if (failed) return PyErr_NoMemory();
    if (bad_entry >= 0) {
        PyErr_Format(PyExc_ValueError, "entry %lld: row id %lld outside [0, %lld)",
                     (long long)bad_entry, (long long)bad_id,
                     (long long)entries[bad_entry * ENTRY_FIELDS + E_ROWS]);
        return NULL;
    }
    return PyLong_FromLongLong((long long)n_uniq);
}

PyDoc_STRVAR(backward_doc,
             "backward(grad_bags, dim, n_uniq, starts, bags_by_row, grad_rows)\n--\n\n"
             "grad_rows[u] = the sum, from +0.0, of grad_bags[bags_by_row[k]] for k in\n"
             "[starts[u], starts[u + 1]) (float32; what forward wrote).");

static PyObject *py_backward(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pgrad, pstarts, pbags, pout;
    long long dim, n_uniq;
    if (!PyArg_ParseTuple(args, "KLLKKK", &pgrad, &dim, &n_uniq, &pstarts, &pbags, &pout))
        return NULL;
    if (dim <= 0 || n_uniq <= 0) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    sum_rows(PTR(float *, pout), PTR(const float *, pgrad), PTR(const int64_t *, pstarts),
             PTR(const int64_t *, pbags), n_uniq, dim);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(requests_doc,
             "requests(ids, n, offsets, bags, rows, world, local, lengths_wb, per_owner, cuts=0)\n--\n\n"
             "The requester's side of one entry pooled at its owners (worker/embedding/input_dist.py\n"
             "make_requests, whose torch path is the reference): the n int64 ids (in [0,\n"
             "rows), ValueError naming one otherwise) of `bags` bags (offsets: int64,\n"
             "offsets[0] == 0, non-decreasing, at most n) of a table of `rows` rows sharded\n"
             "over `world` ranks: row-wise (cuts 0), or at the world + 1 int64 cut points at\n"
             "`cuts` (worker/embedding/sharding.py: rank r owns rows [cuts[r], cuts[r+1])).\n"
             "Writes local (int64 [n]: each id's row at its\n"
             "owner, grouped by owner, in id order within an owner), lengths_wb (int64\n"
             "[world, bags]: how many ids of each bag each owner got) and per_owner (int64\n"
             "[world]). Returns 0, or -1 (nothing meaningful written) when the offsets are\n"
             "not as said.");

static PyObject *py_requests(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pids, poffsets, plocal, plengths, pper, pcuts = 0;
    long long n, bags, rows, world;
    if (!PyArg_ParseTuple(args, "KLKLLLKKK|K", &pids, &n, &poffsets, &bags, &rows, &world,
                          &plocal, &plengths, &pper, &pcuts))
        return NULL;
    if (n < 0 || bags < 0 || rows <= 0 || world <= 0) {
        PyErr_Format(PyExc_ValueError, "bad sizes: %lld ids, %lld bags, %lld rows, world %lld",
                     n, bags, rows, world);
        return NULL;
    }
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t *offsets = PTR(const int64_t *, poffsets);
    int64_t *local = PTR(int64_t *, plocal);
    int64_t *lengths = PTR(int64_t *, plengths);
    int64_t *per_owner = PTR(int64_t *, pper);
    const int64_t *cuts = PTR(const int64_t *, pcuts); /* NULL: row-wise */
    if (cuts != NULL && (cuts[0] != 0 || cuts[world] != rows)) return PyLong_FromLong(-1);
    if (cuts != NULL)
        for (int64_t r = 0; r < world; r++)
            if (cuts[r + 1] < cuts[r]) return PyLong_FromLong(-1);
    if (bags == 0 ? n != 0 : offsets[0] != 0) return PyLong_FromLong(-1);
    for (int64_t b = 1; b < bags; b++)
        if (offsets[b] < offsets[b - 1] || offsets[b] > n) return PyLong_FromLong(-1);
    int64_t *owner_of_id = malloc((size_t)(n > 0 ? n : 1) * sizeof *owner_of_id);
    int64_t *next = malloc((size_t)world * sizeof *next);
    if (owner_of_id == NULL || next == NULL) {
        free(owner_of_id);
        free(next);
        return PyErr_NoMemory();
    }
    int64_t bad = -1; /* the position of an id outside [0, rows): nothing placed then */
    Py_BEGIN_ALLOW_THREADS
    memset(lengths, 0, (size_t)(world * bags) * sizeof *lengths);
    memset(per_owner, 0, (size_t)world * sizeof *per_owner);
    /* owner: the last r < W with cuts[r] <= id (a binary search); row-wise
       ((id + 1) W - 1) // R, the largest r with r R // W <= id (owner_of), no search */
    for (int64_t b = 0; b < bags && bad < 0; b++) {
        const int64_t end = b + 1 < bags ? offsets[b + 1] : n;
        for (int64_t i = offsets[b]; i < end; i++) {
            if (ids[i] < 0 || ids[i] >= rows) {
                bad = i;
                break;
            }
            int64_t r;
            if (cuts == NULL) {
                r = ((ids[i] + 1) * world - 1) / rows;
            } else {
                int64_t lo = 0, hi = world - 1;
                while (lo < hi) {
                    const int64_t mid = (lo + hi + 1) / 2;
                    if (cuts[mid] <= ids[i]) lo = mid;
                    else hi = mid - 1;
                }
                r = lo;
            }
            owner_of_id[i] = r;
            per_owner[r]++;
            lengths[r * bags + b]++;
        }
    }
    if (bad < 0) {
        for (int64_t r = 0, at = 0; r < world; r++) { /* a stable counting sort by owner */
            next[r] = at;
            at += per_owner[r];
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = owner_of_id[i];
            local[next[r]++] = ids[i] - (cuts == NULL ? r * rows / world : cuts[r]);
        }
    }
    Py_END_ALLOW_THREADS
    free(owner_of_id);
    free(next);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "id %lld at position %lld is outside the table's rows "
                     "[0, %lld)", (long long)ids[bad], (long long)bad, rows);
        return NULL;
    }
    return PyLong_FromLong(0);
}

static PyObject *py_build_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:s,s:s,s:i,s:i}", "isa", CLONES, "threads", "none", "radix_bits",
                         RADIX_BITS, "cuts", 1);
}

static PyMethodDef methods[] = {
    {"forward", py_forward, METH_VARARGS, forward_doc},
    {"backward", py_backward, METH_VARARGS, backward_doc},
    {"requests", py_requests, METH_VARARGS, requests_doc},
    {"build_info", py_build_info, METH_NOARGS, "Build options."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "_pooled_bags",
    "The owner's fused kernel for bags pooled at the owner: dedupe, gather with the weight\n"
    "prediction and bag sums forward; per-row gradient sums backward.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__pooled_bags(void) { return PyModule_Create(&moduledef); }
