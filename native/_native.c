/* mlx_streaming._native: batched positional reads on native threads with the GIL released, cache-bypass
 * opens, and CRC32C.
 *
 * Why native: reads issued from Python threads contend for the GIL with the MLX-driving main thread; here a
 * whole batch of reads is handed to a persistent pthread pool and the caller waits with the GIL released.
 * Every entry point has a pure-Python twin in mlx_streaming/io/native.py; MLX_STREAMING_NATIVE=0 selects
 * the twins. Builds with gcc (Linux) and clang (macOS); POSIX only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ALIGN 4096
#define MAX_THREADS 64

/* ------------------------------------------------------------------ CRC32C (Castagnoli), slicing-by-8 */

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32c(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF]; n--; }
    while (n >= 8) {
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
              crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
              crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF];
    return ~crc;
}

/* ------------------------------------------------------------------ one read */

typedef struct {
    int fd;
    int aligned;       /* O_DIRECT: read the aligned superset into a bounce buffer */
    int64_t offset;
    int64_t length;
    unsigned char *dest;
    int64_t got;       /* bytes of [offset, offset + length) delivered */
    int err;           /* errno, 0 if none */
} request_t;

/* pread until `want` bytes or end of file; returns bytes read or -1 with errno set. */
static int64_t pread_full(int fd, unsigned char *buf, int64_t want, int64_t offset) {
    int64_t total = 0;
    while (total < want) {
        ssize_t r = pread(fd, buf + total, (size_t)(want - total), (off_t)(offset + total));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        total += r;
    }
    return total;
}

static void run_request(request_t *rq, unsigned char **bounce, int64_t *bounce_size) {
    if (!rq->aligned) {
        int64_t r = pread_full(rq->fd, rq->dest, rq->length, rq->offset);
        if (r < 0) rq->err = errno; else rq->got = r;
        return;
    }
    int64_t start = rq->offset - rq->offset % ALIGN;
    int64_t span = ((rq->offset + rq->length - start + ALIGN - 1) / ALIGN) * ALIGN;
    if (*bounce_size < span) {
        free(*bounce);
        *bounce = NULL;
        *bounce_size = 0;
        void *p = NULL;
        if (posix_memalign(&p, ALIGN, (size_t)span) != 0) { rq->err = ENOMEM; return; }
        *bounce = p;
        *bounce_size = span;
    }
    int64_t r = pread_full(rq->fd, *bounce, span, start);
    if (r < 0) { rq->err = errno; return; }
    int64_t useful = r - (rq->offset - start);
    if (useful < 0) useful = 0;
    if (useful > rq->length) useful = rq->length;
    memcpy(rq->dest, *bounce + (rq->offset - start), (size_t)useful);
    rq->got = useful;
}

/* ------------------------------------------------------------------ the thread pool */

typedef struct batch {
    request_t *reqs;
    Py_ssize_t n, next, done;
    pthread_cond_t finished;
    struct batch *link;
} batch_t;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static batch_t *queue_head = NULL, *queue_tail = NULL;
static pthread_t workers[MAX_THREADS];
static int n_workers = 0, stopping = 0;

static void *worker_main(void *unused) {
    (void)unused;
    unsigned char *bounce = NULL;
    int64_t bounce_size = 0;
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (!queue_head && !stopping) pthread_cond_wait(&pool_wake, &pool_lock);
        if (!queue_head) break; /* stopping and nothing left */
        batch_t *b = queue_head;
        Py_ssize_t i = b->next++;
        if (b->next == b->n) {
            queue_head = b->link;
            if (!queue_head) queue_tail = NULL;
        }
        pthread_mutex_unlock(&pool_lock);
        run_request(&b->reqs[i], &bounce, &bounce_size);
        pthread_mutex_lock(&pool_lock);
        if (++b->done == b->n) pthread_cond_signal(&b->finished);
    }
    pthread_mutex_unlock(&pool_lock);
    free(bounce);
    return NULL;
}

/* Start workers up to `wanted` (the pool only grows); returns 0 or an errno. Called with pool_lock held. */
static int ensure_workers(int wanted) {
    if (wanted > MAX_THREADS) wanted = MAX_THREADS;
    while (n_workers < wanted) {
        int rc = pthread_create(&workers[n_workers], NULL, worker_main, NULL);
        if (rc) return n_workers ? 0 : rc;
        n_workers++;
    }
    return 0;
}

/* Run every request on the pool; blocks until all are done. Called without the GIL. */
static int run_batch(request_t *reqs, Py_ssize_t n, int threads) {
    batch_t b = {reqs, n, 0, 0, PTHREAD_COND_INITIALIZER, NULL};
    pthread_mutex_lock(&pool_lock);
    int rc = stopping ? ESHUTDOWN : ensure_workers(threads);
    if (rc) {
        pthread_mutex_unlock(&pool_lock);
        return rc;
    }
    if (queue_tail) queue_tail->link = &b; else queue_head = &b;
    queue_tail = &b;
    pthread_cond_broadcast(&pool_wake);
    while (b.done < b.n) pthread_cond_wait(&b.finished, &pool_lock);
    pthread_mutex_unlock(&pool_lock);
    pthread_cond_destroy(&b.finished);
    return 0;
}

/* ------------------------------------------------------------------ Python entry points */

PyDoc_STRVAR(read_batch_doc,
"read_batch(requests, threads) -> None or (index, errno, got)\n\n"
"requests: a sequence of (fd, offset, length, writable buffer, aligned). Reads run on the native pool\n"
"with the GIL released. Returns None when every read delivered its length; otherwise the first failing\n"
"request's index, its errno (0 for a short read) and the bytes it delivered.");

static PyObject *py_read_batch(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &threads)) return NULL;
    PyObject *items = PySequence_Fast(seq, "requests must be a sequence");
    if (!items) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    request_t *reqs = calloc(n ? n : 1, sizeof(request_t));
    Py_buffer *views = calloc(n ? n : 1, sizeof(Py_buffer));
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (!reqs || !views) { PyErr_NoMemory(); goto done; }
    for (; held < n; held++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, held);
        request_t *rq = &reqs[held];
        long long offset, length;
        PyObject *buffer;
        if (!PyArg_ParseTuple(item, "iLLOp", &rq->fd, &offset, &length, &buffer, &rq->aligned)) goto done;
        if (PyObject_GetBuffer(buffer, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (length < 0 || offset < 0 || views[held].len < length) {
            PyBuffer_Release(&views[held]);
            PyErr_Format(PyExc_ValueError, "request %zd: buffer of %zd bytes for a read of %lld", held,
                         views[held].len, length);
            goto done;
        }
        rq->offset = offset;
        rq->length = length;
        rq->dest = views[held].buf;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = n ? run_batch(reqs, n, threads < 1 ? 1 : threads) : 0;
    Py_END_ALLOW_THREADS
    if (rc) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_None;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (reqs[i].err || reqs[i].got != reqs[i].length) {
            result = Py_BuildValue("(niL)", i, reqs[i].err, (long long)reqs[i].got);
            break;
        }
    }
    if (result == Py_None) Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    free(views);
    free(reqs);
    Py_DECREF(items);
    return result;
}

PyDoc_STRVAR(crc32c_doc, "crc32c(buffer, crc=0) -> int: CRC32C (Castagnoli) of buffer, continuing from crc.");

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &crc)) return NULL;
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = crc32c(crc, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(out);
}

PyDoc_STRVAR(open_uncached_doc,
"open_uncached(path) -> fd\n\n"
"Open for reading past the page cache: O_DIRECT on Linux (OSError EINVAL where the filesystem refuses\n"
"it), F_NOCACHE on macOS.");

static PyObject *py_open_uncached(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path_obj)) return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    int fd, err = 0;
    Py_BEGIN_ALLOW_THREADS
#if defined(__linux__)
    fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) err = errno;
#elif defined(__APPLE__)
    fd = open(path, O_RDONLY);
    if (fd < 0) err = errno;
    else if (fcntl(fd, F_NOCACHE, 1) < 0) { err = errno; close(fd); fd = -1; }
#else
    fd = -1;
    err = ENOTSUP;
#endif
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        Py_DECREF(path_obj);
        return NULL;
    }
    Py_DECREF(path_obj);
    return PyLong_FromLong(fd);
}

static PyObject *py_shutdown(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool_lock);
    stopping = 1;
    pthread_cond_broadcast(&pool_wake);
    int count = n_workers;
    n_workers = 0;
    pthread_mutex_unlock(&pool_lock);
    for (int i = 0; i < count; i++) pthread_join(workers[i], NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_pool_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&pool_lock);
    int count = n_workers;
    pthread_mutex_unlock(&pool_lock);
    return PyLong_FromLong(count);
}

static PyMethodDef methods[] = {
    {"read_batch", py_read_batch, METH_VARARGS, read_batch_doc},
    {"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
    {"open_uncached", py_open_uncached, METH_VARARGS, open_uncached_doc},
    {"shutdown", py_shutdown, METH_NOARGS, "Stop and join the read pool's threads (interpreter exit)."},
    {"pool_threads", py_pool_threads, METH_NOARGS, "Number of running read-pool threads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Native expert I/O for mlx_streaming.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m) PyModule_AddIntConstant(m, "ALIGN", ALIGN);
    return m;
}
