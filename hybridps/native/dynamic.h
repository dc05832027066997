/*
 * dynamic.c's per-id pieces that dynamic_step.c's fused step reuses.
 */
#ifndef HYBRIDPS_NATIVE_DYNAMIC_H
#define HYBRIDPS_NATIVE_DYNAMIC_H

#include <stdint.h>

/* row (float32 [dim]) = the initial row of id (dynamic.c's comment above initial_rows) */
void hp_initial_row(int64_t id, int64_t dim, uint64_t salt, double scale, float *row);

/* The `count` slots to evict, in eviction order, into out (victims' rules: dynamic.c);
 * pinned: a byte per slot, 1 = looked up this step. Returns how many, -1 out of memory. */
int64_t hp_victims(const int64_t *seen, const int64_t *freq, int64_t n, int64_t applied_through,
                   const uint8_t *pinned, int lfu, int64_t count, int64_t *out);

#endif
