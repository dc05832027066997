/*
 * The page file's checksum and its batched page check (hybridps/page_file.py), part of
 * hybridps.native._fused_adam.
 *
 * The checksum is CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and
 * final value 0xFFFFFFFF: crc32c("123456789") == 0xE3069283). x86-64 has an instruction
 * for it (SSE4.2 crc32, 8 bytes an instruction); this file builds that path with a
 * target attribute, not a global -msse4.2 (the build stays on the portable ISA baseline),
 * and picks it at import when the CPU has it. Elsewhere a table-driven slice-by-8 loop
 * computes the same value; page_file.py's numpy fallback (no extension) is the same
 * algorithm again, and tests/hybridps/test_page_checksum.py checks all of them agree.
 *
 * check_pages does a fill's whole page work in one call with the GIL released: for each
 * asked page of the read-only mapping, the header (magic, page number) and the checksum
 * (stored in the page, and recorded by this process when it wrote the page) are checked,
 * and the payload is copied into the caller's buffer in the order asked. It reports
 * which pages fail in a status byte each; Python builds the error naming file and page.
 * Bounds (pages inside the mapping, the file not cut short) are checked by the caller
 * before the call; the page numbers are checked again here, before any read.
 *
 * gather_units is the spilled rows' fill (hybridps/spilled_rows.py) after check_pages
 * (without its copy): each unit's rows go from its checked page straight into the slot
 * buffers, the unit id each page holds checked first. Its pages are ones the caller just
 * had checked, so its bounds are the caller's.
 */
#include "kernels.h"

#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_table[8][256];

static void build_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xffu];
}

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) v = (v << 8) | p[k];
    return v;
}

/* Raw update (no initial/final inversion): slice-by-8. */
static uint32_t crc_update_table(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        const uint64_t w = load_le64(p) ^ crc;
        crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
              crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff] ^
              crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
              crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_HW_CRC 1
__attribute__((target("sse4.2"))) static uint32_t crc_update_hw(uint32_t crc, const uint8_t *p,
                                                                  size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* x86 is little-endian: the same bytes as load_le64 */
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#else
#define HAVE_HW_CRC 0
#endif

typedef uint32_t (*crc_update_fn)(uint32_t, const uint8_t *, size_t);
static crc_update_fn crc_update = crc_update_table;
static const char *crc_impl = "slice-by-8";

/* Build the tables and pick the implementation; called once from the module's init. */
void hp_page_check_init(void) {
    build_tables();
#if HAVE_HW_CRC
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_update = crc_update_hw;
        crc_impl = "sse4.2";
    }
#endif
}

/* crc32c of p[0, n), continuing from the checksum `crc` of what precedes it (0: none). */
static inline uint32_t crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    return ~crc_update(~crc, p, n);
}

PyDoc_STRVAR(crc32c_doc,
             "crc32c(ptr, nbytes, crc=0, portable=False)\n--\n\n"
             "The CRC-32C of the bytes [ptr, ptr+nbytes), continuing from `crc` (the\n"
             "checksum of the bytes before them, as zlib.crc32's value). portable: the\n"
             "table-driven loop even where the CPU has the instruction (for the tests).");

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptr;
    long long n;
    unsigned int crc = 0;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "KL|Ip", &ptr, &n, &crc, &portable)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "crc32c: nbytes=%lld must be >= 0", n);
    const uint8_t *p = PTR(const uint8_t *, ptr);
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = portable ? ~crc_update_table(~(uint32_t)crc, p, (size_t)n)
                   : crc32c((uint32_t)crc, p, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(out);
}

PyDoc_STRVAR(crc32c_pages_doc,
             "crc32c_pages(base, n, row_stride, nbytes, out)\n--\n\n"
             "out[i] (uint32 [n]) = the CRC-32C of the nbytes bytes at base + i*row_stride,\n"
             "for i in [0, n): the checksums of a block of pages written together.");

static PyObject *py_crc32c_pages(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pbase, pout;
    long long n, row_stride, nbytes;
    if (!PyArg_ParseTuple(args, "KLLLK", &pbase, &n, &row_stride, &nbytes, &pout)) return NULL;
    if (n < 0 || nbytes < 0 || row_stride < 0)
        return PyErr_Format(PyExc_ValueError,
                            "crc32c_pages: n=%lld, row_stride=%lld, nbytes=%lld must be >= 0",
                            n, row_stride, nbytes);
    const uint8_t *base = PTR(const uint8_t *, pbase);
    uint32_t *out = PTR(uint32_t *, pout);
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++) out[i] = crc32c(0, base + i * row_stride, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(0);
}

PyDoc_STRVAR(check_pages_doc,
             "check_pages(base, file_pages, stride, payload_bytes, magic, pages, n, recorded,\n"
             "            status, out, out_stride)\n--\n\n"
             "Check and copy n pages of a page file's mapping (file_pages strides of `stride`\n"
             "bytes at base). For i in [0, n), page p = pages[i] (int64): status[i] (uint8)\n"
             "= 0 when it checks, 1 its magic is not `magic`, 2 its page number is not p,\n"
             "3 the CRC-32C of bytes [8, stride) differs from the one stored at byte 4,\n"
             "4 the stored one differs from recorded[p] (uint32: this process's write); its\n"
             "payload (payload_bytes from byte 16) is copied to out + i*out_stride (out 0:\n"
             "no copy, the caller gathers from the mapping: gather_units). Returns\n"
             "how many pages failed. A page outside [0, file_pages): IndexError, nothing read.");

static PyObject *py_check_pages(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pbase, ppages, precorded, pstatus, pout;
    long long file_pages, stride, payload_bytes, n, out_stride;
    unsigned int magic;
    if (!PyArg_ParseTuple(args, "KLLLIKLKKKL", &pbase, &file_pages, &stride, &payload_bytes,
                          &magic, &ppages, &n, &precorded, &pstatus, &pout, &out_stride))
        return NULL;
    if (stride <= 0 || payload_bytes <= 0 || 16 + payload_bytes > stride || n < 0 ||
        out_stride < payload_bytes)
        return PyErr_Format(PyExc_ValueError,
                            "check_pages: stride=%lld, payload_bytes=%lld, n=%lld, "
                            "out_stride=%lld out of range",
                            stride, payload_bytes, n, out_stride);
    const int64_t *pages = PTR(const int64_t *, ppages);
    const int64_t bad_id = first_bad_id(pages, n, file_pages);
    if (bad_id >= 0)
        return PyErr_Format(PyExc_IndexError, "check_pages: page %lld outside [0, %lld)",
                            (long long)pages[bad_id], file_pages);
    const uint8_t *base = PTR(const uint8_t *, pbase);
    const uint32_t *recorded = PTR(const uint32_t *, precorded);
    uint8_t *status = PTR(uint8_t *, pstatus);
    uint8_t *out = PTR(uint8_t *, pout);
    long long failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++) {
        const int64_t p = pages[i];
        const uint8_t *page = base + p * stride;
        const uint64_t head = load_le64(page); /* the header is little-endian */
        const uint32_t got_magic = (uint32_t)head, stored = (uint32_t)(head >> 32);
        const uint64_t number = load_le64(page + 8);
        uint8_t s = 0;
        if (got_magic != magic)
            s = 1;
        else if (number != (uint64_t)p)
            s = 2;
        else if (crc32c(0, page + 8, (size_t)(stride - 8)) != stored)
            s = 3;
        else if (stored != recorded[p])
            s = 4;
        status[i] = s;
        failed += s != 0;
        if (out) memcpy(out + i * out_stride, page + 16, (size_t)payload_bytes);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(failed);
}

PyDoc_STRVAR(gather_units_doc,
             "gather_units(base, stride, ids_at, pages, places, ids, n, col_offsets,\n"
             "             unit_bytes, col_dst, n_cols, dst_at)\n--\n\n"
             "Copy n units out of checked pages of a page file's mapping (strides of `stride`\n"
             "bytes at base) into caller-owned columns. Unit i is in page pages[i] at place\n"
             "places[i]: its id (int64) at byte ids_at + 8*places[i] of the page, and for\n"
             "column c its unit_bytes[c] bytes at col_offsets[c] + places[i]*unit_bytes[c],\n"
             "copied to col_dst[c] + dst_at[i]*unit_bytes[c] (all int64 [n] or [n_cols]; the\n"
             "offsets from the page's start). The ids are checked first against ids[i]:\n"
             "returns -1 when all match (then copies), else the first i that does not (no\n"
             "copy).");

static PyObject *py_gather_units(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long pbase, ppages, pplaces, pids, pcol_off, punit_bytes, pcol_dst, pdst_at;
    long long stride, ids_at, n, n_cols;
    if (!PyArg_ParseTuple(args, "KLLKKKLKKKLK", &pbase, &stride, &ids_at, &ppages, &pplaces,
                          &pids, &n, &pcol_off, &punit_bytes, &pcol_dst, &n_cols, &pdst_at))
        return NULL;
    if (stride <= 0 || ids_at < 0 || n < 0 || n_cols < 0)
        return PyErr_Format(PyExc_ValueError,
                            "gather_units: stride=%lld, ids_at=%lld, n=%lld, n_cols=%lld out "
                            "of range", stride, ids_at, n, n_cols);
    const uint8_t *base = PTR(const uint8_t *, pbase);
    const int64_t *pages = PTR(const int64_t *, ppages);
    const int64_t *places = PTR(const int64_t *, pplaces);
    const int64_t *ids = PTR(const int64_t *, pids);
    const int64_t *col_off = PTR(const int64_t *, pcol_off);
    const int64_t *unit_bytes = PTR(const int64_t *, punit_bytes);
    const unsigned long long *col_dst = PTR(const unsigned long long *, pcol_dst);
    const int64_t *dst_at = PTR(const int64_t *, pdst_at);
    long long bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n && bad < 0; i++) {
        const uint8_t *page = base + pages[i] * stride;
        if ((int64_t)load_le64(page + ids_at + 8 * places[i]) != ids[i]) bad = i;
    }
    if (bad < 0) {
        for (long long i = 0; i < n; i++) {
            const uint8_t *page = base + pages[i] * stride;
            for (long long c = 0; c < n_cols; c++) {
                uint8_t *dst = PTR(uint8_t *, col_dst[c]);
                memcpy(dst + dst_at[i] * unit_bytes[c],
                       page + col_off[c] + places[i] * unit_bytes[c], (size_t)unit_bytes[c]);
            }
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

static PyObject *py_crc32c_impl(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(crc_impl);
}

PyMethodDef hp_page_check_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
    {"crc32c_pages", py_crc32c_pages, METH_VARARGS, crc32c_pages_doc},
    {"check_pages", py_check_pages, METH_VARARGS, check_pages_doc},
    {"gather_units", py_gather_units, METH_VARARGS, gather_units_doc},
    {"crc32c_impl", py_crc32c_impl, METH_NOARGS,
     "The CRC-32C implementation in use: 'sse4.2' or 'slice-by-8'."},
    {NULL, NULL, 0, NULL},
};
