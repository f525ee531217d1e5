/* mlx_streaming._native: batched positional reads on native threads with the GIL released, cache-bypass
 * opens, and CRC32C.
 *
 * Why native: reads issued from Python threads contend for the GIL with the MLX-driving main thread; here a
 * whole batch of reads is handed to a persistent pthread pool and the caller waits with the GIL released.
 * A batch can also be started and its reads taken in order as they finish (read_start), so the caller places
 * the first experts of a load while the pool still reads the rest.
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
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096
#define MAX_THREADS 64
/* Pieces per preadv (at most IOV_MAX, 1024 on Linux and macOS). */
#define IOV_BATCH 256

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

/* A part of a request's destination: the request's bytes fill its pieces in order. */
typedef struct {
    unsigned char *dest;
    int64_t length;
} piece_t;

typedef struct {
    int fd;
    int aligned;       /* O_DIRECT: in place where it fits, else the aligned superset through a bounce buffer */
    int64_t offset;
    int64_t length;
    piece_t *pieces;   /* where the bytes go (their lengths sum to length): one buffer, or several in a row */
    Py_ssize_t n_pieces;
    int64_t got;       /* bytes of [offset, offset + length) delivered */
    int in_place;      /* an aligned read that went straight into its pieces, past the bounce buffer */
    int err;           /* errno, 0 if none */
    int finished;      /* set by the worker that ran it, under pool_lock */
} request_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Set once a read straight into a destination is refused with EFAULT (memory the kernel cannot read into
 * directly, such as some device-managed memory); aligned reads then all go through the bounce buffer. */
static int in_place_refused = 0;

/* Whether an aligned read can skip the bounce buffer: its offset, and every piece's address and length, are
 * multiples of ALIGN (the packed layout's records into page-aligned rows). */
static int fits_in_place(const request_t *rq) {
    if (rq->offset % ALIGN || __atomic_load_n(&in_place_refused, __ATOMIC_RELAXED)) return 0;
    for (Py_ssize_t k = 0; k < rq->n_pieces; k++)
        if ((uintptr_t)rq->pieces[k].dest % ALIGN || rq->pieces[k].length % ALIGN) return 0;
    return 1;
}

/* Fill the pieces in order from `offset`, in place: one preadv for them all (a merged read is one system read,
 * one I/O), again from where a short one stopped, until they are full or the file ends. Sets *got to the bytes
 * read; returns 0 or an errno. */
static int preadv_full(int fd, const piece_t *pieces, Py_ssize_t n_pieces, int64_t offset, int64_t *got) {
    struct iovec iov[IOV_BATCH];
    Py_ssize_t k = 0;  /* the first piece not yet full */
    int64_t into = 0;  /* bytes of piece k already read */
    int err = 0;
    *got = 0;
    while (k < n_pieces) {
        int n = 0;
        for (Py_ssize_t j = k; j < n_pieces && n < IOV_BATCH; j++, n++) {
            int64_t skip = j == k ? into : 0;
            iov[n].iov_base = pieces[j].dest + skip;
            iov[n].iov_len = (size_t)(pieces[j].length - skip);
        }
        ssize_t r = preadv(fd, iov, n, (off_t)(offset + *got));
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) break;
        *got += r;
        into += r;
        while (k < n_pieces && into >= pieces[k].length) into -= pieces[k++].length;
    }
    return err;
}

static void run_request(request_t *rq, unsigned char **bounce, int64_t *bounce_size) {
    if (!rq->aligned) {
        rq->err = preadv_full(rq->fd, rq->pieces, rq->n_pieces, rq->offset, &rq->got);
        return;
    }
    if (fits_in_place(rq)) {
        int err = preadv_full(rq->fd, rq->pieces, rq->n_pieces, rq->offset, &rq->got);
        if (err != EINVAL && err != EFAULT) {
            rq->err = err;
            rq->in_place = 1;
            return;
        }
        /* read again through the bounce buffer; EINVAL may be this read's (a short read left the next one
         * unaligned), EFAULT is the memory's */
        if (err == EFAULT) __atomic_store_n(&in_place_refused, 1, __ATOMIC_RELAXED);
        rq->got = 0;
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
    piece_t whole = {*bounce, span};
    int64_t r;
    int err = preadv_full(rq->fd, &whole, 1, start, &r);
    if (err) { rq->err = err; return; }
    int64_t useful = r - (rq->offset - start);
    if (useful < 0) useful = 0;
    if (useful > rq->length) useful = rq->length;
    int64_t at = 0; /* the useful bytes, copied into the pieces in order */
    for (Py_ssize_t k = 0; k < rq->n_pieces && at < useful; k++) {
        int64_t n = useful - at < rq->pieces[k].length ? useful - at : rq->pieces[k].length;
        memcpy(rq->pieces[k].dest, *bounce + (rq->offset - start) + at, (size_t)n);
        at += n;
    }
    rq->got = useful;
}

/* ------------------------------------------------------------------ the thread pool */

typedef struct batch {
    request_t *reqs;
    Py_ssize_t n, next, done;
    Py_ssize_t ready;  /* requests [0, ready) are finished */
    Py_ssize_t want;   /* the prefix a waiter waits for (0: none): it is woken once, when that is finished */
    int64_t started_ns, finished_ns;
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
        b->reqs[i].finished = 1;
        if (++b->done == b->n) b->finished_ns = now_ns();
        while (b->ready < b->n && b->reqs[b->ready].finished) b->ready++;
        if (b->want && b->ready >= b->want) pthread_cond_signal(&b->finished);
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

/* Queue every request of `b` (n > 0) on the pool; returns 0 or an errno. Called without the GIL. */
static int submit_batch(batch_t *b, int threads) {
    pthread_mutex_lock(&pool_lock);
    int rc = stopping ? ESHUTDOWN : ensure_workers(threads);
    if (!rc) {
        b->started_ns = now_ns();
        if (queue_tail) queue_tail->link = b; else queue_head = b;
        queue_tail = b;
        pthread_cond_broadcast(&pool_wake);
    }
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

/* Block until requests [0, upto) of a submitted batch are finished. Called without the GIL. */
static void wait_batch(batch_t *b, Py_ssize_t upto) {
    pthread_mutex_lock(&pool_lock);
    while (b->ready < upto) {
        b->want = upto;
        pthread_cond_wait(&b->finished, &pool_lock);
    }
    b->want = 0;
    pthread_mutex_unlock(&pool_lock);
}

static void init_batch(batch_t *b, request_t *reqs, Py_ssize_t n) {
    memset(b, 0, sizeof(*b));
    b->reqs = reqs;
    b->n = n;
    pthread_cond_init(&b->finished, NULL);
}

/* ------------------------------------------------------------------ Python entry points */

/* The destination of a request: one writable buffer, or a list or tuple of them (filled in order). */
static Py_ssize_t destination_count(PyObject *destination) {
    return PyList_Check(destination) || PyTuple_Check(destination) ? PySequence_Size(destination) : 1;
}

/* Parse (fd, offset, length, destination, aligned) items into requests whose pieces are the destination buffers'
 * memory (pieces[], a run per request), each held in views[0, *held). Returns 0, or -1 with a Python error set. */
static int parse_requests(PyObject *items, request_t *reqs, piece_t *pieces, Py_buffer *views, Py_ssize_t *held) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        request_t *rq = &reqs[i];
        long long offset, length;
        PyObject *destination;
        if (!PyArg_ParseTuple(item, "iLLOp", &rq->fd, &offset, &length, &destination, &rq->aligned)) return -1;
        int several = PyList_Check(destination) || PyTuple_Check(destination);
        rq->n_pieces = destination_count(destination);
        rq->pieces = pieces + *held;
        int64_t room = 0;
        for (Py_ssize_t k = 0; k < rq->n_pieces; k++) {
            PyObject *buffer = several ? PySequence_Fast_GET_ITEM(destination, k) : destination;
            if (PyObject_GetBuffer(buffer, &views[*held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
            rq->pieces[k].dest = views[*held].buf;
            rq->pieces[k].length = views[*held].len;
            room += views[*held].len;
            (*held)++;
        }
        if (length < 0 || offset < 0 || (several ? room != length : room < length)) {
            PyErr_Format(PyExc_ValueError, "request %zd: destination of %lld bytes for a read of %lld", i,
                         (long long)room, length);
            return -1;
        }
        if (!several) rq->pieces[0].length = length;
        rq->offset = offset;
        rq->length = length;
    }
    return 0;
}

/* A started batch (its requests and their count are the batch's) and the buffers they fill, held until every
 * read has finished. */
typedef struct {
    PyObject_HEAD
    batch_t batch;
    piece_t *pieces;
    Py_buffer *views;
    Py_ssize_t held;
    int submitted;
} PendingObject;

static void pending_dealloc(PendingObject *self) {
    if (self->submitted) {
        Py_BEGIN_ALLOW_THREADS
        wait_batch(&self->batch, self->batch.n); /* the pool may still write into the buffers */
        Py_END_ALLOW_THREADS
    }
    pthread_cond_destroy(&self->batch.finished);
    for (Py_ssize_t i = 0; i < self->held; i++) PyBuffer_Release(&self->views[i]);
    free(self->views);
    free(self->pieces);
    free(self->batch.reqs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(pending_wait_doc,
"wait(upto) -> None or (index, errno, got)\n\n"
"Block, with the GIL released, until requests [0, upto) have finished. Returns None when each of them\n"
"delivered its length; otherwise the first failing one's index, errno (0 for a short read) and bytes.");

static PyObject *pending_wait(PendingObject *self, PyObject *args) {
    Py_ssize_t upto;
    if (!PyArg_ParseTuple(args, "n", &upto)) return NULL;
    if (upto < 0 || upto > self->batch.n) {
        PyErr_Format(PyExc_ValueError, "wait(%zd) on a batch of %zd reads", upto, self->batch.n);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    wait_batch(&self->batch, upto);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < upto; i++) {
        request_t *rq = &self->batch.reqs[i];
        if (rq->err || rq->got != rq->length) return Py_BuildValue("(niL)", i, rq->err, (long long)rq->got);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pending_finished_doc,
"finished() -> int: how many requests, counted from the first, have finished (does not block).");

static PyObject *pending_finished(PendingObject *self, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&pool_lock);
    Py_ssize_t ready = self->batch.ready;
    pthread_mutex_unlock(&pool_lock);
    return PyLong_FromSsize_t(ready);
}

static PyObject *pending_elapsed(PendingObject *self, void *closure) {
    (void)closure;
    pthread_mutex_lock(&pool_lock);
    int64_t started = self->batch.started_ns, finished = self->batch.finished_ns;
    Py_ssize_t n = self->batch.n;
    int done = self->batch.done == n;
    pthread_mutex_unlock(&pool_lock);
    if (!done) Py_RETURN_NONE;
    return PyFloat_FromDouble(n ? (double)(finished - started) / 1e9 : 0.0);
}

static PyObject *pending_in_place(PendingObject *self, void *closure) {
    (void)closure;
    Py_ssize_t count = 0;
    pthread_mutex_lock(&pool_lock);
    for (Py_ssize_t i = 0; i < self->batch.ready; i++) count += self->batch.reqs[i].in_place;
    pthread_mutex_unlock(&pool_lock);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef pending_methods[] = {
    {"wait", (PyCFunction)pending_wait, METH_VARARGS, pending_wait_doc},
    {"finished", (PyCFunction)pending_finished, METH_NOARGS, pending_finished_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pending_getset[] = {
    {"elapsed", (getter)pending_elapsed, NULL,
     "Seconds from the batch's start until its last read finished; None while reads are running.", NULL},
    {"in_place", (getter)pending_in_place, NULL,
     "How many of the finished reads, counted from the first, were aligned reads that went straight into their\n"
     "destination (no bounce buffer).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PendingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mlx_streaming._native.PendingReads",
    .tp_basicsize = sizeof(PendingObject),
    .tp_dealloc = (destructor)pending_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch of reads running on the native pool (read_start).",
    .tp_methods = pending_methods,
    .tp_getset = pending_getset,
};

PyDoc_STRVAR(read_start_doc,
"read_start(requests, threads) -> PendingReads\n\n"
"requests: a sequence of (fd, offset, length, destination, aligned), the destination a writable buffer or a\n"
"list of them whose lengths sum to the read's (filled in order: a read lands in several places). Queues every\n"
"read on the native pool (at least `threads` threads) and returns at once; the result's wait(upto) blocks until\n"
"the first `upto` have finished. The buffers are held until every read has finished.");

static PyObject *py_read_start(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &threads)) return NULL;
    PyObject *items = PySequence_Fast(seq, "requests must be a sequence");
    if (!items) return NULL;
    PendingObject *p = PyObject_New(PendingObject, &PendingType);
    if (!p) { Py_DECREF(items); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        Py_ssize_t count = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 5
                               ? destination_count(PyTuple_GET_ITEM(item, 3)) : 1;
        total += count > 0 ? count : 1;
    }
    init_batch(&p->batch, calloc(n > 0 ? (size_t)n : 1, sizeof(request_t)), n);
    p->pieces = calloc(total > 0 ? (size_t)total : 1, sizeof(piece_t));
    p->views = calloc(total > 0 ? (size_t)total : 1, sizeof(Py_buffer));
    p->held = 0;
    p->submitted = 0;
    if (!p->batch.reqs || !p->pieces || !p->views) PyErr_NoMemory();
    int ok = p->batch.reqs && p->pieces && p->views &&
             parse_requests(items, p->batch.reqs, p->pieces, p->views, &p->held) == 0;
    Py_DECREF(items);
    if (!ok) { Py_DECREF(p); return NULL; }
    if (n) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = submit_batch(&p->batch, threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
        if (rc) {
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(p);
            return NULL;
        }
        p->submitted = 1;
    }
    return (PyObject *)p;
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
    {"read_start", py_read_start, METH_VARARGS, read_start_doc},
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
    if (PyType_Ready(&PendingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m) PyModule_AddIntConstant(m, "ALIGN", ALIGN);
    return m;
}
