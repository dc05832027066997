/*
 * The id map's table and probes, shared by dynamic.c (its find/place/remove calls) and
 * dynamic_step.c (the slot map and the paged store's index): see dynamic.c's comment for
 * the rules. The table is hybridps/id_map.py's: int64 [size, 2], per position its key
 * and its value, the value also saying the position's state (>= 0: full; MAP_EMPTY;
 * MAP_GONE: a removed entry's tombstone). A probe reads one 16-byte entry: one cache
 * line for a probe run of up to four positions.
 */
#ifndef HYBRIDPS_NATIVE_ID_MAP_H
#define HYBRIDPS_NATIVE_ID_MAP_H

#include "kernels.h"

#define MAP_EMPTY (-1)
#define MAP_GONE (-2)

static ALWAYS_INLINE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct {
    int64_t *entry; /* [size][2]: key, value */
    uint64_t mask;
    int shift;
    uint64_t salt;
} map_t;

/* size must be a power of two >= 2 (checked: ValueError otherwise) */
static inline int map_init(map_t *m, unsigned long long ptable, long long size,
                           unsigned long long salt) {
    if (size < 2 || (size & (size - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "id map size %lld is not a power of two >= 2", size);
        return -1;
    }
    int bits = 0;
    while ((1ll << bits) < size) bits++;
    m->entry = PTR(int64_t *, ptable);
    m->mask = (uint64_t)size - 1;
    m->shift = 64 - bits;
    m->salt = (uint64_t)salt;
    return 0;
}

static ALWAYS_INLINE uint64_t home(const map_t *m, int64_t id) {
    return mix64((uint64_t)id ^ m->salt) >> m->shift;
}

/* Batch loops fetch the home entry of the id this far ahead into the cache, so that the
 * probes' cache misses overlap instead of following one another. */
#define PROBE_AHEAD 8

/* Fetch id's home entry into the cache ahead of its probe. */
static ALWAYS_INLINE void map_prefetch(const map_t *m, int64_t id) {
    PREFETCH_L1(m->entry + 2 * home(m, id));
}

static ALWAYS_INLINE int64_t map_value(const map_t *m, int64_t pos) {
    return m->entry[2 * pos + 1];
}

static ALWAYS_INLINE void map_remove_at(map_t *m, int64_t pos) {
    m->entry[2 * pos + 1] = MAP_GONE;
}

/* the position of id, -1 when absent */
static ALWAYS_INLINE int64_t locate(const map_t *m, int64_t id) {
    uint64_t pos = home(m, id);
    for (uint64_t probes = 0; probes <= m->mask; probes++) {
        const int64_t *e = m->entry + 2 * pos;
        if (e[1] == MAP_EMPTY) return -1;
        if (e[1] >= 0 && e[0] == id) return (int64_t)pos;
        pos = (pos + 1) & m->mask;
    }
    return -1; /* no empty position at all (the Python side keeps the load at most 1/2) */
}

/* Put id (absent: the caller's promise) with its value (>= 0) on the first position from
 * its home that is not full; returns 1 when that position held a tombstone, 0 when it
 * was empty, -1 when every position is full (the caller keeps the load at most 1/2). */
static ALWAYS_INLINE int map_place(map_t *m, int64_t id, int64_t value) {
    uint64_t pos = home(m, id);
    uint64_t probes = 0;
    while (m->entry[2 * pos + 1] >= 0 && probes++ <= m->mask) pos = (pos + 1) & m->mask;
    int64_t *e = m->entry + 2 * pos;
    if (e[1] >= 0) return -1;
    const int reused = e[1] == MAP_GONE;
    e[0] = id;
    e[1] = value;
    return reused;
}

#endif
