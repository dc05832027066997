/*
 * What the native row kernels share (hybridps/native/fused_adam.c, row_optim.c): the
 * compiler macros, the software prefetch of random rows, the id check, the non-finite
 * flag, and the thread pool that fused_adam.c runs (hp_run_parallel). fused_adam.c's
 * comment says why each is as it is. The pooled-bags extension (pooled_bags.c) uses the
 * compiler macros only; it is built apart and calls nothing declared here.
 */
#ifndef HYBRIDPS_NATIVE_KERNELS_H
#define HYBRIDPS_NATIVE_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Prefetch the rows about this many bytes (per array) ahead into L1: 8 rows at dim 64. */
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif
/* ... and this many bytes ahead into L2 only: 32 rows at dim 64. */
#ifndef PF_FAR_BYTES
#define PF_FAR_BYTES 8192
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_L1(p) __builtin_prefetch((p), 1, 3)
/* Read intent for the L2 stage: with write intent a target that has PREFETCHW
 * would emit it, and it fetches into L1, not L2. */
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 1)
#define RESTRICT __restrict__
/* A function that only prefetches has no visible effect, so GCC's IPA may mark it
 * const and drop the call before inlining it (it did: no prefetch was left in the
 * binary); forced early inlining keeps the prefetches in the row loops. */
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PREFETCH_L1(p) ((void)0)
#define PREFETCH_L2(p) ((void)0)
#define RESTRICT
#define ALWAYS_INLINE inline
#endif

/* setup.py defines HYBRIDPS_TARGET_CLONES when the compiler and libc support
 * function multiversioning: the loops then also get an AVX2 build, picked at load time
 * by the CPU's feature flags (not by its model: "arch=haswell" is chosen on Haswell
 * cores only, never on later Intel or on AMD ones). The results are the same in both
 * builds: FMA contraction stays off, the loops are element-wise (no reassociated
 * sums), and fmaf() is exactly rounded everywhere. */
#if defined(HYBRIDPS_TARGET_CLONES)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#define CLONES "avx2,default"
#else
#define MULTIVERSION
#define CLONES "default"
#endif

typedef struct {
    int64_t near, far; /* rows ahead: into L1, into L2 */
} pf_dist;

static inline pf_dist prefetch_dist(int64_t dim) {
    const int64_t row_bytes = dim * (int64_t)sizeof(float);
    int64_t near = PF_BYTES / row_bytes, far = PF_FAR_BYTES / row_bytes;
    if (near < 2) near = 2;
    if (far < 2 * near) far = 2 * near;
    return (pf_dist){near, far};
}

static ALWAYS_INLINE void prefetch_row_l1(const float *row, int64_t dim) {
    const char *p = (const char *)row;
    const int64_t bytes = dim * (int64_t)sizeof(float);
    for (int64_t off = 0; off < bytes; off += 64) PREFETCH_L1(p + off);
}

static ALWAYS_INLINE void prefetch_row_l2(const float *row, int64_t dim) {
    const char *p = (const char *)row;
    const int64_t bytes = dim * (int64_t)sizeof(float);
    for (int64_t off = 0; off < bytes; off += 64) PREFETCH_L2(p + off);
}

/* Before row `lo` of a chunk [lo, hi): the first rows into L1, the next into L2.
 * `b` may be NULL (one table array). */
static ALWAYS_INLINE void prefetch_start(const float *a, const float *b, const int64_t *ids,
                                         int64_t lo, int64_t hi, pf_dist pd, int64_t dim) {
    for (int64_t i = lo; i < hi && i < lo + pd.far; i++) {
        const int64_t off = ids[i] * dim;
        if (i < lo + pd.near) {
            prefetch_row_l1(a + off, dim);
            if (b) prefetch_row_l1(b + off, dim);
        } else {
            prefetch_row_l2(a + off, dim);
            if (b) prefetch_row_l2(b + off, dim);
        }
    }
}

/* At row i: row i+far into L2, row i+near (fetched into L2 earlier) on into L1. */
static ALWAYS_INLINE void prefetch_ahead(const float *a, const float *b, const int64_t *ids,
                                         int64_t i, int64_t hi, pf_dist pd, int64_t dim) {
    if (i + pd.far < hi) {
        const int64_t off = ids[i + pd.far] * dim;
        prefetch_row_l2(a + off, dim);
        if (b) prefetch_row_l2(b + off, dim);
    }
    if (i + pd.near < hi) {
        const int64_t off = ids[i + pd.near] * dim;
        prefetch_row_l1(a + off, dim);
        if (b) prefetch_row_l1(b + off, dim);
    }
}

/* -1 if all ids are in [0, n_rows), else the position of the first bad one. */
static inline int64_t first_bad_id(const int64_t *ids, int64_t n_ids, int64_t n_rows) {
    for (int64_t i = 0; i < n_ids; i++)
        if ((uint64_t)ids[i] >= (uint64_t)n_rows) return i;
    return -1;
}

/* Non-finite results: each kernel ORs "exponent all ones" of every new state and delta
 * element into a per-chunk flag (branch-free: the loops still vectorize) and publishes
 * it in *bad once per chunk. With a snapshot (the old state of each row, stored in the
 * same pass), the caller puts every row back when *bad is set: a push whose update
 * would be non-finite changes nothing. */
static inline uint32_t nonfinite_f(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7f800000u) == 0x7f800000u;
}

static inline void publish_bad(int *bad, uint32_t any) {
    if (any) __atomic_store_n(bad, 1, __ATOMIC_RELAXED);
}

#define PTR(T, x) ((T)(uintptr_t)(x))

typedef void (*chunk_fn)(const void *job, int64_t lo, int64_t hi);

/* Run fn over items [0, n_items) (each `dim` floats wide) on up to `threads` threads. */
void hp_run_parallel(chunk_fn fn, const void *job, int64_t n_items, int64_t dim, int threads);

/* IndexError naming the id at `pos` (returns NULL). */
PyObject *hp_raise_bad_id(const int64_t *ids, int64_t pos, int64_t n_rows);

/* The functions of row_optim.c, added to the module at import. */
extern PyMethodDef hp_row_optim_methods[];
/* ... and those of dynamic.c (the dynamic tables: id map, initial rows). */
extern PyMethodDef hp_dynamic_methods[];
/* ... and dynamic_step.c's (a dynamic table's step with an in-process store, fused). */
extern PyMethodDef hp_dynamic_step_methods[];
/* ... and page_check.c's (the page file's CRC-32C and batched page check); its tables and
 * implementation are set up by hp_page_check_init, at import. */
extern PyMethodDef hp_page_check_methods[];
void hp_page_check_init(void);

#endif
