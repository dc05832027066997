/*
 * The paged store's batch moves (functions of hybridps.native._fused_adam, added at
 * import: see kernels.h), over the arrays hybridps/paged_rows.py owns: its index (an id
 * map, id_map.h: id -> pool position), the free positions (a stack, the next one on top)
 * and per position the id, the last step seen and the frequency (int64 each).
 *
 *   store_put   enters each id at the position the caller popped off the free stack
 *   store_take  finds each id; a found one leaves the index and its position goes back
 *               on the stack
 *   move_rows   copies rows between float32 arrays (pool <-> slots, rows and optimizer
 *               state alike), optionally zeroing the rows it read
 *
 * The numpy/torch steps of paged_rows.py are the reference and the fallback; these do
 * the same (tests/test_paged_store.py compares the two on the same calls). Which pool
 * position an id gets may differ, never its row, state, step or frequency.
 *
 * Why native: a dynamic table pages a few hundred to a few thousand rows in and out a
 * step, and the torch/numpy version spends it in ~30 small calls (docs/performance-log.md).
 */
#include "id_map.h"
#include "kernels.h"

PyDoc_STRVAR(store_put_doc,
             "store_put(table, size, salt, pos, pool_ids, pool_seen, pool_freq, ids, seen,\n"
             "          freq, n)\n--\n\n"
             "Enter n distinct ids that are absent (the caller's promise) at pool positions\n"
             "pos (the caller popped them off its free stack), with their last step seen\n"
             "and frequency. Returns how many of the index positions taken held a\n"
             "tombstone.");

static PyObject *py_store_put(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptable, salt, ppos, ppids, ppseen, ppfreq, pids, pseen, pfreq;
    long long size, n;
    if (!PyArg_ParseTuple(args, "KLKKKKKKKKL", &ptable, &size, &salt, &ppos, &ppids, &ppseen,
                          &ppfreq, &pids, &pseen, &pfreq, &n))
        return NULL;
    map_t m;
    if (map_init(&m, ptable, size, salt) < 0) return NULL;
    const int64_t *pos = PTR(const int64_t *, ppos);
    int64_t *pool_ids = PTR(int64_t *, ppids), *pool_seen = PTR(int64_t *, ppseen);
    int64_t *pool_freq = PTR(int64_t *, ppfreq);
    const int64_t *ids = PTR(const int64_t *, pids), *seen = PTR(const int64_t *, pseen);
    const int64_t *freq = PTR(const int64_t *, pfreq);
    int64_t reused = 0;
    for (int64_t i = 0; i < n; i++) {
        const int got = map_place(&m, ids[i], pos[i]);
        if (got < 0) {
            PyErr_SetString(PyExc_RuntimeError, "id map is full (load kept at most 1/2)");
            return NULL;
        }
        reused += got;
        pool_ids[pos[i]] = ids[i];
        pool_seen[pos[i]] = seen[i];
        pool_freq[pos[i]] = freq[i];
    }
    return PyLong_FromLongLong((long long)reused);
}

PyDoc_STRVAR(store_take_doc,
             "store_take(table, size, salt, free, n_free, pool_seen, pool_freq, ids, n, found,\n"
             "           pos_out, seen_out, freq_out)\n--\n\n"
             "For each of n distinct ids: found[i] (a byte) says whether it is in the index.\n"
             "The found ones, in order (k of them), get pos_out/seen_out/freq_out[j] = their\n"
             "position, last step seen and frequency, leave the index, and their positions\n"
             "go on the free stack at free[n_free .. n_free + k). Returns k.");

static PyObject *py_store_take(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptable, salt, pfree, ppseen, ppfreq, pids, pfound, ppos, pseen, pfreq;
    long long size, n_free, n;
    if (!PyArg_ParseTuple(args, "KLKKLKKKLKKKK", &ptable, &size, &salt, &pfree, &n_free,
                          &ppseen, &ppfreq, &pids, &n, &pfound, &ppos, &pseen, &pfreq))
        return NULL;
    map_t m;
    if (map_init(&m, ptable, size, salt) < 0) return NULL;
    int64_t *free_pos = PTR(int64_t *, pfree);
    const int64_t *pool_seen = PTR(const int64_t *, ppseen);
    const int64_t *pool_freq = PTR(const int64_t *, ppfreq);
    const int64_t *ids = PTR(const int64_t *, pids);
    uint8_t *found = PTR(uint8_t *, pfound);
    int64_t *pos_out = PTR(int64_t *, ppos), *seen_out = PTR(int64_t *, pseen);
    int64_t *freq_out = PTR(int64_t *, pfreq);
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t at = locate(&m, ids[i]);
        found[i] = at >= 0;
        if (at < 0) continue;
        const int64_t pos = map_value(&m, at);
        map_remove_at(&m, at);
        pos_out[k] = pos;
        seen_out[k] = pool_seen[pos];
        freq_out[k] = pool_freq[pos];
        free_pos[n_free + k] = pos;
        k++;
    }
    return PyLong_FromLongLong((long long)k);
}

/* One array's part of a move: rows src[src_idx[i]] -> dst[dst_idx[i]] (an index pointer
 * of 0: row i itself), `width` floats each; src_rows/dst_rows bound the indices. */
typedef struct {
    int64_t src, src_idx, src_rows, dst, dst_idx, dst_rows, width, zero_src;
} move_spec;

enum { MOVE_FIELDS = 8 };

static int64_t row_at(const int64_t *idx, int64_t i) { return idx ? idx[i] : i; }

PyDoc_STRVAR(move_rows_doc,
             "move_rows(specs, k, n)\n--\n\n"
             "specs: int64 [k, 8], per float32 array pair: src, src_idx, src_rows, dst,\n"
             "dst_idx, dst_rows, width, zero_src (pointers as integers; an index pointer of\n"
             "0 means row i). For i < n: dst row dst_idx[i] = src row src_idx[i]; then,\n"
             "where zero_src, the rows read are zeroed. Every index is checked against its\n"
             "array's rows before anything is written (IndexError naming it).");

static PyObject *py_move_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pspecs;
    long long k, n;
    if (!PyArg_ParseTuple(args, "KLL", &pspecs, &k, &n)) return NULL;
    const move_spec *specs = PTR(const move_spec *, pspecs);
    for (long long a = 0; a < k; a++) {
        const move_spec *s = &specs[a];
        const int64_t *src_idx = PTR(const int64_t *, s->src_idx);
        const int64_t *dst_idx = PTR(const int64_t *, s->dst_idx);
        for (int64_t i = 0; i < n; i++) {
            const int64_t from = row_at(src_idx, i), to = row_at(dst_idx, i);
            if ((uint64_t)from >= (uint64_t)s->src_rows ||
                (uint64_t)to >= (uint64_t)s->dst_rows) {
                PyErr_Format(PyExc_IndexError,
                             "move_rows: array pair %lld, item %lld: row %lld -> %lld is "
                             "outside [0, %lld) -> [0, %lld)",
                             a, (long long)i, (long long)from, (long long)to,
                             (long long)s->src_rows, (long long)s->dst_rows);
                return NULL;
            }
        }
    }
    for (long long a = 0; a < k; a++) {
        const move_spec *s = &specs[a];
        const int64_t *src_idx = PTR(const int64_t *, s->src_idx);
        const int64_t *dst_idx = PTR(const int64_t *, s->dst_idx);
        float *src = PTR(float *, s->src);
        float *dst = PTR(float *, s->dst);
        const size_t bytes = (size_t)s->width * sizeof(float);
        for (int64_t i = 0; i < n; i++) {
            float *from = src + row_at(src_idx, i) * s->width;
            memcpy(dst + row_at(dst_idx, i) * s->width, from, bytes);
            if (s->zero_src) memset(from, 0, bytes);
        }
    }
    Py_RETURN_NONE;
}

PyMethodDef hp_paged_store_methods[] = {
    {"store_put", py_store_put, METH_VARARGS, store_put_doc},
    {"store_take", py_store_take, METH_VARARGS, store_take_doc},
    {"move_rows", py_move_rows, METH_VARARGS, move_rows_doc},
    {NULL, NULL, 0, NULL},
};
