/*
 * Fused single-pass row kernels for hybridps (CPython extension hybridps.native._fused_adam).
 *
 * Why a plain CPython module taking raw addresses (tensor.data_ptr()) as ints:
 *  - it is what a setuptools Extension builds with no extra tooling (no torch C++
 *    extension, no pybind11, no ABI coupling to the torch build); `import` finds it
 *    like any module, and an ImportError is the "not built" signal;
 *  - a METH_VARARGS call costs well under a microsecond (ctypes converts every
 *    argument in Python), and the module releases the GIL around every loop so the
 *    server's other threads keep running;
 *  - shape/dtype/device/overlap checks stay in Python (hybridps/native/__init__.py,
 *    hybridps/optim.py) where the tensors are; this file only bounds-checks the row ids,
 *    before touching any state, since a bad id would write outside the table.
 *
 * Every kernel is one pass over the given unique rows: adam/adamw read m, v, g and
 * write m, v (in place) and delta (into a caller-owned, reusable buffer), i.e. 24
 * bytes per element, with no allocation. The rows of the next iterations are
 * software-prefetched: they are random rows of a table far larger than the caches,
 * which the hardware prefetcher cannot predict (this doubles single-thread speed).
 * Two distances: rows PF_FAR_BYTES ahead are fetched into L2 only (prefetcht2),
 * rows PF_BYTES ahead into L1. One L1-only distance is capped by the few L1 miss
 * buffers; staging through L2 keeps more misses in flight (measured on a Zen 4 VM,
 * huge-page tables: +12% to +150% in 10 of bench_kernel.py's 12 configurations,
 * nothing at dim 64 with 4k rows; README, Performance). A longer L1-only distance,
 * or prefetcht1/t2 alone, gained less.
 *
 * Threads: a small persistent pthread pool rather than OpenMP. The rows are cut into
 * chunks of ~CHUNK_ELEMS elements claimed from one atomic counter, and the calling
 * thread works too; it waits only for chunks another thread has actually claimed, so
 * a pool thread that the OS has not scheduled (the shard server shares its cores
 * with gRPC and Python threads) costs nothing: the caller does its share. An OpenMP
 * team instead waits at its barrier for every member, and on a loaded 2-core box a
 * 2-thread call was measured 20x slower than a 1-thread one. The pool also avoids
 * loading a second OpenMP runtime next to torch's. Rows are unique within a call, so
 * chunks never share a row. Concurrent callers do not queue: a call that finds the
 * pool busy runs on its own thread.
 *
 * Arithmetic is float32, op for op as the torch reference in hybridps/optim.py (scalars are
 * computed in double in Python and rounded to float here, as torch does for a Python
 * scalar), built with -ffp-contract=off and without -ffast-math. Hence m and v are
 * bitwise those of the torch path (adam: of torch.optim.SparseAdam; adamw: of torch's
 * FMA-using CPU kernels), and so are sgd and the row update. The delta of adam/adamw
 * can differ in the last bits (measured: <= 5 ulp): sqrtf here is correctly rounded,
 * torch's float32 sqrt (MKL VML) is not always (~0.6% of elements off by 1 ulp).
 */
#include "kernels.h"

#include <math.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if !defined(_WIN32) && !defined(__STDC_NO_ATOMICS__) && !defined(HYBRIDPS_NO_THREADS)
#define HAVE_POOL 1
#include <pthread.h>
#include <stdatomic.h>
#else
#define HAVE_POOL 0
#endif

/* Elements per work chunk (~24 bytes each for adam: ~0.4 MB of traffic, ~20 us). */
#ifndef CHUNK_ELEMS
#define CHUNK_ELEMS 16384
#endif
/* Calls below this many elements run on the calling thread only. */
#ifndef PAR_MIN_ELEMS
#define PAR_MIN_ELEMS 32768
#endif
/* Pause iterations a pool thread polls for the next call before sleeping. */
#ifndef SPIN_ITERS
#define SPIN_ITERS 2000
#endif
/* Pause iterations the caller polls for the pool's last chunks before sleeping. */
#ifndef WAIT_SPIN_ITERS
#define WAIT_SPIN_ITERS 256
#endif
#define MAX_CHUNKS 65536
#define MAX_WORKERS 63

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* ---------------------------------------------------------------- row loops */

typedef struct {
    float *m, *v, *d;
    const float *g;
    const int64_t *ids;
    int64_t dim;
    float a1, a2, eps, nss; /* 1-b1, 1-b2, eps, -step_size */
    float *sm, *sv;         /* snapshot of the old rows, or NULL */
    int *bad;
} adam_job;

MULTIVERSION static void adam_chunk(const void *job, int64_t lo, int64_t hi) {
    const adam_job *k = (const adam_job *)job;
    float *RESTRICT m = k->m;
    float *RESTRICT v = k->v;
    const int64_t *RESTRICT ids = k->ids;
    const int64_t dim = k->dim;
    const float a1 = k->a1, a2 = k->a2, eps = k->eps, nss = k->nss;
    uint32_t any = 0;
    const pf_dist pd = prefetch_dist(dim);
    prefetch_start(m, v, ids, lo, hi, pd, dim);
    for (int64_t i = lo; i < hi; i++) {
        prefetch_ahead(m, v, ids, i, hi, pd, dim);
        float *RESTRICT mr = m + ids[i] * dim;
        float *RESTRICT vr = v + ids[i] * dim;
        const float *RESTRICT gr = k->g + i * dim;
        float *RESTRICT dr = k->d + i * dim;
        /* torch.optim.SparseAdam, op for op:
         *   m' = (g - m) * (1-b1) + m;  v' = (g*g - v) * (1-b2) + v
         *   delta = (m' / (sqrt(v') + eps)) * -step_size */
        if (k->sm != NULL) {
            float *RESTRICT smr = k->sm + i * dim;
            float *RESTRICT svr = k->sv + i * dim;
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j], mj = mr[j], vj = vr[j];
                const float mn = (gj - mj) * a1 + mj;
                const float vn = (gj * gj - vj) * a2 + vj;
                const float dn = (mn / (sqrtf(vn) + eps)) * nss;
                smr[j] = mj;
                svr[j] = vj;
                mr[j] = mn;
                vr[j] = vn;
                dr[j] = dn;
                any |= nonfinite_f(mn) | nonfinite_f(vn) | nonfinite_f(dn);
            }
        } else {
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j], mj = mr[j], vj = vr[j];
                const float mn = (gj - mj) * a1 + mj;
                const float vn = (gj * gj - vj) * a2 + vj;
                mr[j] = mn;
                vr[j] = vn;
                dr[j] = (mn / (sqrtf(vn) + eps)) * nss;
            }
        }
    }
    publish_bad(k->bad, any);
}

typedef struct {
    float *m, *v, *d;
    const float *g;
    const int64_t *ids;
    int64_t dim;
    float w, b2, a2, sbc2, eps, nss; /* 1-b1, b2, 1-b2, sqrt(1-b2^t), eps, -lr/(1-b1^t) */
    float *sm, *sv;                  /* snapshot of the old rows, or NULL */
    int *bad;
} adamw_job;

MULTIVERSION static void adamw_chunk(const void *job, int64_t lo, int64_t hi) {
    const adamw_job *k = (const adamw_job *)job;
    float *RESTRICT m = k->m;
    float *RESTRICT v = k->v;
    const int64_t *RESTRICT ids = k->ids;
    const int64_t dim = k->dim;
    const float w = k->w, wm1 = k->w - 1.0f, b2 = k->b2, a2 = k->a2, sbc2 = k->sbc2;
    const float eps = k->eps, nss = k->nss;
    const int small_w = w < 0.5f; /* torch.lerp's two formulas */
    uint32_t any = 0;
    const pf_dist pd = prefetch_dist(dim);
    prefetch_start(m, v, ids, lo, hi, pd, dim);
    for (int64_t i = lo; i < hi; i++) {
        prefetch_ahead(m, v, ids, i, hi, pd, dim);
        float *RESTRICT mr = m + ids[i] * dim;
        float *RESTRICT vr = v + ids[i] * dim;
        const float *RESTRICT gr = k->g + i * dim;
        float *RESTRICT dr = k->d + i * dim;
        /* torch.optim.AdamW (single tensor), with torch's fused multiply-adds (its
         * vectorized lerp is fmadd(coeff, end - start, base), and its AVX2/AVX-512
         * build contracts addcmul), which leaves m and v bitwise torch's:
         *   m' = m.lerp(g, 1-b1);  v' = v*b2 + (1-b2)*g*g
         *   delta = (m' / (sqrt(v') / sqrt(bc2) + eps)) * (-lr/bc1) */
        if (k->sm != NULL) {
            float *RESTRICT smr = k->sm + i * dim;
            float *RESTRICT svr = k->sv + i * dim;
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j], mj = mr[j], vj = vr[j];
                const float mn = small_w ? fmaf(w, gj - mj, mj) : fmaf(wm1, gj - mj, gj);
                const float vn = fmaf(a2 * gj, gj, vj * b2);
                const float dn = (mn / (sqrtf(vn) / sbc2 + eps)) * nss;
                smr[j] = mj;
                svr[j] = vj;
                mr[j] = mn;
                vr[j] = vn;
                dr[j] = dn;
                any |= nonfinite_f(mn) | nonfinite_f(vn) | nonfinite_f(dn);
            }
        } else if (small_w) {
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j], mj = mr[j];
                const float mn = fmaf(w, gj - mj, mj);
                const float vn = fmaf(a2 * gj, gj, vr[j] * b2);
                mr[j] = mn;
                vr[j] = vn;
                dr[j] = (mn / (sqrtf(vn) / sbc2 + eps)) * nss;
            }
        } else {
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j], mj = mr[j];
                const float mn = fmaf(wm1, gj - mj, gj);
                const float vn = fmaf(a2 * gj, gj, vr[j] * b2);
                mr[j] = mn;
                vr[j] = vn;
                dr[j] = (mn / (sqrtf(vn) / sbc2 + eps)) * nss;
            }
        }
    }
    publish_bad(k->bad, any);
}

typedef struct {
    float *w;
    const float *d;
    const int64_t *ids;
    int64_t dim;
    float decay;
    float *eff; /* NULL, or [n_ids, dim]: each element's new value minus its old one */
} update_job;

MULTIVERSION static void update_chunk(const void *job, int64_t lo, int64_t hi) {
    const update_job *k = (const update_job *)job;
    float *RESTRICT w = k->w;
    const int64_t *RESTRICT ids = k->ids;
    const int64_t dim = k->dim;
    const float decay = k->decay;
    const pf_dist pd = prefetch_dist(dim);
    prefetch_start(w, NULL, ids, lo, hi, pd, dim);
    for (int64_t i = lo; i < hi; i++) {
        prefetch_ahead(w, NULL, ids, i, hi, pd, dim);
        float *RESTRICT wr = w + ids[i] * dim;
        const float *RESTRICT dr = k->d + i * dim;
        if (k->eff) {
            /* The effective update as torch would measure it (new - old, both rounded to
             * float32): the staleness window's weight prediction reuses it. */
            float *RESTRICT er = k->eff + i * dim;
            for (int64_t j = 0; j < dim; j++) {
                const float old = wr[j];
                const float nw = decay == 1.0f ? old + dr[j] : old * decay + dr[j];
                wr[j] = nw;
                er[j] = nw - old;
            }
        } else if (decay == 1.0f) {
            for (int64_t j = 0; j < dim; j++) wr[j] = wr[j] + dr[j];
        } else {
            for (int64_t j = 0; j < dim; j++) wr[j] = wr[j] * decay + dr[j];
        }
    }
}

typedef struct {
    float *a;
    const float *b, *c;
    float s;
} axpy_job; /* a = b + s*c (triad); a = s*c when b is NULL (sgd) */

MULTIVERSION static void axpy_chunk(const void *job, int64_t lo, int64_t hi) {
    const axpy_job *k = (const axpy_job *)job;
    float *RESTRICT a = k->a;
    const float *RESTRICT c = k->c;
    const float s = k->s;
    if (k->b == NULL) {
        for (int64_t i = lo; i < hi; i++) a[i] = c[i] * s;
    } else {
        const float *RESTRICT b = k->b;
        for (int64_t i = lo; i < hi; i++) a[i] = b[i] + s * c[i];
    }
}

/* ------------------------------------------------------------- thread pool */

#if HAVE_POOL
/*
 * One job at a time. `ctr` = generation << 32 | chunks not yet claimed. A thread
 * claims chunk r-1 by a CAS (gen, r) -> (gen, r-1); the job fields are read only
 * after a successful claim, and the caller rewrites them only after every chunk of
 * the previous generation is claimed and done, so a late thread can never run a
 * chunk of a finished job.
 */
static struct {
    pthread_mutex_t job_lock; /* held by the calling thread for the whole call */
    pthread_mutex_t mu;       /* guards sleeping (pool threads on cv, the caller on done_cv) */
    pthread_cond_t cv;
    pthread_cond_t done_cv;
    _Atomic uint64_t ctr;
    _Atomic int64_t done;
    _Atomic int sleepers;
    _Atomic int job_workers; /* pool threads with index < this may help */
    int n_workers;           /* started (only touched under job_lock) */
    chunk_fn fn;
    const void *job;
    int64_t n_items, per_chunk, n_chunks;
} pool = {.job_lock = PTHREAD_MUTEX_INITIALIZER,
        .mu = PTHREAD_MUTEX_INITIALIZER,
        .cv = PTHREAD_COND_INITIALIZER,
        .done_cv = PTHREAD_COND_INITIALIZER};

static int run_claimed_chunks(uint32_t gen) {
    int ran = 0;
    for (;;) {
        uint64_t c = atomic_load(&pool.ctr);
        if ((uint32_t)(c >> 32) != gen || (uint32_t)c == 0) return ran;
        if (!atomic_compare_exchange_weak(&pool.ctr, &c, c - 1)) continue;
        const int64_t chunk = (int64_t)(uint32_t)c - 1;
        const int64_t lo = chunk * pool.per_chunk;
        const int64_t hi = lo + pool.per_chunk < pool.n_items ? lo + pool.per_chunk : pool.n_items;
        const int64_t n_chunks = pool.n_chunks; /* read before `done` can complete the job */
        pool.fn(pool.job, lo, hi);
        if (atomic_fetch_add(&pool.done, 1) + 1 == n_chunks) {
            /* The caller may be asleep waiting for this chunk. */
            pthread_mutex_lock(&pool.mu);
            pthread_cond_broadcast(&pool.done_cv);
            pthread_mutex_unlock(&pool.mu);
        }
        ran = 1;
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(atomic_load(&pool.ctr) >> 32);
    for (;;) {
        uint32_t gen = (uint32_t)(atomic_load(&pool.ctr) >> 32);
        for (int s = 0; gen == seen && s < SPIN_ITERS; s++) {
            CPU_RELAX();
            gen = (uint32_t)(atomic_load(&pool.ctr) >> 32);
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((gen = (uint32_t)(atomic_load(&pool.ctr) >> 32)) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        if (index < atomic_load(&pool.job_workers)) run_claimed_chunks(gen);
    }
    return NULL;
}

/* fork(): wait for a running call and hold the pool's locks across the fork; the
 * child has none of the pool threads, so it starts with an empty pool. */
static void pool_before_fork(void) {
    pthread_mutex_lock(&pool.job_lock);
    pthread_mutex_lock(&pool.mu);
}

static void pool_after_fork_parent(void) {
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.job_lock);
}

static void pool_after_fork_child(void) {
    pthread_cond_init(&pool.cv, NULL);
    pthread_cond_init(&pool.done_cv, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.n_workers = 0;
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.job_lock);
}

/* Start pool threads up to `want` (under job_lock); returns how many exist. */
static int pool_grow(int want) {
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    while (pool.n_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)pool.n_workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.n_workers++;
    }
    return pool.n_workers;
}
#endif /* HAVE_POOL */

void hp_run_parallel(chunk_fn fn, const void *job, int64_t n_items, int64_t dim, int threads) {
#if HAVE_POOL
    int64_t per = CHUNK_ELEMS / (dim > 0 ? dim : 1);
    if (per < 1) per = 1;
    if ((n_items + per - 1) / per > MAX_CHUNKS) per = (n_items + MAX_CHUNKS - 1) / MAX_CHUNKS;
    const int64_t n_chunks = (n_items + per - 1) / per;
    if (threads > 1 && n_chunks > 1 && n_items * dim >= PAR_MIN_ELEMS &&
        pthread_mutex_trylock(&pool.job_lock) == 0) {
        const int helpers = pool_grow(threads - 1);
        if (helpers > 0) {
            pool.fn = fn;
            pool.job = job;
            pool.n_items = n_items;
            pool.per_chunk = per;
            pool.n_chunks = n_chunks;
            atomic_store(&pool.done, 0);
            atomic_store(&pool.job_workers, threads - 1);
            const uint32_t gen = (uint32_t)(atomic_load(&pool.ctr) >> 32) + 1;
            atomic_store(&pool.ctr, ((uint64_t)gen << 32) | (uint64_t)n_chunks);
            if (atomic_load(&pool.sleepers) > 0) {
                pthread_mutex_lock(&pool.mu);
                pthread_cond_broadcast(&pool.cv);
                pthread_mutex_unlock(&pool.mu);
            }
            run_claimed_chunks(gen);
            /* Every chunk is claimed; wait for those other threads are running. Spin
             * briefly, then sleep: if such a thread was preempted (a loaded machine),
             * this core going idle is what lets the scheduler move it here. */
            for (int s = 0; s < WAIT_SPIN_ITERS && atomic_load(&pool.done) < n_chunks; s++)
                CPU_RELAX();
            if (atomic_load(&pool.done) < n_chunks) {
                pthread_mutex_lock(&pool.mu);
                while (atomic_load(&pool.done) < n_chunks)
                    pthread_cond_wait(&pool.done_cv, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
            }
            pthread_mutex_unlock(&pool.job_lock);
            return;
        }
        pthread_mutex_unlock(&pool.job_lock);
    }
#else
    (void)dim;
    (void)threads;
#endif
    fn(job, 0, n_items);
}

/* ------------------------------------------------------------ Python glue */

PyObject *hp_raise_bad_id(const int64_t *ids, int64_t pos, int64_t n_rows) {
    PyErr_Format(PyExc_IndexError, "row id %lld at position %lld is out of range [0, %lld)",
                 (long long)ids[pos], (long long)pos, (long long)n_rows);
    return NULL;
}

/* After a kernel with a snapshot flagged a non-finite result: every row back. */
static void undo_rows(float *m, float *v, const int64_t *ids, int64_t n_ids, int64_t dim,
                      const float *sm, const float *sv) {
    for (int64_t i = 0; i < n_ids; i++) {
        memcpy(m + ids[i] * dim, sm + i * dim, (size_t)dim * sizeof(float));
        memcpy(v + ids[i] * dim, sv + i * dim, (size_t)dim * sizeof(float));
    }
}

PyDoc_STRVAR(adam_doc,
             "adam(m, v, n_rows, dim, ids, n_ids, g, out, one_minus_b1, one_minus_b2, eps,\n"
             "     neg_step_size, threads, sm=0, sv=0)\n--\n\n"
             "torch.optim.SparseAdam step on the unique int64 rows `ids` of m, v (float32\n"
             "[n_rows, dim], updated in place); g and out are float32 [n_ids, dim] and out\n"
             "receives the delta. Pointers are ints (tensor.data_ptr()). With a snapshot\n"
             "(sm, sv: float32 [n_ids, dim] scratch) a step any of whose new m, v or delta\n"
             "elements is not finite is undone (m, v as before) and True is returned;\n"
             "otherwise False.");

static PyObject *py_adam(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pm, pv, pids, pg, pd, psm = 0, psv = 0;
    long long n_rows, dim, n_ids;
    double a1, a2, eps, nss;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKLKKddddi|KK", &pm, &pv, &n_rows, &dim, &pids, &n_ids,
                          &pg, &pd, &a1, &a2, &eps, &nss, &threads, &psm, &psv))
        return NULL;
    if (n_ids <= 0 || dim <= 0) Py_RETURN_FALSE;
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t bad = first_bad_id(ids, n_ids, n_rows);
    if (bad >= 0) return hp_raise_bad_id(ids, bad, n_rows);
    int nonfinite = 0;
    float *sm = (psm && psv) ? PTR(float *, psm) : NULL;
    float *sv = sm ? PTR(float *, psv) : NULL;
    const adam_job job = {PTR(float *, pm), PTR(float *, pv), PTR(float *, pd),
                          PTR(const float *, pg), ids, dim, (float)a1, (float)a2,
                          (float)eps, (float)nss, sm, sv, &nonfinite};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(adam_chunk, &job, n_ids, dim, threads);
    if (nonfinite && sm) undo_rows(job.m, job.v, ids, n_ids, dim, sm, sv);
    Py_END_ALLOW_THREADS
    if (nonfinite && sm) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(adamw_doc,
             "adamw(m, v, n_rows, dim, ids, n_ids, g, out, one_minus_b1, b2, one_minus_b2,\n"
             "      sqrt_bc2, eps, neg_step_size, threads)\n--\n\n"
             "torch.optim.AdamW moments and delta on the unique rows `ids` (the decoupled\n"
             "weight decay factor is applied by the caller with the delta).");

static PyObject *py_adamw(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pm, pv, pids, pg, pd, psm = 0, psv = 0;
    long long n_rows, dim, n_ids;
    double w, b2, a2, sbc2, eps, nss;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKLKKddddddi|KK", &pm, &pv, &n_rows, &dim, &pids, &n_ids,
                          &pg, &pd, &w, &b2, &a2, &sbc2, &eps, &nss, &threads, &psm, &psv))
        return NULL;
    if (n_ids <= 0 || dim <= 0) Py_RETURN_FALSE;
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t bad = first_bad_id(ids, n_ids, n_rows);
    if (bad >= 0) return hp_raise_bad_id(ids, bad, n_rows);
    int nonfinite = 0;
    float *sm = (psm && psv) ? PTR(float *, psm) : NULL;
    float *sv = sm ? PTR(float *, psv) : NULL;
    const adamw_job job = {PTR(float *, pm), PTR(float *, pv), PTR(float *, pd),
                           PTR(const float *, pg), ids, dim, (float)w, (float)b2, (float)a2,
                           (float)sbc2, (float)eps, (float)nss, sm, sv, &nonfinite};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(adamw_chunk, &job, n_ids, dim, threads);
    if (nonfinite && sm) undo_rows(job.m, job.v, ids, n_ids, dim, sm, sv);
    Py_END_ALLOW_THREADS
    if (nonfinite && sm) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(apply_update_doc,
             "apply_update(rows, n_rows, dim, ids, n_ids, delta, decay, threads, eff=0)\n--\n\n"
             "rows[ids] = rows[ids] * decay + delta (float32, unique int64 ids); eff, when\n"
             "not 0, receives [n_ids, dim] new minus old rows.");

static PyObject *py_apply_update(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pw, pids, pd, peff = 0;
    long long n_rows, dim, n_ids;
    double decay;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKLKdi|K", &pw, &n_rows, &dim, &pids, &n_ids, &pd, &decay,
                          &threads, &peff))
        return NULL;
    if (n_ids <= 0 || dim <= 0) Py_RETURN_NONE;
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t bad = first_bad_id(ids, n_ids, n_rows);
    if (bad >= 0) return hp_raise_bad_id(ids, bad, n_rows);
    const update_job job = {PTR(float *, pw), PTR(const float *, pd), ids, dim, (float)decay,
                            peff ? PTR(float *, peff) : NULL};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(update_chunk, &job, n_ids, dim, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The first position p >= from with keys[p] >= id (keys sorted; searchsorted's left
 * side). Sorted ids (an owner's distinct rows) pass the last position as `from` and walk
 * forward; others pass 0 and search all the keys. */
static inline int64_t lower_key(const int64_t *keys, int64_t n_keys, int64_t id, int64_t from) {
    int64_t lo = from, hi = n_keys;
    while (lo < hi) {
        const int64_t mid = lo + ((hi - lo) >> 1);
        if (keys[mid] < id) lo = mid + 1; else hi = mid;
    }
    return lo;
}

PyDoc_STRVAR(add_offsets_doc,
             "add_offsets(rows, n, dim, ids, keys, n_keys, offsets)\n--\n\n"
             "rows[i] += offsets[p] for every i whose ids[i] == keys[p] (keys sorted and\n"
             "distinct, int64; rows [n, dim] and offsets [n_keys, dim] float32); other rows\n"
             "are left as they are.");

static PyObject *py_add_offsets(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long prows, pids, pkeys, poff;
    long long n, dim, n_keys;
    if (!PyArg_ParseTuple(args, "KLLKKLK", &prows, &n, &dim, &pids, &pkeys, &n_keys, &poff))
        return NULL;
    if (n <= 0 || dim <= 0 || n_keys <= 0) Py_RETURN_NONE;
    float *rows = PTR(float *, prows);
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t *keys = PTR(const int64_t *, pkeys);
    const float *off = PTR(const float *, poff);
    Py_BEGIN_ALLOW_THREADS
    int64_t lo_hint = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        const int64_t lo = lower_key(keys, n_keys, id,
                                     (i > 0 && id >= ids[i - 1]) ? lo_hint : 0);
        lo_hint = lo;
        if (lo < n_keys && keys[lo] == id) {
            float *RESTRICT r = rows + i * dim;
            const float *RESTRICT o = off + lo * dim;
            for (int64_t j = 0; j < dim; j++) r[j] = r[j] + o[j];
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pick_offsets_doc,
             "pick_offsets(ids, n, keys, n_keys, src, dim, out) -> hits\n--\n\n"
             "out[i] = src[p] where ids[i] == keys[p], else +0.0 (keys sorted, int64; src\n"
             "[n_keys, dim] and out [n, dim] float32): torch's searchsorted, compare,\n"
             "gather and where(hit, src[pos], 0.0) in one pass. Returns how many ids hit.");

static PyObject *py_pick_offsets(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pids, pkeys, psrc, pout;
    long long n, n_keys, dim;
    if (!PyArg_ParseTuple(args, "KLKLKLK", &pids, &n, &pkeys, &n_keys, &psrc, &dim, &pout))
        return NULL;
    if (n <= 0 || dim <= 0) return PyLong_FromLong(0);
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t *keys = PTR(const int64_t *, pkeys);
    const float *src = PTR(const float *, psrc);
    float *out = PTR(float *, pout);
    int64_t hits = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t lo_hint = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        float *RESTRICT o = out + i * dim;
        const int64_t lo = lower_key(keys, n_keys, id,
                                     (i > 0 && id >= ids[i - 1]) ? lo_hint : 0);
        lo_hint = lo;
        if (lo < n_keys && keys[lo] == id) {
            memcpy(o, src + lo * dim, (size_t)dim * sizeof(float));
            hits++;
        } else {
            memset(o, 0, (size_t)dim * sizeof(float));
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(hits);
}

PyDoc_STRVAR(scale_doc, "scale(g, out, n, s, threads)\n--\n\nout[:n] = g[:n] * s (float32).");

static PyObject *py_scale(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pg, pd;
    long long n;
    double s;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLdi", &pg, &pd, &n, &s, &threads)) return NULL;
    if (n <= 0) Py_RETURN_NONE;
    const axpy_job job = {PTR(float *, pd), NULL, PTR(const float *, pg), (float)s};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(axpy_chunk, &job, n, 1, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(triad_doc,
             "triad(a, b, c, n, s, threads)\n--\n\n"
             "STREAM triad a = b + s*c on n float32 (a bandwidth probe for bench/).");

static PyObject *py_triad(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pa, pb, pc;
    long long n;
    double s;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKLdi", &pa, &pb, &pc, &n, &s, &threads)) return NULL;
    if (n <= 0) Py_RETURN_NONE;
    const axpy_job job = {PTR(float *, pa), PTR(const float *, pb), PTR(const float *, pc),
                          (float)s};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(axpy_chunk, &job, n, 1, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A push's payload digest (the answer cache compares a re-sent push with the one applied,
 * hybridps/push_checks.py PayloadDigest): 16 lanes of 32 bits. The 32-bit word at
 * position p (counted over the whole push, so chunks add up) goes to lane j = p mod 8:
 * s[j] += word and t[j] += (p / 8) * word, mod 2^32. A changed word changes s; two words
 * swapped change t. Per block of 8 words it is Fletcher's pair of sums (adds only, as
 * fast as a plain sum), t rebuilt from them at the end. */
#define DIGEST_LANES 8

static inline void digest_word(uint32_t *s, uint32_t *t, const uint32_t *w, int64_t i,
                               int64_t p) {
    uint32_t word;
    memcpy(&word, w + i, sizeof word);
    s[p & (DIGEST_LANES - 1)] += word;
    t[p & (DIGEST_LANES - 1)] += (uint32_t)(p >> 3) * word;
}

/* s, t += the lanes of the words w[0:n] at positions offset.. */
MULTIVERSION static void digest_at(const uint32_t *w, int64_t n, int64_t offset, uint32_t *s,
                                   uint32_t *t) {
    int64_t i = 0;
    for (; i < n && ((offset + i) & (DIGEST_LANES - 1)); i++)
        digest_word(s, t, w, i, offset + i);
    const int64_t blocks = (n - i) / DIGEST_LANES;
    const uint32_t *v = w + i;
    uint32_t s1[DIGEST_LANES] = {0}, s2[DIGEST_LANES] = {0};
    for (int64_t b = 0; b < blocks; b++)
        for (int j = 0; j < DIGEST_LANES; j++) {
            uint32_t word;
            memcpy(&word, v + DIGEST_LANES * b + j, sizeof word);
            s1[j] += word;
            s2[j] += s1[j]; /* sum over blocks m of (blocks - m) * word_m */
        }
    const uint32_t first = (uint32_t)((offset + i) >> 3), nb = (uint32_t)blocks;
    for (int j = 0; j < DIGEST_LANES; j++) {
        s[j] += s1[j];
        t[j] += first * s1[j] + nb * s1[j] - s2[j]; /* sum of (first + m) * word_m */
    }
    for (i += DIGEST_LANES * blocks; i < n; i++) digest_word(s, t, w, i, offset + i);
}

static PyObject *lanes_tuple(const uint32_t *s, const uint32_t *t) {
    PyObject *out = PyTuple_New(2 * DIGEST_LANES);
    if (!out) return NULL;
    for (int j = 0; j < 2 * DIGEST_LANES; j++) {
        PyObject *x = PyLong_FromUnsignedLong(j < DIGEST_LANES ? s[j] : t[j - DIGEST_LANES]);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, j, x);
    }
    return out;
}

PyDoc_STRVAR(digest_doc,
             "digest(ptr, n_bytes, offset=0)\n--\n\n"
             "16-tuple s[0..7] + t[0..7]: the 32-bit word at position p = offset + i of the\n"
             "n_bytes at ptr (a multiple of 4) adds to s[p % 8] and (p // 8) * word to\n"
             "t[p % 8], mod 2^32.");

static PyObject *py_digest(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptr;
    long long n_bytes, offset = 0;
    if (!PyArg_ParseTuple(args, "KL|L", &ptr, &n_bytes, &offset)) return NULL;
    if (n_bytes < 0 || n_bytes % 4 || offset < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "digest: n_bytes must be a multiple of 4 and offset >= 0");
        return NULL;
    }
    uint32_t sums[DIGEST_LANES] = {0}, weighted[DIGEST_LANES] = {0};
    Py_BEGIN_ALLOW_THREADS
    digest_at(PTR(const uint32_t *, ptr), n_bytes / 4, offset, sums, weighted);
    Py_END_ALLOW_THREADS
    return lanes_tuple(sums, weighted);
}

/* ---------------------------------------------------------- push checks */

/* One pass over a push's ids and one over its gradients, with no allocation (the torch
 * checks make [U] and [U, dim] temporaries): the first id outside [lo, hi), whether the
 * ids strictly increase (coalesced pushes come sorted: then they are unique), and the
 * first non-finite gradient element (an exponent of all ones: inf or NaN). */
static inline uint32_t nonfinite_bit(const float *g, int64_t i) {
    uint32_t bits; /* memcpy, not a uint32_t* cast: no strict-aliasing question */
    memcpy(&bits, g + i, sizeof bits);
    return (bits & 0x7f800000u) == 0x7f800000u;
}

MULTIVERSION static int64_t first_nonfinite(const float *g, int64_t n) {
    const int64_t block = 4096;
    for (int64_t lo = 0; lo < n; lo += block) {
        const int64_t hi = lo + block < n ? lo + block : n;
        uint32_t any = 0; /* branch-free within a block, so the loop vectorizes */
        for (int64_t i = lo; i < hi; i++) any |= nonfinite_bit(g, i);
        if (any)
            for (int64_t i = lo; i < hi; i++)
                if (nonfinite_bit(g, i)) return i;
    }
    return -1;
}

/* The same pass, also giving an upper bound of |g| (for the server's overflow bounds):
 * the top 16 bits of a float without its sign grow with its magnitude, and SSE2 has a
 * 16-bit max, so one max per block vectorizes on every x86-64 (a 32-bit unsigned max
 * needs SSE4.1 and ran 5x slower than this in the baseline clone). Those bits are >=
 * 0x7f80 exactly when the exponent is all ones (inf, NaN); the bound is the float whose
 * top bits are the max + 1 (at most 2^-7 above the true max). */
MULTIVERSION static int64_t first_nonfinite_max(const float *g, int64_t n, float *bound,
                                                uint32_t *sums, uint32_t *weighted,
                                                int64_t offset) {
    const int64_t block = 4096;
    uint32_t mx = 0;
    for (int64_t lo = 0; lo < n; lo += block) {
        const int64_t hi = lo + block < n ? lo + block : n;
        int16_t bm = 0;
        for (int64_t i = lo; i < hi; i++) {
            uint32_t bits;
            memcpy(&bits, g + i, sizeof bits);
            const int16_t top = (int16_t)((bits >> 16) & 0x7fffu);
            bm = top > bm ? top : bm;
        }
        if (bm >= (int16_t)0x7f80)
            for (int64_t i = lo; i < hi; i++)
                if (nonfinite_bit(g, i)) return i;
        mx = (uint32_t)bm > mx ? (uint32_t)bm : mx;
        /* the payload digest of the block just read (in L1): no second pass over g */
        if (sums)
            digest_at((const uint32_t *)(const void *)(g + lo), hi - lo, offset + lo, sums,
                      weighted);
    }
    const uint32_t up = (mx + 1u) << 16;
    memcpy(bound, &up, sizeof *bound);
    return -1;
}

PyDoc_STRVAR(scan_push_doc,
             "scan_push(ids, n_ids, lo, hi, g, n_elems, want_max=0, id_offset=-1, g_offset=-1)\n"
             "--\n\n"
             "Checks of one push, allocation-free: (first position of an id outside [lo, hi)\n"
             "or -1, whether the ids strictly increase, first non-finite element of the\n"
             "float32 gradients g[:n_elems] or -1). After a bad id the other two are not\n"
             "computed (False, -1). want_max: a 4th item, an upper bound of |g| at most\n"
             "2^-7 above the largest (a float; 0.0 when not computed). id_offset and\n"
             "g_offset >= 0 (with want_max): a 5th and 6th item, the digest lanes (see\n"
             "digest) of the ids' and the gradients' 32-bit words at those word positions,\n"
             "computed in the same pass (meaningless when a check failed).");

static PyObject *py_scan_push(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pids, pg;
    long long n_ids, lo, hi, n_elems;
    int want_max = 0;
    long long id_offset = -1, g_offset = -1;
    if (!PyArg_ParseTuple(args, "KLLLKL|iLL", &pids, &n_ids, &lo, &hi, &pg, &n_elems,
                          &want_max, &id_offset, &g_offset))
        return NULL;
    const int want_digest = want_max && id_offset >= 0 && g_offset >= 0;
    const int64_t *ids = PTR(const int64_t *, pids);
    int64_t bad = -1, nonfinite = -1;
    int increasing = 1;
    float bound = 0.0f;
    uint32_t id_s[DIGEST_LANES] = {0}, id_t[DIGEST_LANES] = {0};
    uint32_t g_s[DIGEST_LANES] = {0}, g_t[DIGEST_LANES] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n_ids; i++) {
        if (ids[i] < lo || ids[i] >= hi) {
            bad = i;
            break;
        }
        if (i && ids[i] <= ids[i - 1]) increasing = 0;
    }
    if (want_digest && bad < 0)
        digest_at((const uint32_t *)(const void *)ids, 2 * n_ids, id_offset, id_s, id_t);
    if (bad < 0 && n_elems > 0)
        nonfinite = want_max ? first_nonfinite_max(PTR(const float *, pg), n_elems, &bound,
                                                   want_digest ? g_s : NULL, g_t, g_offset)
                             : first_nonfinite(PTR(const float *, pg), n_elems);
    Py_END_ALLOW_THREADS
    if (bad >= 0) increasing = 0;
    if (want_digest) {
        PyObject *a = lanes_tuple(id_s, id_t), *b = lanes_tuple(g_s, g_t);
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            return NULL;
        }
        return Py_BuildValue("(LOLdNN)", (long long)bad, increasing ? Py_True : Py_False,
                             (long long)nonfinite, (double)bound, a, b);
    }
    if (want_max)
        return Py_BuildValue("(LOLd)", (long long)bad, increasing ? Py_True : Py_False,
                             (long long)nonfinite, (double)bound);
    return Py_BuildValue("(LOL)", (long long)bad, increasing ? Py_True : Py_False,
                         (long long)nonfinite);
}

PyDoc_STRVAR(mark_rows_doc,
             "mark_rows(flags, n_flags, ids, n_ids)\n--\n\n"
             "Set the bytes flags[ids] (bool [n_flags]) to 1 and return how many were 0 (the\n"
             "unique int64 ids must be in [0, n_flags): checked, IndexError otherwise).");

static PyObject *py_mark_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pflags, pids;
    long long n_flags, n_ids;
    if (!PyArg_ParseTuple(args, "KLKL", &pflags, &n_flags, &pids, &n_ids)) return NULL;
    if (n_ids <= 0) return PyLong_FromLong(0);
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t bad = first_bad_id(ids, n_ids, n_flags);
    if (bad >= 0) return hp_raise_bad_id(ids, bad, n_flags);
    uint8_t *flags = PTR(uint8_t *, pflags);
    int64_t fresh = 0;
    for (int64_t i = 0; i < n_ids; i++) {
        fresh += flags[ids[i]] == 0;
        flags[ids[i]] = 1;
    }
    return PyLong_FromLongLong((long long)fresh);
}

PyDoc_STRVAR(advise_hugepages_doc,
             "advise_hugepages(ptr, nbytes)\n--\n\n"
             "madvise(MADV_HUGEPAGE) on the 2 MiB-aligned part of [ptr, ptr+nbytes): ask for\n"
             "transparent huge pages before the memory is first touched. Returns the bytes\n"
             "advised (0 where unsupported or refused).");

static PyObject *py_advise_hugepages(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptr, nbytes;
    if (!PyArg_ParseTuple(args, "KK", &ptr, &nbytes)) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const unsigned long long huge = 2ull << 20;
    const unsigned long long lo = (ptr + huge - 1) & ~(huge - 1);
    const unsigned long long hi = (ptr + nbytes) & ~(huge - 1);
    if (hi > lo && madvise((void *)(uintptr_t)lo, (size_t)(hi - lo), MADV_HUGEPAGE) == 0)
        return PyLong_FromUnsignedLongLong(hi - lo);
#else
    (void)ptr;
    (void)nbytes;
#endif
    return PyLong_FromLong(0);
}

static PyObject *py_build_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:s,s:s,s:i,s:i,s:i,s:i,s:i}", "isa", CLONES, "threads",
                         HAVE_POOL ? "pthread-pool" : "none",
                         "max_threads", HAVE_POOL ? MAX_WORKERS + 1 : 1, "prefetch_bytes",
                         PF_BYTES, "prefetch_far_bytes", PF_FAR_BYTES, "chunk_elems",
                         CHUNK_ELEMS, "parallel_min_elems", PAR_MIN_ELEMS);
}

static PyMethodDef methods[] = {
    {"adam", py_adam, METH_VARARGS, adam_doc},
    {"adamw", py_adamw, METH_VARARGS, adamw_doc},
    {"apply_update", py_apply_update, METH_VARARGS, apply_update_doc},
    {"add_offsets", py_add_offsets, METH_VARARGS, add_offsets_doc},
    {"pick_offsets", py_pick_offsets, METH_VARARGS, pick_offsets_doc},
    {"scale", py_scale, METH_VARARGS, scale_doc},
    {"triad", py_triad, METH_VARARGS, triad_doc},
    {"advise_hugepages", py_advise_hugepages, METH_VARARGS, advise_hugepages_doc},
    {"scan_push", py_scan_push, METH_VARARGS, scan_push_doc},
    {"mark_rows", py_mark_rows, METH_VARARGS, mark_rows_doc},
    {"digest", py_digest, METH_VARARGS, digest_doc},
    {"build_info", py_build_info, METH_NOARGS, "Build options (threads, prefetch, chunking)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "_fused_adam",
    "Fused float32 row kernels (sparse Adam/AdamW, SGD scale, row update, triad; the\n"
    "Adagrad family and partial-rowwise Adam from row_optim.c) and the\n"
    "server's allocation-free push checks (scan_push, mark_rows, digest); the dynamic\n"
    "tables' id map and initial rows (dynamic.c); the page file's CRC-32C and page check\n"
    "(page_check.c).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__fused_adam(void) {
#if HAVE_POOL
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_after_fork_child);
        atfork_done = 1;
    }
#endif
    hp_page_check_init();
    PyObject *module = PyModule_Create(&moduledef);
    if (module != NULL && (PyModule_AddFunctions(module, hp_row_optim_methods) < 0 ||
                           PyModule_AddFunctions(module, hp_page_check_methods) < 0 ||
                           PyModule_AddFunctions(module, hp_dynamic_methods) < 0 ||
                           PyModule_AddFunctions(module, hp_dynamic_step_methods) < 0)) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
