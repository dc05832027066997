/*
 * The Adagrad family and partial-rowwise Adam as fused single-pass row loops (functions of
 * the extension hybridps.native._fused_adam, added at import: see kernels.h).
 *
 * Each is one pass over the given unique rows, like adam/adamw in fused_adam.c (same
 * prefetch of the random state rows, same thread pool, same non-finite flag and optional
 * snapshot that puts every row back), and op for op the torch reference of
 * hybridps/optim_torch.py in float32 (scalars computed in double in Python, rounded to
 * float here, as torch does for a Python scalar; no FMA contraction, no -ffast-math):
 *
 *   adagrad              s' = s + g*g;  delta = (g / (sqrtf(s') + eps)) * -lr
 *   rowwise_adagrad      s' = s + mean(g^2);  delta = g * -(lr / (sqrtf(s') + eps))
 *   partial_rowwise_adam m' = m*b1 + g*(1-b1);  v' = mean(g^2)*(1-b2) + v*b2
 *                        delta = (m' / (sqrtf(v' / (1-b2^t)) + eps)) * -(lr / (1-b1^t))
 *
 * (s, v of the row-wise kinds: one float per row.) mean(g^2) sums a row's squares in a
 * fixed order that the torch reference repeats (ROW_LANES accumulators, lane k taking
 * columns k, k+8, ..., then a fixed tree), so the state is bitwise the reference's; the
 * 8 lanes are one AVX vector (two SSE ones), so the sum is not a chain of dim dependent
 * additions. sqrtf is correctly rounded, and so is the reference's (float64 sqrt rounded
 * to float32): the deltas are bitwise too.
 */
#include "kernels.h"

#include <math.h>

#define ROW_LANES 8 /* hybridps/optim_torch.py ROW_SUM_LANES */

/* mean over the row of g^2, summed in the reference's order (row_mean_sq there) */
static ALWAYS_INLINE float row_mean_sq(const float *RESTRICT g, int64_t dim) {
    float acc[ROW_LANES] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t j = 0;
    for (; j + ROW_LANES <= dim; j += ROW_LANES)
        for (int k = 0; k < ROW_LANES; k++) acc[k] = acc[k] + g[j + k] * g[j + k];
    for (int k = 0; j + k < dim; k++) acc[k] = acc[k] + g[j + k] * g[j + k];
    const float total =
        ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    return total / (float)dim;
}

/* The per-row state of a row-wise kind: one float, one cache line, fetched as far ahead
 * as the rows of width `dim` next to it would be. */
static ALWAYS_INLINE void prefetch_scalars(const float *s, const int64_t *ids, int64_t i,
                                           int64_t hi, pf_dist pd) {
    if (i + pd.far < hi) PREFETCH_L2(s + ids[i + pd.far]);
    if (i + pd.near < hi) PREFETCH_L1(s + ids[i + pd.near]);
}

static ALWAYS_INLINE uint32_t any_nonfinite(const float *RESTRICT x, int64_t n) {
    uint32_t any = 0;
    for (int64_t j = 0; j < n; j++) any |= nonfinite_f(x[j]);
    return any;
}

/* The two Adagrad kernels share their arguments: a sum of squares s of one float per
 * element (adagrad: [n_rows, dim]) or per row (rowwise_adagrad: [n_rows]). */
typedef struct {
    float *s, *d;
    const float *g;
    const int64_t *ids;
    int64_t dim;
    float lr, eps; /* adagrad: -lr; rowwise_adagrad: lr (as the Python side passes them) */
    float *ss;     /* snapshot of the old sums [n_ids, dim] or [n_ids], or NULL */
    int *bad;
} sum_job;

/* ------------------------------------------------------------------ adagrad */

MULTIVERSION static void adagrad_chunk(const void *job, int64_t lo, int64_t hi) {
    const sum_job *k = (const sum_job *)job;
    float *RESTRICT s = k->s;
    const int64_t *RESTRICT ids = k->ids;
    const int64_t dim = k->dim;
    const float nlr = k->lr, eps = k->eps;
    uint32_t any = 0;
    const pf_dist pd = prefetch_dist(dim);
    prefetch_start(s, NULL, ids, lo, hi, pd, dim);
    for (int64_t i = lo; i < hi; i++) {
        prefetch_ahead(s, NULL, ids, i, hi, pd, dim);
        float *RESTRICT sr = s + ids[i] * dim;
        const float *RESTRICT gr = k->g + i * dim;
        float *RESTRICT dr = k->d + i * dim;
        if (k->ss != NULL) {
            float *RESTRICT ssr = k->ss + i * dim;
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j], sj = sr[j];
                const float sn = sj + gj * gj;
                const float dn = (gj / (sqrtf(sn) + eps)) * nlr;
                ssr[j] = sj;
                sr[j] = sn;
                dr[j] = dn;
                any |= nonfinite_f(sn) | nonfinite_f(dn);
            }
        } else {
            for (int64_t j = 0; j < dim; j++) {
                const float gj = gr[j];
                const float sn = sr[j] + gj * gj;
                sr[j] = sn;
                dr[j] = (gj / (sqrtf(sn) + eps)) * nlr;
            }
        }
    }
    publish_bad(k->bad, any);
}

/* ---------------------------------------------------------- rowwise adagrad */

MULTIVERSION static void rowwise_adagrad_chunk(const void *job, int64_t lo, int64_t hi) {
    const sum_job *k = (const sum_job *)job;
    float *RESTRICT s = k->s;
    const int64_t *RESTRICT ids = k->ids;
    const int64_t dim = k->dim;
    const float lr = k->lr, eps = k->eps;
    uint32_t any = 0;
    const pf_dist pd = prefetch_dist(dim);
    for (int64_t i = lo; i < hi && i < lo + pd.far; i++) PREFETCH_L1(s + ids[i]);
    for (int64_t i = lo; i < hi; i++) {
        prefetch_scalars(s, ids, i, hi, pd);
        const float *RESTRICT gr = k->g + i * dim;
        float *RESTRICT dr = k->d + i * dim;
        const float old = s[ids[i]];
        const float sn = old + row_mean_sq(gr, dim);
        const float neg = -(lr / (sqrtf(sn) + eps));
        for (int64_t j = 0; j < dim; j++) dr[j] = gr[j] * neg;
        s[ids[i]] = sn;
        if (k->ss != NULL) {
            k->ss[i] = old;
            any |= nonfinite_f(sn) | any_nonfinite(dr, dim);
        }
    }
    publish_bad(k->bad, any);
}

/* ----------------------------------------------------- partial rowwise adam */

typedef struct {
    float *m, *v, *d; /* m: [n_rows, dim]; v: [n_rows] */
    const float *g;
    const int64_t *ids;
    int64_t dim;
    float b1, a1, b2, a2, bc2, eps, nss; /* b1, 1-b1, b2, 1-b2, 1-b2^t, eps, -lr/(1-b1^t) */
    float *sm, *sv;                      /* snapshots [n_ids, dim] and [n_ids], or NULL */
    int *bad;
} partial_adam_job;

MULTIVERSION static void partial_adam_chunk(const void *job, int64_t lo, int64_t hi) {
    const partial_adam_job *k = (const partial_adam_job *)job;
    float *RESTRICT m = k->m;
    float *RESTRICT v = k->v;
    const int64_t *RESTRICT ids = k->ids;
    const int64_t dim = k->dim;
    const float b1 = k->b1, a1 = k->a1, b2 = k->b2, a2 = k->a2, bc2 = k->bc2;
    const float eps = k->eps, nss = k->nss;
    uint32_t any = 0;
    const pf_dist pd = prefetch_dist(dim);
    prefetch_start(m, NULL, ids, lo, hi, pd, dim);
    for (int64_t i = lo; i < hi; i++) {
        prefetch_ahead(m, NULL, ids, i, hi, pd, dim);
        prefetch_scalars(v, ids, i, hi, pd);
        float *RESTRICT mr = m + ids[i] * dim;
        const float *RESTRICT gr = k->g + i * dim;
        float *RESTRICT dr = k->d + i * dim;
        const float vo = v[ids[i]];
        const float vn = row_mean_sq(gr, dim) * a2 + vo * b2;
        const float denom = sqrtf(vn / bc2) + eps;
        if (k->sm != NULL) {
            float *RESTRICT smr = k->sm + i * dim;
            for (int64_t j = 0; j < dim; j++) {
                const float mj = mr[j];
                const float mn = mj * b1 + gr[j] * a1;
                const float dn = (mn / denom) * nss;
                smr[j] = mj;
                mr[j] = mn;
                dr[j] = dn;
                any |= nonfinite_f(mn) | nonfinite_f(dn);
            }
            k->sv[i] = vo;
            any |= nonfinite_f(vn);
        } else {
            for (int64_t j = 0; j < dim; j++) {
                const float mn = mr[j] * b1 + gr[j] * a1;
                mr[j] = mn;
                dr[j] = (mn / denom) * nss;
            }
        }
        v[ids[i]] = vn;
    }
    publish_bad(k->bad, any);
}

/* ------------------------------------------------------------ Python glue */

/* After a kernel with a snapshot flagged a non-finite result: every row of a state array
 * of `width` floats a row back. */
static void undo_state(float *state, const int64_t *ids, int64_t n_ids, int64_t width,
                       const float *snap) {
    for (int64_t i = 0; i < n_ids; i++)
        memcpy(state + ids[i] * width, snap + i * width, (size_t)width * sizeof(float));
}

PyDoc_STRVAR(adagrad_doc,
             "adagrad(s, n_rows, dim, ids, n_ids, g, out, neg_lr, eps, threads, ss=0)\n--\n\n"
             "torch.optim.Adagrad's sparse step on the unique int64 rows `ids` of the\n"
             "float32 [n_rows, dim] sum of squares s (in place); out receives the delta.\n"
             "With a snapshot ss ([n_ids, dim] scratch) a step with a non-finite new sum or\n"
             "delta is undone and True is returned; otherwise False.");

/* Either Adagrad kernel: s holds dim floats a row (per_element) or one. */
static PyObject *run_sum_kernel(PyObject *args, chunk_fn chunk, int per_element) {
    unsigned long long ps, pids, pg, pd, pss = 0;
    long long n_rows, dim, n_ids;
    double lr, eps;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKLKKddi|K", &ps, &n_rows, &dim, &pids, &n_ids, &pg, &pd,
                          &lr, &eps, &threads, &pss))
        return NULL;
    if (n_ids <= 0 || dim <= 0) Py_RETURN_FALSE;
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t bad = first_bad_id(ids, n_ids, n_rows);
    if (bad >= 0) return hp_raise_bad_id(ids, bad, n_rows);
    int nonfinite = 0;
    float *ss = pss ? PTR(float *, pss) : NULL;
    const sum_job job = {PTR(float *, ps), PTR(float *, pd), PTR(const float *, pg), ids, dim,
                         (float)lr, (float)eps, ss, &nonfinite};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(chunk, &job, n_ids, dim, threads);
    if (nonfinite && ss) undo_state(job.s, ids, n_ids, per_element ? dim : 1, ss);
    Py_END_ALLOW_THREADS
    if (nonfinite && ss) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *py_adagrad(PyObject *self, PyObject *args) {
    (void)self;
    return run_sum_kernel(args, adagrad_chunk, 1);
}

PyDoc_STRVAR(rowwise_adagrad_doc,
             "rowwise_adagrad(s, n_rows, dim, ids, n_ids, g, out, lr, eps, threads, ss=0)\n"
             "--\n\n"
             "FBGEMM's EXACT_ROWWISE_ADAGRAD on the unique int64 rows `ids`: s is float32\n"
             "[n_rows] (one sum a row, in place), g and out float32 [n_ids, dim]. With a\n"
             "snapshot ss ([n_ids] scratch) a step with a non-finite new sum or delta is\n"
             "undone and True is returned; otherwise False.");

static PyObject *py_rowwise_adagrad(PyObject *self, PyObject *args) {
    (void)self;
    return run_sum_kernel(args, rowwise_adagrad_chunk, 0);
}

PyDoc_STRVAR(partial_rowwise_adam_doc,
             "partial_rowwise_adam(m, v, n_rows, dim, ids, n_ids, g, out, b1, one_minus_b1,\n"
             "                     b2, one_minus_b2, bc2, eps, neg_step_size, threads,\n"
             "                     sm=0, sv=0)\n--\n\n"
             "FBGEMM's PARTIAL_ROWWISE_ADAM on the unique int64 rows `ids`: m float32\n"
             "[n_rows, dim], v float32 [n_rows] (in place); bc2 = 1 - b2^t, neg_step_size =\n"
             "-lr / (1 - b1^t). With snapshots (sm [n_ids, dim], sv [n_ids]) a step with a\n"
             "non-finite new m, v or delta is undone and True is returned; otherwise False.");

static PyObject *py_partial_rowwise_adam(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pm, pv, pids, pg, pd, psm = 0, psv = 0;
    long long n_rows, dim, n_ids;
    double b1, a1, b2, a2, bc2, eps, nss;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKLKKdddddddi|KK", &pm, &pv, &n_rows, &dim, &pids, &n_ids,
                          &pg, &pd, &b1, &a1, &b2, &a2, &bc2, &eps, &nss, &threads, &psm,
                          &psv))
        return NULL;
    if (n_ids <= 0 || dim <= 0) Py_RETURN_FALSE;
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t bad = first_bad_id(ids, n_ids, n_rows);
    if (bad >= 0) return hp_raise_bad_id(ids, bad, n_rows);
    int nonfinite = 0;
    float *sm = (psm && psv) ? PTR(float *, psm) : NULL;
    float *sv = sm ? PTR(float *, psv) : NULL;
    const partial_adam_job job = {PTR(float *, pm), PTR(float *, pv), PTR(float *, pd),
                                  PTR(const float *, pg), ids, dim, (float)b1, (float)a1,
                                  (float)b2, (float)a2, (float)bc2, (float)eps, (float)nss,
                                  sm, sv, &nonfinite};
    Py_BEGIN_ALLOW_THREADS
    hp_run_parallel(partial_adam_chunk, &job, n_ids, dim, threads);
    if (nonfinite && sm) {
        undo_state(job.m, ids, n_ids, dim, sm);
        undo_state(job.v, ids, n_ids, 1, sv);
    }
    Py_END_ALLOW_THREADS
    if (nonfinite && sm) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyMethodDef hp_row_optim_methods[] = {
    {"adagrad", py_adagrad, METH_VARARGS, adagrad_doc},
    {"rowwise_adagrad", py_rowwise_adagrad, METH_VARARGS, rowwise_adagrad_doc},
    {"partial_rowwise_adam", py_partial_rowwise_adam, METH_VARARGS, partial_rowwise_adam_doc},
    {NULL, NULL, 0, NULL},
};
