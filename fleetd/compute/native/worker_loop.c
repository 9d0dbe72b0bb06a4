/* A compute worker's hot path: the daemon's MSG_RUN (compute the graph the worker holds, nothing
 * else changed: a decode step) answered without the interpreter.
 *
 * fleetd.compute.ggml.worker builds the graph, and hands this loop what WorkerPlan.run does per
 * graph: the padded copies to refresh, the row-id tensors to copy out and check (the kernel reads
 * the copy), the ggml call. The loop peeks at each message's header and takes only a RUN; any
 * other message, a row id out of range or a failed compute goes back to Python, which answers as
 * it always does. The worker trusts its daemon's framing (fleetd.compute.ggml.channel); what it
 * checks here is the client's data, exactly as WorkerPlan.run checks it. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define MSG_RUN 3
#define REPLY_DONE 100
#define CHANNEL_HEADER 16   /* | kind u32 | n_fds u32 | length u64 | */

struct fleetd_copy {        /* a padded tensor: its bytes refreshed into the private copy */
    const uint8_t *src;
    uint8_t *dst;
    uint64_t n;
};

struct fleetd_index_check {  /* row ids: copied out whole, every element the kernel reads checked */
    const uint8_t *src;
    uint8_t *copy;
    uint64_t nbytes;
    int64_t ne[4];
    int64_t nb[4];
    int64_t bound;           /* ids must lie in [0, bound) */
    int32_t elem;            /* 4: int32, 8: int64 */
};

struct fleetd_worker {
    int fd;                  /* the channel to the daemon */
    void *backend;
    void *graph;
    int (*compute)(void *backend, void *graph);            /* ggml_backend_graph_compute */
    void (*set_threads)(void *backend, int n_threads);     /* ggml_backend_cpu_set_n_threads */
    uint32_t threads;        /* in and out: the backend's thread count now */
    int32_t n_copies;
    const struct fleetd_copy *copies;
    int32_t n_checks;
    const struct fleetd_index_check *checks;
    int32_t failed;          /* out: the check that failed, or the ggml status */
    uint64_t runs;           /* out: graphs computed here */
};

enum {
    WORKER_PYTHON = 1,     /* the next message is not a RUN: Python reads it */
    WORKER_REFUSED = 2,    /* a RUN was read; check `failed` holds a row out of range */
    WORKER_FAILED = 3,     /* a RUN was read; ggml returned status `failed` */
    WORKER_CLOSED = 4,     /* the daemon closed the channel */
    WORKER_ERROR = 5,      /* a recv or send failed */
};

static int ids_in_range(const struct fleetd_index_check *c) {
    for (int64_t i3 = 0; i3 < c->ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < c->ne[2]; ++i2)
            for (int64_t i1 = 0; i1 < c->ne[1]; ++i1) {
                const uint8_t *row = c->copy + i1 * c->nb[1] + i2 * c->nb[2] + i3 * c->nb[3];
                for (int64_t i0 = 0; i0 < c->ne[0]; ++i0) {
                    int64_t v;
                    if (c->elem == 4) {
                        int32_t w;
                        memcpy(&w, row + i0 * c->nb[0], 4);
                        v = w;
                    } else {
                        memcpy(&v, row + i0 * c->nb[0], 8);
                    }
                    if (v < 0 || v >= c->bound) return 0;
                }
            }
    return 1;
}

/* One RUN of the built graph with `threads`: the padded copies refreshed, the row ids copied out
 * and checked, the ggml call. 0 when it computed; WORKER_REFUSED or WORKER_FAILED (`failed` then
 * says which check, or ggml's status). Also the session's loop in this worker (fastpath.c's
 * inline recompute) computes through here. */
int fleetd_worker_run(struct fleetd_worker *w, uint32_t threads) {
    if (threads != w->threads) {
        w->set_threads(w->backend, (int)threads);
        w->threads = threads;
    }
    for (int i = 0; i < w->n_copies; ++i) memcpy(w->copies[i].dst, w->copies[i].src, w->copies[i].n);
    for (int i = 0; i < w->n_checks; ++i) {
        const struct fleetd_index_check *c = &w->checks[i];
        memcpy(c->copy, c->src, c->nbytes);
        if (!ids_in_range(c)) {
            w->failed = i;
            return WORKER_REFUSED;
        }
    }
    int status = w->compute(w->backend, w->graph);
    if (status != 0) {
        w->failed = status;
        return WORKER_FAILED;
    }
    w->runs += 1;
    return 0;
}

static int recv_all(int fd, uint8_t *p, size_t n) {
    while (n) {
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k == 0 ? 0 : -1;
        p += k;
        n -= (size_t)k;
    }
    return 1;
}

int fleetd_worker_loop(struct fleetd_worker *w) {
    for (;;) {
        uint8_t msg[CHANNEL_HEADER + 4];
        ssize_t k = recv(w->fd, msg, CHANNEL_HEADER, MSG_PEEK | MSG_WAITALL);
        if (k < 0 && errno == EINTR) continue;
        if (k == 0) return WORKER_CLOSED;
        if (k < CHANNEL_HEADER) return k < 0 ? WORKER_ERROR : WORKER_CLOSED;
        uint32_t kind, n_fds;
        uint64_t length;
        memcpy(&kind, msg, 4);
        memcpy(&n_fds, msg + 4, 4);
        memcpy(&length, msg + 8, 8);
        if (kind != MSG_RUN || n_fds != 0 || length != 4) return WORKER_PYTHON;
        int r = recv_all(w->fd, msg, sizeof msg);
        if (r <= 0) return r == 0 ? WORKER_CLOSED : WORKER_ERROR;
        uint32_t threads;
        memcpy(&threads, msg + CHANNEL_HEADER, 4);
        int answer = fleetd_worker_run(w, threads);
        if (answer != 0) return answer;
        uint8_t done[CHANNEL_HEADER] = {0};
        uint32_t reply = REPLY_DONE;
        memcpy(done, &reply, 4);
        size_t sent = 0;
        while (sent < sizeof done) {
            ssize_t n = send(w->fd, done + sent, sizeof done - sent, MSG_NOSIGNAL);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) return WORKER_ERROR;
            sent += (size_t)n;
        }
    }
}

/* One check as a RUN does it (copy out, then every element in range): 1 when it passes. For the
 * differential test against WorkerPlan.run's numpy check (tests/test_fast_loop.py). */
int fleetd_index_check_passes(const struct fleetd_index_check *c) {
    memcpy(c->copy, c->src, c->nbytes);
    return ids_in_range(c);
}

/* The layout the ctypes mirrors must match (tests/test_fast_path.py). */
size_t fleetd_worker_layout(int which) {
    switch (which) {
    case 0: return sizeof(struct fleetd_worker);
    case 1: return sizeof(struct fleetd_copy);
    case 2: return sizeof(struct fleetd_index_check);
    case 3: return offsetof(struct fleetd_worker, runs);
    case 4: return offsetof(struct fleetd_index_check, elem);
    default: return 0;
    }
}
