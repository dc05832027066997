/*
 * The owner's fused kernel for bags pooled at the owner (CPython extension
 * hybridps.native._pooled_bags; the Python side is hybridps/pooled_bags.py).
 *
 * One call per unit (worker/groups.py: a block of rows holding one or more tables) does
 * what the torch path does in several ops, in the same float32 arithmetic:
 *  - forward: dedupe the ids the requesters sent (a stable radix sort of the unit's row
 *    ids: torch.unique(sorted) and the order that groups each row's occurrences), gather
 *    each distinct row once (fp32, or bf16 widened exactly), add its weight prediction
 *    (worker/staleness.py: rows[i] + offsets[p] where the row is keys[p], as
 *    hybridps/row_deltas.py add_offsets_ does), and sum every bag's rows
 *    (F.embedding_bag(mode="sum"): from +0.0, row by row in the bag's order);
 *  - backward: each distinct row's gradient, the sum of the gradients of the bags its
 *    occurrences fell in, from +0.0, in the order the ids arrived (the torch path's
 *    F.embedding_bag over the bags grouped by row).
 * The forward also writes what the backward needs (the distinct rows, where each row's
 * occurrences start, the bag of each occurrence grouped by row), which are the torch
 * path's OwnerPool fields (worker/input_dist.py). Results are bitwise the torch path's:
 * every sum starts from +0.0 and adds in the same order, and the file is built with
 * -ffp-contract=off (no fused multiply-add) and without -ffast-math (no reassociation).
 *
 * Raw addresses as ints and the GIL released around the loops, like fused_adam.c; shapes,
 * dtypes and sizes are checked in Python, the ids and the bag lengths here (before any
 * output is written). Single-threaded: a pooled lookup of a training step is ~20k ids,
 * work of a few hundred microseconds, on ranks that run one torch thread each.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define RESTRICT __restrict__
#else
#define PREFETCH(p) ((void)0)
#define RESTRICT
#endif

#if defined(HYBRIDPS_TARGET_CLONES)
#define MULTIVERSION __attribute__((target_clones("arch=haswell", "default")))
#define CLONES "haswell,default"
#else
#define MULTIVERSION
#define CLONES "default"
#endif

#define PTR(type, addr) ((type)(uintptr_t)(addr))

/* Fields of one entry of the entries table (int64, [n_entries, ENTRY_FIELDS]). */
enum { E_IDS, E_NUM_IDS, E_LENGTHS, E_NUM_BAGS, E_OFFSET, E_ROWS, ENTRY_FIELDS };

/* Rows ahead whose weight row the gather prefetches. */
#define GATHER_AHEAD 8
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

/* The distinct rows' values: weight rows (fp32, or bf16 widened: exact) plus the
 * prediction of those that have one (keys sorted and distinct, like uniq). */
MULTIVERSION
static void gather_rows(float *RESTRICT rows, const void *weight, int row_bf16,
                        const uint64_t *uniq, int64_t n_uniq, int64_t dim,
                        const int64_t *keys, int64_t n_keys, const float *offsets) {
    const size_t row_bytes = (size_t)dim * (row_bf16 ? 2 : 4);
    int64_t p = 0;
    for (int64_t u = 0; u < n_uniq; u++) {
        if (u + GATHER_AHEAD < n_uniq) {
            const char *ahead = (const char *)weight + uniq[u + GATHER_AHEAD] * row_bytes;
            for (size_t b = 0; b < row_bytes; b += 64) PREFETCH(ahead + b);
        }
        float *RESTRICT r = rows + u * dim;
        if (row_bf16) {
            const uint16_t *RESTRICT w = (const uint16_t *)weight + uniq[u] * dim;
            for (int64_t d = 0; d < dim; d++) {
                const uint32_t bits = (uint32_t)w[d] << 16;
                memcpy(r + d, &bits, sizeof(float));
            }
        } else {
            memcpy(r, (const float *)weight + uniq[u] * dim, (size_t)dim * sizeof(float));
        }
        const int64_t row = (int64_t)uniq[u];
        while (p < n_keys && keys[p] < row) p++;
        if (p < n_keys && keys[p] == row) {
            const float *RESTRICT o = offsets + p * dim;
            for (int64_t d = 0; d < dim; d++) r[d] = r[d] + o[d];
        }
    }
}

/* out[b] = +0 + rows[inverse[j]] for the positions j of bag b, in order. */
MULTIVERSION
static void sum_bags(float *RESTRICT out, const float *RESTRICT rows, const int32_t *inverse,
                     const int64_t *const *lengths, const int64_t *n_bags, int64_t n_entries,
                     int64_t dim) {
    int64_t j = 0;
    float *RESTRICT o = out;
    for (int64_t e = 0; e < n_entries; e++) {
        for (int64_t b = 0; b < n_bags[e]; b++, o += dim) {
            for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
            for (int64_t end = j + lengths[e][b]; j < end; j++) {
                const float *RESTRICT r = rows + (int64_t)inverse[j] * dim;
                for (int64_t d = 0; d < dim; d++) o[d] = o[d] + r[d];
            }
        }
    }
}

/* grad_rows[u] = +0 + grad_bags[bags_by_row[k]] for k in [starts[u], starts[u+1]). */
MULTIVERSION
static void sum_rows(float *RESTRICT grad_rows, const float *RESTRICT grad_bags,
                     const int64_t *starts, const int64_t *bags_by_row, int64_t n_uniq,
                     int64_t dim) {
    for (int64_t u = 0; u < n_uniq; u++) {
        float *RESTRICT g = grad_rows + u * dim;
        for (int64_t d = 0; d < dim; d++) g[d] = 0.0f;
        for (int64_t k = starts[u]; k < starts[u + 1]; k++) {
            const float *RESTRICT s = grad_bags + bags_by_row[k] * dim;
            for (int64_t d = 0; d < dim; d++) g[d] = g[d] + s[d];
        }
    }
}

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
        const int64_t *ids = PTR(const int64_t *, f[E_IDS]);
        const int64_t *lengths = PTR(const int64_t *, f[E_LENGTHS]);
        if (f[E_NUM_IDS] < 0 || f[E_NUM_BAGS] < 0 || f[E_OFFSET] < 0 || f[E_ROWS] < 0 ||
            f[E_OFFSET] + f[E_ROWS] > n_rows) {
            PyErr_Format(PyExc_ValueError, "entry %lld: bad layout (%lld ids, %lld bags, "
                         "rows [%lld, +%lld) of %lld)", (long long)e, (long long)f[E_NUM_IDS],
                         (long long)f[E_NUM_BAGS], (long long)f[E_OFFSET], (long long)f[E_ROWS],
                         n_rows);
            return NULL;
        }
        for (int64_t i = 0; i < f[E_NUM_IDS]; i++) {
            if ((uint64_t)ids[i] >= (uint64_t)f[E_ROWS]) {
                PyErr_Format(PyExc_ValueError, "entry %lld: row id %lld outside [0, %lld)",
                             (long long)e, (long long)ids[i], (long long)f[E_ROWS]);
                return NULL;
            }
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
    if (total >= INT32_MAX || total_bags >= INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%lld ids in %lld bags: more than the kernel's 2^31",
                     (long long)total, (long long)total_bags);
        return NULL;
    }
    float *out = PTR(float *, pout);
    uint64_t *uniq = PTR(uint64_t *, puniq); /* int64 >= 0 */
    int64_t *starts = PTR(int64_t *, pstarts);
    int64_t *bags_by_row = PTR(int64_t *, pbags);
    const size_t n = (size_t)total;
    uint64_t *keys_a = malloc((n + 1) * sizeof(uint64_t));
    uint64_t *keys_b = malloc((n + 1) * sizeof(uint64_t));
    int32_t *pos_a = malloc((n + 1) * sizeof(int32_t));
    int32_t *pos_b = malloc((n + 1) * sizeof(int32_t));
    int32_t *bag_of = malloc((n + 1) * sizeof(int32_t));
    int32_t *inverse = malloc((n + 1) * sizeof(int32_t));
    uint32_t *count = malloc(((size_t)1 << RADIX_BITS) * sizeof(uint32_t));
    const int64_t **lengths = malloc(((size_t)n_entries + 1) * sizeof(int64_t *));
    int64_t *n_bags = malloc(((size_t)n_entries + 1) * sizeof(int64_t));
    float *rows = NULL;
    int64_t n_uniq = 0;
    int failed = !keys_a || !keys_b || !pos_a || !pos_b || !bag_of || !inverse || !count ||
                 !lengths || !n_bags;
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        int64_t j = 0, bag = 0;
        for (int64_t e = 0; e < n_entries; e++) {
            const int64_t *f = entries + e * ENTRY_FIELDS;
            const int64_t *ids = PTR(const int64_t *, f[E_IDS]);
            lengths[e] = PTR(const int64_t *, f[E_LENGTHS]);
            n_bags[e] = f[E_NUM_BAGS];
            for (int64_t i = 0; i < f[E_NUM_IDS]; i++) {
                keys_a[j + i] = (uint64_t)(ids[i] + f[E_OFFSET]);
                pos_a[j + i] = (int32_t)(j + i);
            }
            int64_t at = j;
            for (int64_t b = 0; b < f[E_NUM_BAGS]; b++, bag++)
                for (int64_t end = at + lengths[e][b]; at < end; at++) bag_of[at] = (int32_t)bag;
            j += f[E_NUM_IDS];
        }
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
        rows = malloc(((size_t)n_uniq * (size_t)dim + 1) * sizeof(float));
        if (rows) {
            gather_rows(rows, PTR(const void *, pweight), row_bf16, uniq, n_uniq, dim,
                        PTR(const int64_t *, pkeys), n_keys, PTR(const float *, poffsets));
            sum_bags(out, rows, inverse, lengths, n_bags, n_entries, dim);
        }
        Py_END_ALLOW_THREADS
        failed = rows == NULL;
    }
    free(keys_a);
    free(keys_b);
    free(pos_a);
    free(pos_b);
    free(bag_of);
    free(inverse);
    free(count);
    free(lengths);
    free(n_bags);
    free(rows);
    if (failed) return PyErr_NoMemory();
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

static PyObject *py_build_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:s,s:s,s:i}", "isa", CLONES, "threads", "none", "radix_bits",
                         RADIX_BITS);
}

static PyMethodDef methods[] = {
    {"forward", py_forward, METH_VARARGS, forward_doc},
    {"backward", py_backward, METH_VARARGS, backward_doc},
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
