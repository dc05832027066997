/*
 * The id map's arrays and probes, shared by dynamic.c (its find/place/remove calls) and
 * paged_store.c (the paged store's index): see dynamic.c's comment for the rules.
 */
#ifndef HYBRIDPS_NATIVE_ID_MAP_H
#define HYBRIDPS_NATIVE_ID_MAP_H

#include "kernels.h"

enum { SLOT_EMPTY = 0, SLOT_FULL = 1, SLOT_GONE = 2 };

static ALWAYS_INLINE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct {
    int64_t *keys;
    int64_t *values;
    uint8_t *state;
    uint64_t mask;
    int shift;
    uint64_t salt;
} map_t;

/* size must be a power of two >= 2 (checked: ValueError otherwise) */
static inline int map_init(map_t *m, unsigned long long pkeys, unsigned long long pvalues,
                    unsigned long long pstate, long long size, unsigned long long salt) {
    if (size < 2 || (size & (size - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "id map size %lld is not a power of two >= 2", size);
        return -1;
    }
    int bits = 0;
    while ((1ll << bits) < size) bits++;
    m->keys = PTR(int64_t *, pkeys);
    m->values = PTR(int64_t *, pvalues);
    m->state = PTR(uint8_t *, pstate);
    m->mask = (uint64_t)size - 1;
    m->shift = 64 - bits;
    m->salt = (uint64_t)salt;
    return 0;
}

static ALWAYS_INLINE uint64_t home(const map_t *m, int64_t id) {
    return mix64((uint64_t)id ^ m->salt) >> m->shift;
}

/* the position of id, -1 when absent */
static ALWAYS_INLINE int64_t locate(const map_t *m, int64_t id) {
    uint64_t pos = home(m, id);
    for (uint64_t probes = 0; probes <= m->mask; probes++) {
        const uint8_t st = m->state[pos];
        if (st == SLOT_EMPTY) return -1;
        if (st == SLOT_FULL && m->keys[pos] == id) return (int64_t)pos;
        pos = (pos + 1) & m->mask;
    }
    return -1; /* no empty position at all (the Python side keeps the load at most 1/2) */
}

/* Put id (absent: the caller's promise) with its value on the first position from its
 * home that is not full; returns 1 when that position held a tombstone, 0 when it was
 * empty, -1 when every position is full (the caller keeps the load at most 1/2). */
static ALWAYS_INLINE int map_place(map_t *m, int64_t id, int64_t value) {
    uint64_t pos = home(m, id);
    uint64_t probes = 0;
    while (m->state[pos] == SLOT_FULL && probes++ <= m->mask) pos = (pos + 1) & m->mask;
    if (m->state[pos] == SLOT_FULL) return -1;
    const int reused = m->state[pos] == SLOT_GONE;
    m->state[pos] = SLOT_FULL;
    m->keys[pos] = id;
    m->values[pos] = value;
    return reused;
}

#endif
