/*
 * The dynamic tables' per-id work (functions of hybridps.native._fused_adam, added at
 * import: see kernels.h): the id map's probes and the initial rows of new ids.
 *
 * The id map's probes, one id at a time, over the table hybridps/id_map.py owns (int64
 * [size, 2]: per position a key and a value, the value also the state: >= 0 full, -1
 * empty, -2 a removed entry's tombstone; id_map.h), the size a power of two. The numpy
 * batch probes there are the reference and the fallback; these loops follow the same
 * rules:
 *
 *   home(id)  = splitmix64(id ^ salt) >> (64 - log2(size))
 *   locate    probe home, home+1, ... (mod size): a full position with the key is found,
 *             an empty one ends the search (absent); tombstones are stepped over
 *   place     each id (distinct, absent: the caller says so) takes the first position
 *             from its home on that is not full
 *
 * What differs from the batch version is only which position an id lands on when
 * several ids of one batch reach the same free position (there: a claim round; here: the
 * earlier id). No caller depends on where an id sits, only on its value (the map's
 * tests check both versions against each other on the same operations).
 *
 * Why native: a dynamic table's owner probes a few thousand ids a step, each a handful
 * of numpy calls per probe round in the batch version (docs/performance-log.md).
 */
#include "dynamic.h"
#include "id_map.h"
#include "kernels.h"

#include <stdlib.h>

PyDoc_STRVAR(idmap_find_doc,
             "idmap_find(table, size, salt, ids, n, out, want_positions)\n--\n\n"
             "For each of the n int64 ids: out[i] = its value (want_positions 0) or its\n"
             "position (1), -1 where absent. Returns how many were present.");

static PyObject *py_idmap_find(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptable, salt, pids, pout;
    long long size, n;
    int want_positions;
    if (!PyArg_ParseTuple(args, "KLKKLKp", &ptable, &size, &salt, &pids, &n, &pout,
                          &want_positions))
        return NULL;
    map_t m;
    if (map_init(&m, ptable, size, salt) < 0) return NULL;
    const int64_t *ids = PTR(const int64_t *, pids);
    int64_t *out = PTR(int64_t *, pout);
    int64_t present = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n) map_prefetch(&m, ids[i + PROBE_AHEAD]);
        const int64_t pos = locate(&m, ids[i]);
        present += pos >= 0;
        out[i] = pos < 0 ? -1 : (want_positions ? pos : map_value(&m, pos));
    }
    return PyLong_FromLongLong((long long)present);
}

PyDoc_STRVAR(idmap_place_doc,
             "idmap_place(table, size, salt, ids, vals, n)\n--\n\n"
             "Put n distinct ids that are absent (the caller's promise: not checked) with\n"
             "their values, each on the first position from its home that is not full.\n"
             "The caller keeps the load low enough that every id finds one. Returns how\n"
             "many of the positions taken held a tombstone.");

static PyObject *py_idmap_place(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptable, salt, pids, pvals;
    long long size, n;
    if (!PyArg_ParseTuple(args, "KLKKKL", &ptable, &size, &salt, &pids, &pvals, &n))
        return NULL;
    map_t m;
    if (map_init(&m, ptable, size, salt) < 0) return NULL;
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t *vals = PTR(const int64_t *, pvals);
    int64_t reused = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n) map_prefetch(&m, ids[i + PROBE_AHEAD]);
        const int got = map_place(&m, ids[i], vals[i]);
        if (got < 0) {
            PyErr_SetString(PyExc_RuntimeError, "id map is full (load kept at most 1/2)");
            return NULL;
        }
        reused += got;
    }
    return PyLong_FromLongLong((long long)reused);
}

PyDoc_STRVAR(idmap_rehash_doc,
             "idmap_rehash(old, old_size, new, new_size, salt)\n--\n\n"
             "Put every entry of the table old (its full positions, in position order) into\n"
             "the empty table new, as idmap_place would with the entries listed in that\n"
             "order, without listing them. Returns how many.");

/* A rebuild (a larger table, or tombstones dropped) reads the old table once in position
 * order; the homes of its entries are nearly in order too (the top bits of the hash), so
 * the new table is written nearly in order. */
static PyObject *py_idmap_rehash(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pold, pnew, salt;
    long long old_size, new_size;
    if (!PyArg_ParseTuple(args, "KLKLK", &pold, &old_size, &pnew, &new_size, &salt))
        return NULL;
    map_t from, to;
    if (map_init(&from, pold, old_size, salt) < 0 || map_init(&to, pnew, new_size, salt) < 0)
        return NULL;
    int64_t count = 0;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS /* a prefetch's rebuild may take a while: the step goes on */
    for (int64_t pos = 0; pos < old_size; pos++) {
        const int64_t value = map_value(&from, pos);
        if (value < 0) continue;
        if (map_place(&to, from.entry[2 * pos], value) < 0) {
            full = 1;
            break;
        }
        count++;
    }
    Py_END_ALLOW_THREADS
    if (full) {
        PyErr_SetString(PyExc_RuntimeError, "id map is full (load kept at most 1/2)");
        return NULL;
    }
    return PyLong_FromLongLong((long long)count);
}

PyDoc_STRVAR(idmap_remove_doc,
             "idmap_remove(table, size, salt, ids, n, hit)\n--\n\n"
             "Remove the present ones of n distinct ids (their positions become tombstones);\n"
             "hit[i] (a byte) says whether ids[i] was present. Returns how many were.");

static PyObject *py_idmap_remove(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptable, salt, pids, phit;
    long long size, n;
    if (!PyArg_ParseTuple(args, "KLKKLK", &ptable, &size, &salt, &pids, &n, &phit))
        return NULL;
    map_t m;
    if (map_init(&m, ptable, size, salt) < 0) return NULL;
    const int64_t *ids = PTR(const int64_t *, pids);
    uint8_t *hit = PTR(uint8_t *, phit);
    int64_t removed = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n) map_prefetch(&m, ids[i + PROBE_AHEAD]);
        const int64_t pos = locate(&m, ids[i]);
        hit[i] = pos >= 0;
        if (pos >= 0) {
            map_remove_at(&m, pos);
            removed++;
        }
    }
    return PyLong_FromLongLong((long long)removed);
}

/*
 * Initial rows: hybridps/dynamic.py initial_rows op for op (its numpy version is the
 * reference and the fallback): per id, base = splitmix64(id ^ salt); per column c,
 * x = splitmix64(base + c + 1), the sum of x's four 16-bit parts, minus their mean
 * 2 * 65535, times `scale` in float64, rounded to float32. Integer sums and one correctly
 * rounded multiply: the numpy values bitwise (tests/test_dynamic_parts.py).
 */
void hp_initial_row(int64_t id, int64_t dim, uint64_t salt, double scale, float *row) {
    const uint64_t base = mix64((uint64_t)id ^ salt);
    for (int64_t c = 0; c < dim; c++) {
        const uint64_t x = mix64(base + (uint64_t)c + 1u);
        const int64_t sum = (int64_t)((x & 0xFFFFu) + ((x >> 16) & 0xFFFFu) +
                                      ((x >> 32) & 0xFFFFu) + (x >> 48));
        row[c] = (float)((double)(sum - 2 * 0xFFFF) * scale);
    }
}

PyDoc_STRVAR(initial_rows_doc,
             "initial_rows(ids, n, dim, salt, scale, out)\n--\n\n"
             "out (float32 [n, dim]) = the initial rows of the n int64 ids (see the comment\n"
             "above the function in dynamic.c).");

static PyObject *py_initial_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pids, salt, pout;
    long long n, dim;
    double scale;
    if (!PyArg_ParseTuple(args, "KLLKdK", &pids, &n, &dim, &salt, &scale, &pout)) return NULL;
    const int64_t *ids = PTR(const int64_t *, pids);
    float *out = PTR(float *, pout);
    for (int64_t i = 0; i < n; i++) hp_initial_row(ids[i], dim, (uint64_t)salt, scale, out + i * dim);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(first_seen_unique_doc,
             "first_seen_unique(ids, n, uniq, inverse)\n--\n\n"
             "The distinct values of the n int64 ids in the order of their first occurrence\n"
             "into uniq, and inverse (int64 [n]) with ids[i] == uniq[inverse[i]]. Returns how\n"
             "many are distinct.");

static PyObject *py_first_seen_unique(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pids, puniq, pinv;
    long long n;
    if (!PyArg_ParseTuple(args, "KLKK", &pids, &n, &puniq, &pinv)) return NULL;
    const int64_t *ids = PTR(const int64_t *, pids);
    int64_t *uniq = PTR(int64_t *, puniq);
    int64_t *inverse = PTR(int64_t *, pinv);
    int bits = 1;
    while ((1ll << bits) < 2 * n) bits++;
    const uint64_t mask = (1ull << bits) - 1;
    /* position -> 1 + index into uniq (0: empty) */
    int64_t *index = calloc((size_t)mask + 1, sizeof *index);
    if (index == NULL) return PyErr_NoMemory();
    int64_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        uint64_t pos = mix64((uint64_t)id) >> (64 - bits);
        while (index[pos] != 0 && uniq[index[pos] - 1] != id) pos = (pos + 1) & mask;
        if (index[pos] == 0) {
            uniq[count] = id;
            index[pos] = ++count;
        }
        inverse[i] = index[pos] - 1;
    }
    Py_END_ALLOW_THREADS
    free(index);
    return PyLong_FromLongLong((long long)count);
}

/* the eviction order: (key, slot), both ascending; all pairs distinct (slots are) */
typedef struct {
    int64_t key;
    int64_t slot;
} victim_t;

static ALWAYS_INLINE int victim_less(victim_t a, victim_t b) {
    return a.key < b.key || (a.key == b.key && a.slot < b.slot);
}

static int victim_cmp(const void *pa, const void *pb) {
    const victim_t a = *(const victim_t *)pa, b = *(const victim_t *)pb;
    return victim_less(a, b) ? -1 : (victim_less(b, a) ? 1 : 0);
}

/* put the k smallest of v[0, n) first (in any order): quickselect, median-of-three */
static void select_smallest(victim_t *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        victim_t a = v[lo], b = v[mid], c = v[hi];
        victim_t pivot = victim_less(a, b) ? (victim_less(b, c) ? b : (victim_less(a, c) ? c : a))
                                           : (victim_less(a, c) ? a : (victim_less(b, c) ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (victim_less(v[i], pivot)) i++;
            while (victim_less(pivot, v[j])) j--;
            if (i <= j) {
                const victim_t t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

static ALWAYS_INLINE int evictable(const int64_t *seen, const uint8_t *pinned, int64_t s,
                                    int64_t applied_through) {
    return !pinned[s] && seen[s] >= 0 && seen[s] <= applied_through;
}

static ALWAYS_INLINE int64_t victim_key(const int64_t *seen, const int64_t *freq, int64_t s,
                                        int lfu) {
    if (!lfu) return seen[s];
    const int64_t f = freq[s] < 0x7fffffffll ? freq[s] : 0x7fffffffll;
    return (int64_t)(((uint64_t)f << 32) | (uint64_t)seen[s]);
}

/* The k smallest (key, slot) when the keys span a short range (LRU's keys are recent
 * steps): a histogram of key - lo gives the key t of the k-th; then one pass over the
 * slots in order puts each slot with key < t, and the first ones with key t, at its place
 * in (key, slot) order. */
static int by_counting(const int64_t *seen, const int64_t *freq, const uint8_t *pinned,
                       int64_t n, int64_t applied_through, int lfu, int64_t lo, int64_t range,
                       int64_t k, int64_t *out) {
    int64_t *place = calloc((size_t)range, sizeof *place);
    if (place == NULL) return -1;
    for (int64_t s = 0; s < n; s++)
        if (evictable(seen, pinned, s, applied_through)) place[victim_key(seen, freq, s, lfu) - lo]++;
    int64_t t = 0, below = 0; /* counts -> first place of each key, up to the k-th's key t */
    for (;; t++) {
        const int64_t c = place[t];
        place[t] = below;
        below += c;
        if (below >= k) break;
    }
    for (int64_t s = 0; s < n; s++) {
        if (!evictable(seen, pinned, s, applied_through)) continue;
        const int64_t r = victim_key(seen, freq, s, lfu) - lo;
        if (r < t || (r == t && place[t] < k)) out[place[r]++] = s;
    }
    free(place);
    return 0;
}

/* The same by sorting (any range): quickselect, then the k sorted. */
static int by_sorting(const int64_t *seen, const int64_t *freq, const uint8_t *pinned,
                      int64_t n, int64_t applied_through, int lfu, int64_t m, int64_t k,
                      int64_t *out) {
    victim_t *cand = malloc((size_t)m * sizeof *cand);
    if (cand == NULL) return -1;
    int64_t j = 0;
    for (int64_t s = 0; s < n; s++) {
        if (!evictable(seen, pinned, s, applied_through)) continue;
        cand[j].key = victim_key(seen, freq, s, lfu);
        cand[j++].slot = s;
    }
    if (k < m) select_smallest(cand, m, k);
    qsort(cand, (size_t)k, sizeof *cand, victim_cmp);
    for (int64_t i = 0; i < k; i++) out[i] = cand[i].slot;
    free(cand);
    return 0;
}

int64_t hp_victims(const int64_t *seen, const int64_t *freq, int64_t n, int64_t applied_through,
                   const uint8_t *pinned, int lfu, int64_t count, int64_t *out) {
    if (count <= 0 || n <= 0) return 0;
    int64_t m = 0, lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t s = 0; s < n; s++) {
        if (!evictable(seen, pinned, s, applied_through)) continue;
        const int64_t key = victim_key(seen, freq, s, lfu);
        lo = key < lo ? key : lo;
        hi = key > hi ? key : hi;
        m++;
    }
    const int64_t k = count < m ? count : m;
    if (k <= 0) return 0;
    /* counting when the key range is at most a few times the slots (LRU: steps) */
    const uint64_t range = (uint64_t)hi - (uint64_t)lo + 1u;
    const int failed = range <= (uint64_t)(4 * m + 4096)
                           ? by_counting(seen, freq, pinned, n, applied_through, lfu, lo,
                                         (int64_t)range, k, out)
                           : by_sorting(seen, freq, pinned, n, applied_through, lfu, m, k, out);
    return failed ? -1 : k;
}

PyDoc_STRVAR(victims_doc,
             "victims(seen, freq, n, applied_through, pinned, n_pinned, lfu, count, out)\n--\n\n"
             "The slots a dynamic table evicts (worker/embedding/dynamic/slots.py _victims, whose numpy\n"
             "version is the reference): of the n slots with 0 <= seen <= applied_through and\n"
             "not among the n_pinned local slots `pinned` (-1 entries ignored), the `count`\n"
             "smallest by key (lru: seen; lfu: min(freq, 2^31 - 1) << 32 | seen), then slot,\n"
             "in that order, into out (int64). Returns how many (fewer when fewer qualify).");

static PyObject *py_victims(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pseen, pfreq, ppinned, pout;
    long long n, applied_through, n_pinned, count;
    int lfu;
    if (!PyArg_ParseTuple(args, "KKLLKLpLK", &pseen, &pfreq, &n, &applied_through, &ppinned,
                          &n_pinned, &lfu, &count, &pout))
        return NULL;
    const int64_t *seen = PTR(const int64_t *, pseen);
    const int64_t *freq = PTR(const int64_t *, pfreq);
    const int64_t *pins = PTR(const int64_t *, ppinned);
    int64_t *out = PTR(int64_t *, pout);
    if (count <= 0 || n <= 0) return PyLong_FromLong(0);
    uint8_t *pinned = calloc((size_t)n, 1);
    if (pinned == NULL) return PyErr_NoMemory();
    for (int64_t i = 0; i < n_pinned; i++)
        if (pins[i] >= 0 && pins[i] < n) pinned[pins[i]] = 1;
    const int64_t k = hp_victims(seen, freq, n, applied_through, pinned, lfu, count, out);
    free(pinned);
    if (k < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong((long long)k);
}

PyMethodDef hp_dynamic_methods[] = {
    {"first_seen_unique", py_first_seen_unique, METH_VARARGS, first_seen_unique_doc},
    {"victims", py_victims, METH_VARARGS, victims_doc},
    {"initial_rows", py_initial_rows, METH_VARARGS, initial_rows_doc},
    {"idmap_find", py_idmap_find, METH_VARARGS, idmap_find_doc},
    {"idmap_place", py_idmap_place, METH_VARARGS, idmap_place_doc},
    {"idmap_remove", py_idmap_remove, METH_VARARGS, idmap_remove_doc},
    {"idmap_rehash", py_idmap_rehash, METH_VARARGS, idmap_rehash_doc},
    {NULL, NULL, 0, NULL},
};
