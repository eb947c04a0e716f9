/* The converter's per-byte work on FP8 expert codes, in one pass per strip of blocks: the +-240 / NaN scan, the
 * halving of flagged blocks and the [out, in] -> [in, out] byte transpose (torch has no fast byte transpose: its
 * strided copy costs ~0.75 CPU-s/GB here, this ~0.15). Semantics are quant/nxd_fp8.py's (rescale_blocks,
 * halve_codes, transpose_into), which stay as the fallback where this module is not built; the tests hold the two
 * to the same bytes. Called with the GIL released, so the converter's worker threads run it side by side.
 *
 * For m = b & 0x7F: |value| > 240 <=> m > 0x77; 0x7F is NaN. Halving: m >= 0x10 loses one exponent step (b - 8,
 * exact); below, the value is m * 2^-9 and its half m / 2 rounded to nearest even (inexact when m is odd). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX2_TILES 1 /* built for AVX2 too, used where the CPU has it (module init) */
static int have_avx2;
#endif

typedef Py_ssize_t idx;

static inline uint8_t halve(uint8_t b) {
    uint8_t m = b & 0x7F;
    if (m >= 0x10) return (uint8_t)(b - 8);
    return (uint8_t)((b & 0x80) | ((m >> 1) + (m & (m >> 1) & 1)));
}

/* The blocks of rows [r0, r0 + br): whether a magnitude exceeds 0x77 (flags[c / bc]) and whether one is 0x7F (the
 * return value). Compiled twice, for the baseline and for AVX2 (the byte max vectorizes either way). */
static inline __attribute__((always_inline)) int scan_body(const uint8_t *src, idx cols, idx r0, idx br, idx bc,
                                                           uint8_t *colmax, uint8_t *flags) {
    memset(colmax, 0, (size_t)cols);
    for (idx r = r0; r < r0 + br; r++) {
        const uint8_t *row = src + r * cols;
        for (idx c = 0; c < cols; c++) {
            uint8_t m = row[c] & 0x7F;
            colmax[c] = m > colmax[c] ? m : colmax[c];
        }
    }
    int nan = 0;
    for (idx j = 0; j < cols; j += bc) {
        uint8_t most = 0;
        for (idx c = j; c < j + bc; c++) most = colmax[c] > most ? colmax[c] : most;
        flags[j / bc] = most > 0x77;
        nan |= most == 0x7F;
    }
    return nan;
}

static int scan_plain(const uint8_t *src, idx cols, idx r0, idx br, idx bc, uint8_t *colmax, uint8_t *flags) {
    return scan_body(src, cols, r0, br, bc, colmax, flags);
}

#ifdef AVX2_TILES
__attribute__((target("avx2"))) static int scan_avx2(const uint8_t *src, idx cols, idx r0, idx br, idx bc,
                                                     uint8_t *colmax, uint8_t *flags) {
    return scan_body(src, cols, r0, br, bc, colmax, flags);
}
#endif

static int scan_blocks(const uint8_t *src, idx cols, idx r0, idx br, idx bc, uint8_t *colmax, uint8_t *flags) {
#ifdef AVX2_TILES
    if (have_avx2) return scan_avx2(src, cols, r0, br, bc, colmax, flags);
#endif
    return scan_plain(src, cols, r0, br, bc, colmax, flags);
}

/* flags (may be NULL): [rows/br, cols/bc], 1 where the block is halved. */
static idx scalar_part(const uint8_t *src, uint8_t *dst, idx rows, idx cols, idx r0, idx n, idx br, idx bc,
                       const uint8_t *flags) {
    idx inexact = 0;
    for (idx r = r0; r < r0 + n; r++) {
        const uint8_t *f = flags ? flags + (r / br) * (cols / bc) : NULL;
        for (idx c = 0; c < cols; c++) {
            uint8_t b = src[r * cols + c];
            if (f && f[c / bc]) {
                uint8_t m = b & 0x7F;
                inexact += m < 0x10 && (m & 1);
                b = halve(b);
            }
            dst[c * rows + r] = b;
        }
    }
    return inexact;
}

#if defined(__SSE2__)
/* Halves 16 codes; counts the inexact ones into the byte lanes of *odd (one per code: at most 16 per tile). */
static inline __m128i halve16(__m128i v, __m128i *odd) {
    const __m128i lo7 = _mm_set1_epi8(0x7F), one = _mm_set1_epi8(1);
    __m128i m = _mm_and_si128(v, lo7);
    __m128i big = _mm_cmpgt_epi8(m, _mm_set1_epi8(0x0F)); /* m <= 0x7F: a signed compare is exact */
    __m128i half = _mm_and_si128(_mm_srli_epi16(m, 1), lo7);
    __m128i small = _mm_or_si128(_mm_and_si128(v, _mm_set1_epi8((char)0x80)),
                                 _mm_add_epi8(half, _mm_and_si128(_mm_and_si128(m, half), one)));
    *odd = _mm_add_epi8(*odd, _mm_andnot_si128(big, _mm_and_si128(m, one)));
    return _mm_or_si128(_mm_and_si128(big, _mm_sub_epi8(v, _mm_set1_epi8(8))), _mm_andnot_si128(big, small));
}

/* One 16 x 16 tile: 16 rows of src at `in` (row stride si) -> 16 rows of dst at `out` (row stride so), halved when
 * `flagged`. Four rounds of interleaving: bytes of row pairs, then 2-byte, 4-byte and 8-byte groups: whole columns. */
static inline void tile16(const uint8_t *in, idx si, uint8_t *out, idx so, int flagged, idx *inexact) {
    __m128i a[16], b[16], d[16], odd = _mm_setzero_si128();
    for (int i = 0; i < 16; i++) {
        a[i] = _mm_loadu_si128((const __m128i *)(in + i * si));
        if (flagged) a[i] = halve16(a[i], &odd);
    }
    if (flagged) {  /* the lane counts summed (no popcount instruction in baseline x86-64) */
        __m128i sums = _mm_sad_epu8(odd, _mm_setzero_si128());
        *inexact += _mm_cvtsi128_si32(sums) + _mm_cvtsi128_si32(_mm_srli_si128(sums, 8));
    }
    for (int k = 0; k < 8; k++) {  /* b[8h + k]: rows 2k, 2k+1; columns 8h .. 8h+7 */
        b[k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
        b[8 + k] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
    }
    for (int h = 0; h < 2; h++)  /* a[4q + m]: rows 4m .. 4m+3; columns 4q .. 4q+3 */
        for (int m = 0; m < 4; m++) {
            a[8 * h + m] = _mm_unpacklo_epi16(b[8 * h + 2 * m], b[8 * h + 2 * m + 1]);
            a[8 * h + 4 + m] = _mm_unpackhi_epi16(b[8 * h + 2 * m], b[8 * h + 2 * m + 1]);
        }
    for (int q = 0; q < 4; q++)  /* d[2e + n]: rows 8n .. 8n+7; columns 2e, 2e+1 */
        for (int n = 0; n < 2; n++) {
            d[2 * (2 * q) + n] = _mm_unpacklo_epi32(a[4 * q + 2 * n], a[4 * q + 2 * n + 1]);
            d[2 * (2 * q + 1) + n] = _mm_unpackhi_epi32(a[4 * q + 2 * n], a[4 * q + 2 * n + 1]);
        }
    for (int e = 0; e < 8; e++) {
        _mm_storeu_si128((__m128i *)(out + 2 * e * so), _mm_unpacklo_epi64(d[2 * e], d[2 * e + 1]));
        _mm_storeu_si128((__m128i *)(out + (2 * e + 1) * so), _mm_unpackhi_epi64(d[2 * e], d[2 * e + 1]));
    }
}

#ifdef AVX2_TILES
/* tile16 on two tiles side by side (columns c .. c+31), as two 128-bit lanes: AVX2's unpacks stay within a lane,
 * so the same network transposes both; lane 0 gives output rows c .., lane 1 rows c+16 ... Halved whole when
 * `flagged` (both tiles in one block: bc % 32 == 0). */
__attribute__((target("avx2"))) static inline __m256i halve32(__m256i v, __m256i *odd) {
    const __m256i lo7 = _mm256_set1_epi8(0x7F), one = _mm256_set1_epi8(1);
    __m256i m = _mm256_and_si256(v, lo7);
    __m256i big = _mm256_cmpgt_epi8(m, _mm256_set1_epi8(0x0F));
    __m256i half = _mm256_and_si256(_mm256_srli_epi16(m, 1), lo7);
    __m256i small = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi8((char)0x80)),
                                    _mm256_add_epi8(half, _mm256_and_si256(_mm256_and_si256(m, half), one)));
    *odd = _mm256_add_epi8(*odd, _mm256_andnot_si256(big, _mm256_and_si256(m, one)));
    return _mm256_blendv_epi8(small, _mm256_sub_epi8(v, _mm256_set1_epi8(8)), big);
}

__attribute__((target("avx2"))) static void tile16x32(const uint8_t *in, idx si, uint8_t *out, idx so, int flagged,
                                                      idx *inexact) {
    __m256i a[16], b[16], d[16], odd = _mm256_setzero_si256();
    for (int i = 0; i < 16; i++) {
        a[i] = _mm256_loadu_si256((const __m256i *)(in + i * si));
        if (flagged) a[i] = halve32(a[i], &odd);
    }
    if (flagged) {
        __m256i sums = _mm256_sad_epu8(odd, _mm256_setzero_si256());
        *inexact += _mm256_extract_epi64(sums, 0) + _mm256_extract_epi64(sums, 1) + _mm256_extract_epi64(sums, 2) +
                    _mm256_extract_epi64(sums, 3);
    }
    for (int k = 0; k < 8; k++) {
        b[k] = _mm256_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
        b[8 + k] = _mm256_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
    }
    for (int h = 0; h < 2; h++)
        for (int m = 0; m < 4; m++) {
            a[8 * h + m] = _mm256_unpacklo_epi16(b[8 * h + 2 * m], b[8 * h + 2 * m + 1]);
            a[8 * h + 4 + m] = _mm256_unpackhi_epi16(b[8 * h + 2 * m], b[8 * h + 2 * m + 1]);
        }
    for (int q = 0; q < 4; q++)
        for (int n = 0; n < 2; n++) {
            d[2 * (2 * q) + n] = _mm256_unpacklo_epi32(a[4 * q + 2 * n], a[4 * q + 2 * n + 1]);
            d[2 * (2 * q + 1) + n] = _mm256_unpackhi_epi32(a[4 * q + 2 * n], a[4 * q + 2 * n + 1]);
        }
    for (int e = 0; e < 8; e++) {
        __m256i x = _mm256_unpacklo_epi64(d[2 * e], d[2 * e + 1]), y = _mm256_unpackhi_epi64(d[2 * e], d[2 * e + 1]);
        _mm_storeu_si128((__m128i *)(out + 2 * e * so), _mm256_castsi256_si128(x));
        _mm_storeu_si128((__m128i *)(out + (2 * e + 1) * so), _mm256_castsi256_si128(y));
        _mm_storeu_si128((__m128i *)(out + (16 + 2 * e) * so), _mm256_extracti128_si256(x, 1));
        _mm_storeu_si128((__m128i *)(out + (17 + 2 * e) * so), _mm256_extracti128_si256(y, 1));
    }
}
#endif

#define STRIP_MAX 256 /* rows per strip at most (the local buffer below) */
#define SQUARE 64     /* columns per square */

/* Rows [r0, r0 + n) (n a multiple of 16, at most STRIP_MAX; cols a multiple of 16), read while in cache (the caller
 * has just scanned or touched them: a strided read straight from memory runs ~2x slower here), in squares of n x 64
 * through a local buffer, each finished output line written once with a non-temporal store (no read for ownership). */
static idx sse2_part(const uint8_t *src, uint8_t *dst, idx rows, idx cols, idx r0, idx n, idx br, idx bc,
                     const uint8_t *flags) {
    uint8_t buf[STRIP_MAX * SQUARE] __attribute__((aligned(64)));
    idx inexact = 0;
    int stream = ((uintptr_t)dst % 16 == 0) && rows % 16 == 0;
    for (idx cs = 0; cs < cols; cs += SQUARE) {
        idx w = cols - cs < SQUARE ? cols - cs : SQUARE;
        for (idx r = 0; r < n; r += 16) {
            const uint8_t *f = flags ? flags + ((r0 + r) / br) * (cols / bc) : NULL;
            idx c = 0;
#ifdef AVX2_TILES
            if (have_avx2 && (!f || bc % 32 == 0))
                for (; c + 32 <= w; c += 32)
                    tile16x32(src + (r0 + r) * cols + cs + c, cols, buf + c * n + r, n, f && f[(cs + c) / bc],
                              &inexact);
#endif
            for (; c < w; c += 16)
                tile16(src + (r0 + r) * cols + cs + c, cols, buf + c * n + r, n, f && f[(cs + c) / bc], &inexact);
        }
        for (idx c = 0; c < w; c++) {
            uint8_t *o = dst + (cs + c) * rows + r0;
            const uint8_t *i = buf + c * n;
            if (stream)
                for (idx k = 0; k < n; k += 16)
                    _mm_stream_si128((__m128i *)(o + k), _mm_load_si128((const __m128i *)(i + k)));
            else
                memcpy(o, i, (size_t)n);
        }
    }
    return inexact;
}

static void touch(const uint8_t *p, idx n) {  /* bring n bytes into cache, one load per 64-byte line */
    __m128i acc = _mm_setzero_si128();
    for (idx k = 0; k + 16 <= n; k += 64) acc = _mm_or_si128(acc, _mm_loadu_si128((const __m128i *)(p + k)));
    volatile int sink = _mm_cvtsi128_si32(acc);
    (void)sink;
}
#endif

/* Strips of whole blocks, about 128 rows: each output line then gets 128 bytes, two whole cache lines. (Narrower
 * parts, 1024 or 2048 columns, ran 15-25% slower here.) */
static idx strip_rows(idx br) {
    idx n = br;
    while (n + br <= 128) n += br;
    return n;
}

static int parse(PyObject *args, uint8_t **src, uint8_t **dst, idx *rows, idx *cols, idx *br, idx *bc,
                 uint8_t **flags) {
    unsigned long long s, d, f;
    if (!PyArg_ParseTuple(args, "KKnnnnK", &s, &d, rows, cols, br, bc, &f)) return 0;
    if (*rows < 0 || *cols < 0 || *br <= 0 || *bc <= 0 || *rows % *br || *cols % *bc) {
        PyErr_SetString(PyExc_ValueError, "rows and cols must be multiples of the block");
        return 0;
    }
    *src = (uint8_t *)(uintptr_t)s, *dst = (uint8_t *)(uintptr_t)d, *flags = (uint8_t *)(uintptr_t)f;
    return 1;
}

/* expert(src, dst, rows, cols, br, bc, flags) -> inexact codes, or -1 (and dst partly written) on a NaN code.
 * flags: [rows/br, cols/bc] bytes, 1 where the block was halved. */
static PyObject *expert(PyObject *self, PyObject *args) {
    uint8_t *src, *dst, *flags;
    idx rows, cols, br, bc, inexact = 0;
    int nan = 0;
    if (!parse(args, &src, &dst, &rows, &cols, &br, &bc, &flags)) return NULL;
    uint8_t *colmax = PyMem_RawMalloc(cols ? (size_t)cols : 1);
    if (!colmax) return PyErr_NoMemory();
    idx h = strip_rows(br), nb = cols / bc;
    Py_BEGIN_ALLOW_THREADS
    for (idx rs = 0; rs < rows && !nan; rs += h) {
        idx n = rows - rs < h ? rows - rs : h;
        for (idx rb = rs; rb < rs + n; rb += br)  /* the scan also brings the strip into cache for the transpose */
            nan |= scan_blocks(src, cols, rb, br, bc, colmax, flags + rb / br * nb);
        if (nan) break;
#if defined(__SSE2__)
        if (br % 16 == 0 && bc % 16 == 0 && n <= STRIP_MAX)
            inexact += sse2_part(src, dst, rows, cols, rs, n, br, bc, flags);
        else
#endif
            inexact += scalar_part(src, dst, rows, cols, rs, n, br, bc, flags);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the non-temporal stores are visible before another thread reads dst */
#endif
    Py_END_ALLOW_THREADS
    PyMem_RawFree(colmax);
    return PyLong_FromSsize_t(nan ? -1 : inexact);
}

/* transpose(src, dst, rows, cols): dst[c, r] = src[r, c] for byte matrices. */
static PyObject *transpose(PyObject *self, PyObject *args) {
    unsigned long long s, d;
    idx rows, cols;
    if (!PyArg_ParseTuple(args, "KKnn", &s, &d, &rows, &cols)) return NULL;
    const uint8_t *src = (const uint8_t *)(uintptr_t)s;
    uint8_t *dst = (uint8_t *)(uintptr_t)d;
    Py_BEGIN_ALLOW_THREADS
    idx body = 0;
#if defined(__SSE2__)
    if (cols % 16 == 0) {
        body = rows - rows % 16;
        for (idx rs = 0; rs < body; rs += 128) {
            idx n = body - rs < 128 ? body - rs : 128;
            touch(src + rs * cols, n * cols);
            sse2_part(src, dst, rows, cols, rs, n, 1, 1, NULL);
        }
        _mm_sfence();
    }
#endif
    scalar_part(src, dst, rows, cols, body, rows - body, 1, 1, NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}


/* use_avx2(on) -> whether the AVX2 tiles are used now (never where the CPU lacks AVX2): tests run both paths. */
static PyObject *use_avx2(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#ifdef AVX2_TILES
    have_avx2 = on && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(have_avx2);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"expert", expert, METH_VARARGS, "scan, halve flagged blocks and transpose FP8 expert codes"},
    {"transpose", transpose, METH_VARARGS, "byte-matrix transpose"},
    {"use_avx2", use_avx2, METH_VARARGS, "turn the AVX2 tiles on or off (tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fp8_bytes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fp8_bytes(void) {
#ifdef AVX2_TILES
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
