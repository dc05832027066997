/*
 * A dynamic table's step at its owner, fused (a function of hybridps.native._fused_adam,
 * added at import: see kernels.h), for an owner whose paged store is in-process (the
 * local optimizer): worker/embedding/dynamic/slots.py SlotTable.translate, the row moves of
 * worker/embedding/dynamic/ids.py and the store's swap (hybridps/paged_rows.py), in one pass.
 * Those Python steps are the reference (and the path for a store behind a server); the
 * tests run both on the same streams and compare every array bitwise
 * (tests/test_dynamic_fused.py).
 *
 * For the U distinct ids of a step, in order:
 *   1. an id on a slot is a hit; a miss is paged (its id is in the store's index, which
 *      is the slot table's set of paged ids: SlotTable.share_paged) or new;
 *      a new id the admission filter refused (refused[i], computed by the caller) or
 *      that finds no slot gets code -1;
 *   2. the wanted misses (paged, and admitted new ones, in batch order) take the free
 *      slots lowest first, then the victims, the hits pinned: LRU's from the head of a
 *      queue of (seen, slot) records kept in that order (`lru_victims`: a step costs its
 *      own ids, not a scan of every slot), LFU's by dynamic.c hp_victims;
 *   3. each victim's row and optimizer state go to the store (state zeroed on the slot),
 *      its id leaves the slot map and enters the store's index;
 *   4. a paged id's row and state come back from the store onto its slot (freq: the
 *      stored one + 1);
 *   5. a new id gets its initial row (dynamic.c hp_initial_row), freq 1;
 *   6. placed ids enter the slot map; every looked-up slot gets seen = step; a hit's
 *      freq grows by one (capped at 2^31 - 1).
 *
 * The caller reserves room beforehand (the maps at most half full after U more
 * entries; U free positions in the store) and does the counts' bookkeeping with what
 * `counts` returns. Optimizer state and rows are float32 and contiguous on the CPU.
 *
 * Why fused: at a few hundred ids a step, the Python version's cost is its ~100 small
 * numpy/torch calls, not the work (docs/performance-log.md).
 */
#include "dynamic.h"
#include "id_map.h"
#include "kernels.h"

#include <stdlib.h>

#define LFU_FREQ_CAP 0x7fffffffll

enum {
    C_HITS,
    C_REFUSED_FILTER,
    C_REFUSED_CAPACITY,
    C_EVICTIONS,
    C_PAGE_INS,
    C_ADMISSIONS,
    C_TOOK_FREE,
    C_SLOT_REUSED,
    C_STORE_REUSED,
    C_COUNTS
};

enum { MAX_BUFS = 17 }; /* serve_step takes 17 arrays at most */

typedef struct {
    Py_buffer views[MAX_BUFS];
    int held;
} bufs_t;

static void release_all(bufs_t *b) {
    for (int i = 0; i < b->held; i++) PyBuffer_Release(&b->views[i]);
    b->held = 0;
}

/* A writable C-contiguous buffer of `obj` with items of `itemsize` bytes; its item count
 * into *len. NULL (TypeError/ValueError naming `name`) otherwise. */
static void *grab(bufs_t *b, PyObject *obj, Py_ssize_t itemsize, const char *name,
                  int64_t *len) {
    if (b->held == MAX_BUFS) {
        PyErr_SetString(PyExc_RuntimeError, "serve_step: too many arrays");
        return NULL;
    }
    Py_buffer *v = &b->views[b->held];
    if (PyObject_GetBuffer(obj, v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    b->held++;
    if (v->itemsize != itemsize && !(v->len == 0)) {
        PyErr_Format(PyExc_ValueError, "serve_step: %s has items of %zd bytes, not %zd", name,
                     v->itemsize, itemsize);
        return NULL;
    }
    *len = (int64_t)(v->len / itemsize);
    return v->buf;
}

/* an id map's table: int64 [size, 2] (id_map.h) */
static int grab_map(bufs_t *b, PyObject *table, uint64_t salt, const char *name, map_t *m) {
    int64_t items;
    void *p = grab(b, table, 8, name, &items);
    if (p == NULL) return -1;
    return map_init(m, (uintptr_t)p, (long long)(items / 2), salt);
}

/* One row array: slot rows, pool rows, width (floats). */
typedef struct {
    int64_t slots, pool, width;
} row_pair;

/* LRU victims from the queue of (seen, slot) records, in (seen, slot) order: a record is
 * stale once its slot was looked up again or reassigned (seen[slot] differs); the live
 * ones are exactly the used slots, each once, so the first `want` live, evictable and
 * unpinned records are the victims hp_victims would pick. Records taken, stale or pinned
 * (those get a new record this step) leave the queue's head. */
static int64_t lru_victims(const int64_t *lru, long long *head, long long tail,
                           const int64_t *seen, const uint8_t *pinned, int64_t applied_through,
                           int64_t want, int64_t *out) {
    int64_t k = 0;
    long long h = *head;
    while (k < want && h < tail) {
        const int64_t rec_seen = lru[2 * h], slot = lru[2 * h + 1];
        if (seen[slot] != rec_seen) { /* stale */
            h++;
            continue;
        }
        if (rec_seen > applied_through) break; /* this and every later record: too new */
        h++;
        if (!pinned[slot]) out[k++] = slot;
    }
    *head = h;
    return k;
}

/* Sort k slots (each in [0, n)) ascending: LSD radix, 11 bits a pass, as few passes as
 * n needs (linear in k); tmp holds k. */
static void sort_slots(int64_t *slots, int64_t *tmp, int64_t k, int64_t n) {
    enum { BITS = 11, BUCKETS = 1 << BITS };
    int64_t count[BUCKETS];
    for (int shift = 0; shift < 63 && (n - 1) >> shift; shift += BITS) {
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < k; i++) count[(slots[i] >> shift) & (BUCKETS - 1)]++;
        int64_t at = 0;
        for (int b = 0; b < BUCKETS; b++) {
            const int64_t c = count[b];
            count[b] = at;
            at += c;
        }
        for (int64_t i = 0; i < k; i++) tmp[count[(slots[i] >> shift) & (BUCKETS - 1)]++] = slots[i];
        memcpy(slots, tmp, (size_t)k * sizeof *slots);
    }
}

/* How far ahead the step's loops fetch into the cache: an id's map entries MAPS_AHEAD
 * ids ahead, the rows of every array pair ROWS_AHEAD moves ahead, and a victim's slot
 * entries (slot_id, seen, freq) 2 * MAPS_AHEAD ahead, so that its id is in the cache when
 * its map entries are fetched (without that, reading the id to fetch its map entries
 * stalled on a cache miss of its own). Chosen by measurement at a million slots
 * (docs/performance-log.md). */
#define MAPS_AHEAD 16
#define ROWS_AHEAD 16

static ALWAYS_INLINE void prefetch_rows(const row_pair *pairs, int64_t n_pairs, int64_t slot,
                                        int64_t pos) {
    for (int64_t a = 0; a < n_pairs; a++) {
        const int64_t w = pairs[a].width;
        prefetch_row_l1(PTR(const float *, pairs[a].slots) + slot * w, w);
        prefetch_row_l1(PTR(const float *, pairs[a].pool) + pos * w, w);
    }
}

/* An id's entries in both maps into the cache ahead of its probes. */
static ALWAYS_INLINE void prefetch_maps(const map_t *store_map, const map_t *slot_map,
                                        int64_t id) {
    map_prefetch(store_map, id);
    map_prefetch(slot_map, id);
}

/* the slot of the j-th placed id: the free ones first, then the victims */
static ALWAYS_INLINE int64_t slot_at(int64_t j, int64_t took_free, const int64_t *free_slots,
                                     const int64_t *victims) {
    return j < took_free ? free_slots[j] : victims[j - took_free];
}

PyDoc_STRVAR(serve_step_doc,
             "serve_step(ids, refused, codes, slot_map, slot_id, pinned, seen, freq, free,\n"
             "           n_free, store_map, store_free, store_n_free, store_ids, store_seen,\n"
             "           store_freq, row_pairs, start, step, applied_through, lfu, map_salt,\n"
             "           init_salt, init_scale, counts, lru, lru_head, lru_tail)\n--\n\n"
             "One step of a dynamic table at its owner with an in-process store (see the\n"
             "comment at the top of dynamic_step.c). Maps are their int64 [size, 2]\n"
             "tables (id_map.h); row_pairs: int64 [k, 3] of (slot array pointer, pool array pointer,\n"
             "width), the rows first, then each optimizer state array. pinned: uint8 [slots],\n"
             "all zero (and left so). codes (int64 [U]) gets\n"
             "each id's global slot or -1; counts (int64 [9]) what the caller books. lru:\n"
             "the LRU queue (int64 [cap, 2] of (seen, slot), records [lru_head, lru_tail),\n"
             "room for U more) or None (the victims by a scan of every slot). Returns\n"
             "(store_n_free, lru_head, lru_tail) after the step.");

static PyObject *py_serve_step(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_ids, *o_refused, *o_codes, *o_slot_map, *o_slot_id, *o_pinned, *o_seen,
        *o_freq, *o_free, *o_store_map, *o_store_free, *o_store_ids, *o_store_seen,
        *o_store_freq, *o_pairs, *o_counts, *o_lru;
    long long n_free, store_n_free, start, step, applied_through, lru_head, lru_tail;
    int lfu;
    unsigned long long map_salt, init_salt;
    double init_scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOLOOLOOOOLLLpKKdOOLL", &o_ids, &o_refused, &o_codes,
                          &o_slot_map, &o_slot_id, &o_pinned, &o_seen, &o_freq, &o_free,
                          &n_free, &o_store_map, &o_store_free, &store_n_free, &o_store_ids,
                          &o_store_seen, &o_store_freq, &o_pairs, &start, &step,
                          &applied_through, &lfu, &map_salt, &init_salt, &init_scale,
                          &o_counts, &o_lru, &lru_head, &lru_tail))
        return NULL;
    bufs_t b = {.held = 0};
    PyObject *result = NULL;
    int64_t *want = NULL, *victims = NULL, *local = NULL;
    int64_t u, nr = 0, nc, n, n1, n2, n3, nf, nsf, nsi, nss, nsq, np_, ncounts;
    map_t slot_map, store_map;
    const int64_t *ids = grab(&b, o_ids, 8, "ids", &u);
    if (ids == NULL) goto done;
    const uint8_t *refused = NULL;
    if (o_refused != Py_None && (refused = grab(&b, o_refused, 1, "refused", &nr)) == NULL)
        goto done;
    int64_t *codes = grab(&b, o_codes, 8, "codes", &nc);
    if (codes == NULL) goto done;
    if (grab_map(&b, o_slot_map, map_salt, "slot map", &slot_map) < 0) goto done;
    int64_t *slot_id = grab(&b, o_slot_id, 8, "slot_id", &n);
    uint8_t *pinned = slot_id ? grab(&b, o_pinned, 1, "pinned", &n1) : NULL;
    int64_t *seen = pinned ? grab(&b, o_seen, 8, "seen", &n2) : NULL;
    int64_t *freq = seen ? grab(&b, o_freq, 8, "freq", &n3) : NULL;
    const int64_t *free_slots = freq ? grab(&b, o_free, 8, "free", &nf) : NULL;
    if (free_slots == NULL) goto done;
    if (grab_map(&b, o_store_map, map_salt, "store index", &store_map) < 0) goto done;
    int64_t *store_free = grab(&b, o_store_free, 8, "store free", &nsf);
    int64_t *store_ids = store_free ? grab(&b, o_store_ids, 8, "store ids", &nsi) : NULL;
    int64_t *store_seen = store_ids ? grab(&b, o_store_seen, 8, "store seen", &nss) : NULL;
    int64_t *store_freq = store_seen ? grab(&b, o_store_freq, 8, "store freq", &nsq) : NULL;
    const row_pair *pairs = store_freq ? grab(&b, o_pairs, 8, "row_pairs", &np_) : NULL;
    int64_t *counts = pairs ? grab(&b, o_counts, 8, "counts", &ncounts) : NULL;
    if (counts == NULL) goto done;
    int64_t *lru = NULL, n_lru = 0;
    if (o_lru != Py_None && (lru = grab(&b, o_lru, 8, "lru queue", &n_lru)) == NULL) goto done;
    const int64_t n_pairs = np_ / 3;
    if ((refused && nr != u) || nc != u || n1 != n || n2 != n || n3 != n || n_free > nf || n_free < 0 ||
        nsi != nsf || nss != nsf || nsq != nsf || store_n_free < u || store_n_free > nsf ||
        n_pairs < 1 || ncounts < C_COUNTS ||
        (lru && (lru_head < 0 || lru_head > lru_tail || lru_tail + u > n_lru / 2))) {
        PyErr_SetString(PyExc_ValueError, "serve_step: inconsistent sizes");
        goto done;
    }
    /* The work runs without the GIL (a background thread may translate the next step's
     * ids meanwhile: the caller keeps every array above untouched until it returns);
     * a failure is raised once the GIL is back. */
    PyObject *fail_type = NULL;
    const char *fail_msg = NULL;
#define FAIL(type, msg)    \
    do {                   \
        fail_type = (type); \
        fail_msg = (msg);  \
        goto released;     \
    } while (0)
    Py_BEGIN_ALLOW_THREADS
    memset(counts, 0, C_COUNTS * sizeof *counts);
    const int64_t dim = pairs[0].width;

    want = malloc((size_t)(u ? u : 1) * sizeof *want);
    local = malloc((size_t)(u ? u : 1) * sizeof *local);
    if (want == NULL || local == NULL) {
        FAIL(PyExc_MemoryError, "serve_step: out of memory");
    }
    /* 1. hits, paged and new ids; the wanted misses in batch order */
    int64_t n_want = 0;
    for (int64_t i = 0; i < u; i++) {
        if (i + MAPS_AHEAD < u) prefetch_maps(&store_map, &slot_map, ids[i + MAPS_AHEAD]);
        const int64_t at = locate(&slot_map, ids[i]);
        local[i] = at < 0 ? -1 : map_value(&slot_map, at);
        codes[i] = -1;
        if (local[i] >= 0) {
            counts[C_HITS]++;
            pinned[local[i]] = 1;
            continue;
        }
        if (refused && refused[i] && locate(&store_map, ids[i]) < 0) {
            counts[C_REFUSED_FILTER]++;
            continue;
        }
        want[n_want++] = i;
    }
    /* 2. free slots lowest first, then victims */
    const int64_t took_free = n_want < n_free ? n_want : n_free;
    int64_t n_out = 0;
    if (n_want > took_free) {
        victims = malloc((size_t)(n_want - took_free) * sizeof *victims);
        if (victims == NULL) {
            FAIL(PyExc_MemoryError, "serve_step: out of memory");
        }
        n_out = lru ? lru_victims(lru, &lru_head, lru_tail, seen, pinned, applied_through,
                                  n_want - took_free, victims)
                    : hp_victims(seen, freq, n, applied_through, pinned, lfu, n_want - took_free,
                                 victims);
        if (n_out < 0) {
            FAIL(PyExc_MemoryError, "serve_step: out of memory");
        }
    }
    const int64_t placed = took_free + n_out;
    for (int64_t a = 0; a < n_pairs; a++)
        if (pairs[a].slots == 0 || pairs[a].pool == 0 || pairs[a].width < 1) {
            FAIL(PyExc_ValueError, "serve_step: a row pair without arrays");
        }
    /* 3. victims out: rows and state to the store, the id from the slot map to the
     *    store's index (before any slot is written: the paged ids below may land on
     *    victims) */
    for (int64_t j = 0; j < n_out; j++) {
        if (j + 2 * MAPS_AHEAD < n_out) {
            const int64_t later = victims[j + 2 * MAPS_AHEAD];
            PREFETCH_L1(slot_id + later);
            PREFETCH_L1(seen + later);
            PREFETCH_L1(freq + later);
        }
        if (j + MAPS_AHEAD < n_out)
            prefetch_maps(&store_map, &slot_map, slot_id[victims[j + MAPS_AHEAD]]);
        if (j + ROWS_AHEAD < n_out)
            prefetch_rows(pairs, n_pairs, victims[j + ROWS_AHEAD],
                          store_free[store_n_free - 1 - ROWS_AHEAD]);
        const int64_t v = victims[j], id = slot_id[v];
        const int64_t pos = store_free[--store_n_free];
        const int reused = map_place(&store_map, id, pos);
        if (reused < 0) {
            FAIL(PyExc_RuntimeError, "serve_step: the store's index is full");
        }
        counts[C_STORE_REUSED] += reused;
        store_ids[pos] = id;
        store_seen[pos] = seen[v];
        store_freq[pos] = freq[v];
        for (int64_t a = 0; a < n_pairs; a++) {
            float *slot_rows = PTR(float *, pairs[a].slots);
            float *pool_rows = PTR(float *, pairs[a].pool);
            const int64_t w = pairs[a].width;
            memcpy(pool_rows + pos * w, slot_rows + v * w, (size_t)w * sizeof(float));
            if (a > 0) memset(slot_rows + v * w, 0, (size_t)w * sizeof(float));
        }
        const int64_t at = locate(&slot_map, id);
        if (at >= 0) map_remove_at(&slot_map, at);
    }
    counts[C_EVICTIONS] = n_out;
    /* 4-6. the placed ids onto their slots: first the maps (where each row comes from:
     *    a store position, or -1 for an initial row), then the rows, prefetched ahead
     *    (no put follows, so the positions taken keep their rows until copied) */
    int64_t *from = want; /* reused: want[j] is read before from[j] is written */
    for (int64_t j = 0; j < placed; j++) {
        if (j + MAPS_AHEAD < placed)
            prefetch_maps(&store_map, &slot_map, ids[want[j + MAPS_AHEAD]]);
        const int64_t i = want[j], id = ids[i];
        const int64_t slot = slot_at(j, took_free, free_slots, victims);
        int64_t pos = -1;
        const int64_t at = locate(&store_map, id);
        if (at >= 0) {
            pos = map_value(&store_map, at);
            map_remove_at(&store_map, at);
            store_free[store_n_free++] = pos;
            counts[C_PAGE_INS]++;
        } else {
            counts[C_ADMISSIONS]++;
        }
        const int64_t f = pos >= 0 ? store_freq[pos] + 1 : 1;
        freq[slot] = f < LFU_FREQ_CAP ? f : LFU_FREQ_CAP;
        const int reused = map_place(&slot_map, id, slot);
        if (reused < 0) {
            FAIL(PyExc_RuntimeError, "serve_step: the slot map is full");
        }
        counts[C_SLOT_REUSED] += reused;
        slot_id[slot] = id;
        seen[slot] = step;
        codes[i] = slot + start;
        from[j] = pos;
    }
    float *weight = PTR(float *, pairs[0].slots);
    for (int64_t j = 0; j < placed; j++) {
        if (j + ROWS_AHEAD < placed && from[j + ROWS_AHEAD] >= 0)
            prefetch_rows(pairs, n_pairs, slot_at(j + ROWS_AHEAD, took_free, free_slots, victims),
                          from[j + ROWS_AHEAD]);
        const int64_t slot = slot_at(j, took_free, free_slots, victims), pos = from[j];
        if (pos < 0) {
            hp_initial_row(slot_id[slot], dim, (uint64_t)init_salt, init_scale,
                           weight + slot * dim);
            continue;
        }
        for (int64_t a = 0; a < n_pairs; a++) {
            float *slot_rows = PTR(float *, pairs[a].slots);
            const float *pool_rows = PTR(const float *, pairs[a].pool);
            const int64_t w = pairs[a].width;
            memcpy(slot_rows + slot * w, pool_rows + pos * w, (size_t)w * sizeof(float));
        }
    }
    for (int64_t i = 0; i < u; i++) {
        const int64_t s = local[i];
        if (s < 0) continue;
        pinned[s] = 0;
        seen[s] = step;
        freq[s] = freq[s] + 1 < LFU_FREQ_CAP ? freq[s] + 1 : LFU_FREQ_CAP;
        codes[i] = s + start;
    }
    counts[C_REFUSED_CAPACITY] = n_want - placed;
    counts[C_TOOK_FREE] = took_free;
    if (lru) { /* every slot looked up this step, by slot, at the queue's end */
        int64_t *touched = want, n_touched = 0; /* want/from: no longer needed */
        for (int64_t i = 0; i < u; i++)
            if (codes[i] >= 0) touched[n_touched++] = codes[i] - start;
        sort_slots(touched, local, n_touched, n); /* local: no longer needed either */
        for (int64_t j = 0; j < n_touched; j++) {
            lru[2 * lru_tail] = step;
            lru[2 * lru_tail + 1] = touched[j];
            lru_tail++;
        }
    }
released:;
    Py_END_ALLOW_THREADS
#undef FAIL
    if (fail_type != NULL) {
        PyErr_SetString(fail_type, fail_msg);
        goto done;
    }
    result = Py_BuildValue("LLL", (long long)store_n_free, lru_head, lru_tail);
done:
    if (result == NULL && pinned != NULL) memset(pinned, 0, (size_t)n1); /* all zero again */
    free(want);
    free(local);
    free(victims);
    release_all(&b);
    return result;
}

PyDoc_STRVAR(lru_compact_doc,
             "lru_compact(records, head, tail, seen) -> tail\n--\n\n"
             "Move the live records of [head, tail) of the LRU queue (int64 [size, 2] of\n"
             "(seen, slot); live: seen[slot] equals the record's) to its start, in order, in\n"
             "place; returns their count (worker/embedding/dynamic/slots.py LruQueue).");

static PyObject *py_lru_compact(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_records, *o_seen;
    long long head, tail;
    if (!PyArg_ParseTuple(args, "OLLO", &o_records, &head, &tail, &o_seen)) return NULL;
    bufs_t b = {.held = 0};
    int64_t n_records, n;
    int64_t *records = grab(&b, o_records, 8, "records", &n_records);
    const int64_t *seen = records ? grab(&b, o_seen, 8, "seen", &n) : NULL;
    if (seen == NULL) {
        release_all(&b);
        return NULL;
    }
    if (head < 0 || head > tail || 2 * tail > n_records) {
        release_all(&b);
        PyErr_SetString(PyExc_ValueError, "lru_compact: [head, tail) is not in the queue");
        return NULL;
    }
    int64_t kept = 0;
    for (int64_t h = head; h < tail; h++) {
        if (h + 2 * MAPS_AHEAD < tail) {
            const int64_t later = records[2 * (h + 2 * MAPS_AHEAD) + 1];
            if (later >= 0 && later < n) PREFETCH_L1(seen + later);
        }
        const int64_t rec_seen = records[2 * h], slot = records[2 * h + 1];
        if (slot < 0 || slot >= n || seen[slot] != rec_seen) continue; /* stale */
        records[2 * kept] = rec_seen;
        records[2 * kept + 1] = slot;
        kept++;
    }
    release_all(&b);
    return PyLong_FromLongLong((long long)kept);
}

PyMethodDef hp_dynamic_step_methods[] = {
    {"serve_step", py_serve_step, METH_VARARGS, serve_step_doc},
    {"lru_compact", py_lru_compact, METH_VARARGS, lru_compact_doc},
    {NULL, NULL, 0, NULL},
};
