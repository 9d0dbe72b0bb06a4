/* The session's fast path: SET_TENSOR and GET_TENSOR requests that are already whole in the
 * receive buffer, on buffers the session itself allocated, served without the interpreter.
 *
 * It only ever serves a request that every check of fleetd's Python path (regions.region, the
 * stock server's rules) accepts, and stops at the first one it is not sure of: another command,
 * a request not whole yet, a buffer of another session, the cache flag, a model weight (its
 * layer is recorded in Python), a size of 0, anything out of bounds. Python then serves that
 * one, with its own error and its connection closed if it is wrong. So the rules stay in one
 * place and this file adds no new ones; what it must get right is the bounds arithmetic below,
 * done in 128 bits so no wire value can wrap it.
 *
 * Buffers of the session can only be freed by the session's own thread, which is the one
 * calling here, so the host pointers in `regions` stay valid for the call. */
#define _GNU_SOURCE  /* POLLRDHUP */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

#include "peer_stage.h"

#define CMD_GET_ALIGNMENT 1
#define CMD_SET_TENSOR 6
#define CMD_GET_TENSOR 8
#define CMD_GRAPH_RECOMPUTE 16
#define CMD_COPY_TENSOR_TO_ASYNC 0x42
#define CMD_PEER_PUSH 0x44
#define CMD_PEER_GATE 0x47
#define HEADER 9          /* | cmd u8 | payload_size u64 | */
#define FAST_DEVICES 8    /* GET_ALIGNMENT answered in C for up to this many devices */
#define TENSOR 296        /* rpc_tensor */
#define SET_FIXED 305     /* tensor, cache_flag u8, offset u64 */
#define GET_PAYLOAD 312   /* tensor, offset u64, size u64 */
#define GATE_PAYLOAD 16   /* stream u64, seq u64 */
#define STREAM_MIN 4096  /* a SET this large still arriving streams into its tensor */
#define COPY_FIXED 620    /* src, dst tensors, size u64, stream u64, seq u64, endpoint_len u32 */

/* rpc_tensor's fields, at their wire offsets (little endian, packed) */
#define T_TYPE 8
#define T_BUFFER 12
#define T_NE 20      /* u32[4] */
#define T_NB 36      /* u32[4] */
#define T_DATA 220
#define T_NAME 228

typedef unsigned __int128 u128;

struct fleetd_region {   /* one buffer of the session: its handle, its range, its memory */
    uint64_t handle;
    uint64_t base;
    uint64_t size;
    uint8_t *host;
    uint64_t written;     /* set to 1 when a SET_TENSOR wrote into it (Python bumps generation) */
};

struct fleetd_served {   /* what C served, for the session's counters: they only grow */
    uint64_t set_count, set_bytes;   /* request bytes, header included */
    uint64_t get_count, get_bytes, get_reply_bytes;
    uint64_t recompute_count, recompute_ns;   /* GRAPH_RECOMPUTEs run in the worker, their time */
    uint64_t gate_count;                      /* PEER_GATEs answered 1 */
    uint64_t push_count, push_bytes;          /* PEER_PUSHes staged, request bytes */
    uint64_t copy_count, copy_bytes;          /* COPY_TENSOR_TO_ASYNCs pushed, request bytes */
    uint64_t align_count;                     /* GET_ALIGNMENTs answered */
};

static uint64_t u64_at(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t u32_at(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* The region [data + offset, + size) of the tensor at `t`, checked as regions.region checks it;
 * NULL when any rule fails or it is not the session's buffer (Python then decides). */
static uint8_t *checked_region(const uint8_t *t, uint64_t offset, uint64_t size,
                               struct fleetd_region *regions, int n_regions,
                               const uint32_t *blck, const uint32_t *tsize, uint32_t n_types,
                               struct fleetd_region **which) {
    uint32_t type = u32_at(t + T_TYPE);
    if (type >= n_types || blck[type] == 0 || size == 0) return NULL;
    uint64_t handle = u64_at(t + T_BUFFER);
    struct fleetd_region *r = NULL;
    for (int i = 0; i < n_regions; ++i) {
        if (regions[i].handle == handle) { r = &regions[i]; break; }
    }
    if (r == NULL || handle == 0) return NULL;
    uint64_t ne[4], nb[4];
    for (int i = 0; i < 4; ++i) {
        ne[i] = u32_at(t + T_NE + 4 * i);
        nb[i] = u32_at(t + T_NB + 4 * i);
        if (ne[i] == 0) return NULL;  /* nbytes 0: only size 0 could pass, and that is Python's */
    }
    /* ggml_nbytes, exactly, without wrapping */
    u128 rest = (u128)(ne[1] - 1) * nb[1] + (u128)(ne[2] - 1) * nb[2] + (u128)(ne[3] - 1) * nb[3];
    u128 nbytes = blck[type] == 1 ? (u128)tsize[type] + (u128)(ne[0] - 1) * nb[0] + rest
                                  : (u128)ne[0] * nb[0] / blck[type] + rest;
    u128 data = u64_at(t + T_DATA);
    u128 p0 = r->base, p1 = (u128)r->base + r->size;
    if (data < p0 || data + nbytes > p1) return NULL;              /* the tensor's extent */
    u128 at = data + offset;
    if (at < p0 || at >= p1 || (u128)size > p1 - at) return NULL;  /* the region */
    if ((u128)offset + size > nbytes) return NULL;                 /* ggml's assert */
    *which = r;
    return r->host + (uint64_t)(at - p0);
}

/* Send all of iov[0, n) (the iovecs advanced as it goes); 0, or -errno (EAGAIN:
 * SO_SNDTIMEO ran out). A reply here, a PEER_PUSH on a route in peer_stage.c. */
int fleetd_send_all(int fd, struct iovec *iov, int n) {
    int first = 0;
    while (first < n) {
        struct msghdr msg = {0};
        msg.msg_iov = &iov[first];
        msg.msg_iovlen = (size_t)(n - first);
        ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        while (first < n && (size_t)k >= iov[first].iov_len) {
            k -= (ssize_t)iov[first].iov_len;
            ++first;
        }
        if (first < n) {
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + k;
            iov[first].iov_len -= (size_t)k;
        }
    }
    return 0;
}

/* The session's stored graph, armed by Python for one fleetd_fast_loop call: a GRAPH_RECOMPUTE
 * of `device` is then handed to the session's compute worker here (the channel's MSG_RUN), as
 * fleetd.compute.ggml.workers would, while nothing it depends on can change: the session's own
 * thread is the one in this call (so its stored graph, buffers and worker stay), the worker's
 * lock is held (the reaper cannot take it), and a free by any session bumps `*frees`. */
struct fleetd_recompute {
    int32_t device;          /* -1: not armed, every GRAPH_RECOMPUTE is Python's */
    int32_t worker_fd;       /* the channel to the session's worker */
    uint32_t threads;        /* its threads when this session is the only one computing */
    int32_t n_written;
    const int32_t *written;  /* regions the graph writes: marked written (generation bump) */
    const uint64_t *frees;   /* the registry's count of frees, ... */
    uint64_t frees_seen;     /* ... as it was when the stored graph was last checked */
    int32_t *computing;      /* sessions computing now (the pool's count, atomic) */
    int64_t timeout_ns;      /* the per-graph deadline */
    int64_t started_ns;      /* out: CLOCK_MONOTONIC when the last one was handed over */
    /* In the session's worker itself (it serves the connection during a stint): the graph is
     * computed right here, no channel; `worker_fd` unused. NULL in the daemon. */
    void *inline_worker;     /* worker_loop.c's struct fleetd_worker */
    int32_t inline_status;   /* out: fleetd_worker_run's answer for the last one (0: computed) */
    int32_t yield_asked;     /* a stint's: set by its daemon in the shared page when another
                              * session starts computing; the loop then ends between requests */
};

int fleetd_worker_run(void *worker, uint32_t threads);

/* A SET_TENSOR too large for the loop's buffer is streamed into its tensor here, under the
 * session's rules for a started request (Session.recv_in_request), which Python sets once. */
struct fleetd_body {
    int32_t timeout_ms;      /* request_timeout; 0: such SETs are Python's */
    int32_t why;             /* out, with LOOP_BODY: fleetd_recv_body's reason */
    uint64_t min_rate;       /* min_request_rate, bytes a second */
    int64_t waited_ns;       /* out: the cut request's time spent waiting ... */
    uint64_t got;            /* ... and its bytes, for the message */
    int32_t cmd;             /* out, with LOOP_BODY: the command whose body was cut */
    int32_t reserved;
};

/* The asynchronous peer copy's destination side in the loop (peer_stage.c): a PEER_PUSH whose
 * destination Python vouched for is staged, a PEER_GATE whose copy is staged (or arrives within
 * gate_ms) is written into the session's own buffer and answered 1. Anything else, a refusal
 * or a wait that runs on included, is Python's, which decides and says why as before. */
struct fleetd_peer {
    struct fleetd_streams *streams;  /* NULL: both commands are Python's */
    int64_t owner;                   /* this session's id (its streams' owner) */
    const int32_t *p2p;              /* the daemon's P2P switch */
    const uint64_t *frees;           /* the registry's count of frees */
    int32_t gate_ms;
    int32_t n_routes;
    struct fleetd_route **routes;    /* the source side: links this session may push on */
};

struct fleetd_fast {      /* one session's fast path, set up once, passed by pointer */
    int fd;
    int n_regions;
    struct fleetd_region *regions;
    const uint32_t *blck;    /* per ggml type: elements per block (0: no such type) */
    const uint32_t *tsize;   /* per ggml type: bytes per block */
    uint32_t n_types;
    int error;               /* 0, or -errno of a reply that could not be sent */
    struct fleetd_served served;
    uint64_t have;           /* fleetd_fast_loop: bytes of a request left at the buffer's front */
    struct fleetd_recompute rc;
    struct fleetd_body body;
    struct fleetd_peer peer;
    uint64_t align[FAST_DEVICES];  /* GET_ALIGNMENT's answer per device (a constant of it) */
    int32_t n_align;         /* devices in align[]; 0: every GET_ALIGNMENT is Python's */
};

/* Replies of one run of pipelined requests, gathered: a GATE and the sync behind it, or pushes
 * that came together, leave in one send (and wake their reader once) where each was a send. It
 * is flushed before anything that can wait (a recv, a gate, the worker, a streamed body) and
 * when the loop returns, so no answer waits behind another request's wait. */
#define OUT_CAP 16384
#define OUT_COPY_MAX 4096   /* a larger reply is not copied: it leaves now, behind the gathered */
struct out {
    size_t n;
    uint8_t buf[OUT_CAP];
};

/* Send what is gathered; 0, or -errno (also in f->error). */
static int flush(struct fleetd_fast *f, struct out *o) {
    if (o->n == 0) return 0;
    struct iovec iov[1] = {{o->buf, o->n}};
    o->n = 0;
    int rc = fleetd_send_all(f->fd, iov, 1);
    if (rc != 0) f->error = rc;
    return rc;
}

/* A reply (its size, then `data`) gathered, or sent now behind the gathered ones when it is
 * large; 0, or -errno (also in f->error) when a send failed. */
static int reply(struct fleetd_fast *f, struct out *o, uint64_t size, const uint8_t *data) {
    if (size <= OUT_COPY_MAX && o->n + 8 + size <= OUT_CAP) {
        memcpy(o->buf + o->n, &size, 8);
        memcpy(o->buf + o->n + 8, data, size);
        o->n += 8 + size;
        return 0;
    }
    uint8_t header[8];
    memcpy(header, &size, 8);
    struct iovec iov[3] = {{o->buf, o->n}, {header, 8}, {(void *)data, size}};
    o->n = 0;
    int rc = fleetd_send_all(f->fd, iov, 3);
    if (rc != 0) f->error = rc;
    return rc;
}

/* Where a SET_TENSOR's data goes (its fixed part at `t`, `payload` bytes in all, at least
 * SET_FIXED), or NULL when the request is Python's: the cache flag (Python stores the file), a
 * model weight (Python notes its layer), or a region checked_region refuses. */
static uint8_t *set_destination(struct fleetd_fast *f, const uint8_t *t, uint64_t payload,
                                struct fleetd_region **which) {
    if (t[TENSOR] != 0 || memcmp(t + T_NAME, "blk.", 4) == 0) return NULL;
    return checked_region(t, u64_at(t + TENSOR + 1), payload - SET_FIXED, f->regions, f->n_regions,
                          f->blck, f->tsize, f->n_types, which);
}

/* Serve the whole fast requests at the front of data[0, len), their replies gathered in `o`:
 * the bytes consumed. A reply that could not be sent sets f->error (the connection is then
 * broken) and stops there. */
static size_t serve_requests(struct fleetd_fast *f, struct out *o, const uint8_t *data, size_t len) {
    size_t pos = 0;
    while (len - pos >= HEADER) {
        const uint8_t *req = data + pos;
        uint64_t payload = u64_at(req + 1);
        if (payload > len - pos - HEADER) break;  /* not whole yet */
        const uint8_t *t = req + HEADER;
        struct fleetd_region *r;
        if (req[0] == CMD_SET_TENSOR) {
            if (payload < SET_FIXED) break;
            uint8_t *dst = set_destination(f, t, payload, &r);
            if (dst == NULL) break;
            memcpy(dst, t + SET_FIXED, payload - SET_FIXED);
            r->written = 1;
            f->served.set_count += 1;
            f->served.set_bytes += HEADER + payload;
        } else if (req[0] == CMD_GET_TENSOR) {
            if (payload != GET_PAYLOAD) break;
            uint64_t size = u64_at(t + TENSOR + 8);
            const uint8_t *src = checked_region(t, u64_at(t + TENSOR), size, f->regions,
                                                f->n_regions, f->blck, f->tsize, f->n_types, &r);
            if (src == NULL) break;
            /* counted before the reply leaves: a stats reader sees every answer the client got */
            f->served.get_count += 1;
            f->served.get_bytes += HEADER + payload;
            f->served.get_reply_bytes += 8 + size;
            if (reply(f, o, size, src) != 0) return pos;
        } else {
            break;
        }
        pos += HEADER + payload;
    }
    return pos;
}

/* serve_requests for Python's receive buffer: the replies sent before it returns. */
size_t fleetd_fast_requests(struct fleetd_fast *f, const uint8_t *data, size_t len) {
    struct out o;
    o.n = 0;
    f->error = 0;
    size_t used = serve_requests(f, &o, data, len);
    flush(f, &o);
    return used;
}

/* fleetd_fast_loop's answers: why it gave the connection back to Python */
enum {
    LOOP_PYTHON = 1,   /* the request at the front is Python's (another command, too large, refused) */
    LOOP_IDLE = 2,     /* no byte came for wait_ms */
    LOOP_EOF = 3,      /* the client closed */
    LOOP_ERROR = 4,    /* f->error: a reply not sent or a failed recv */
    LOOP_BUDGET = 5,   /* ran budget_ms (checked between requests): Python lets go of the
                          worker's lock for a moment and calls again */
    LOOP_WORKER = 6,   /* a GRAPH_RECOMPUTE went to the worker and its answer is not a plain
                          DONE (yet): Python waits for it and decides, as for its own */
    LOOP_BODY = 7,     /* a streamed SET_TENSOR was cut (f->body.why): the connection ends */
};

/* tick_ms: inside the loop the socket's SO_RCVTIMEO is already this (0: not known, a body sets
 * and restores its own) */
static size_t recv_body(int fd, uint8_t *dst, size_t n, int timeout_ms, uint64_t min_rate,
                        int64_t *waited_ns, uint64_t *got, int *why, int tick_ms);

/* channel.py's framing: | kind u32 | n_fds u32 | length u64 | */
#define MSG_RUN 3
#define REPLY_DONE 100
#define CHANNEL_HEADER 16

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* SO_RCVTIMEO to `ms` for a run of blocking recv()s (one syscall a wake-up, where a
 * non-blocking recv, a poll and a recv made three): 1 when it changed, `was` then holds what
 * to put back (Python keeps its own and expects it kept); 0 when it was `ms` already; -1 when
 * it could not be read or set (the socket's own timeout stands). */
static int set_recv_timeout(int fd, int ms, struct timeval *was) {
    if (ms < 1) ms = 1;  /* 0 would be no timeout at all: a recv that never gives up */
    struct timeval want = {ms / 1000, (ms % 1000) * 1000};
    socklen_t len = sizeof *was;
    if (getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, was, &len) != 0) return -1;
    if (was->tv_sec == want.tv_sec && was->tv_usec == want.tv_usec) return 0;
    return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &want, sizeof want) == 0 ? 1 : -1;
}

/* Hand the armed graph to the worker and wait for its answer: 1 when it is DONE (consumed),
 * 0 when Python must take over (any other answer, the worker or the client gone, the deadline,
 * a failed send: Python's wait finds out which, kills what must be killed and says why). */
static int recompute(struct fleetd_fast *f) {
    struct fleetd_recompute *g = &f->rc;
    if (g->inline_worker != NULL) {
        g->started_ns = now_ns();
        g->inline_status = fleetd_worker_run(g->inline_worker, g->threads);
        return g->inline_status == 0;
    }
    uint8_t msg[CHANNEL_HEADER + 4] = {0};
    uint32_t kind = MSG_RUN;
    uint64_t length = 4;
    memcpy(msg, &kind, 4);
    memcpy(msg + 8, &length, 8);
    memcpy(msg + CHANNEL_HEADER, &g->threads, 4);
    g->started_ns = now_ns();
    size_t sent = 0;
    while (sent < sizeof msg) {
        ssize_t n = send(g->worker_fd, msg + sent, sizeof msg - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        sent += (size_t)n;
    }
    int64_t deadline = g->started_ns + g->timeout_ns;
    struct pollfd p[2] = {{g->worker_fd, POLLIN, 0}, {f->fd, POLLRDHUP, 0}};
    for (;;) {
        int64_t left = deadline - now_ns();
        if (left <= 0) return 0;
        int ms = left > 1000000000 ? 1000 : (int)(left / 1000000) + 1;
        int n = poll(p, 2, ms);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return 0;
        if (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return 0;
        if (p[0].revents) {
            uint8_t h[CHANNEL_HEADER];
            ssize_t k = recv(g->worker_fd, h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
            uint32_t reply, n_fds;
            uint64_t len;
            memcpy(&reply, h, 4);
            memcpy(&n_fds, h + 4, 4);
            memcpy(&len, h + 8, 8);
            if (k != CHANNEL_HEADER || reply != REPLY_DONE || n_fds != 0 || len != 0) return 0;
            return recv(g->worker_fd, h, sizeof h, MSG_DONTWAIT) == CHANNEL_HEADER;
        }
    }
}

/* A SET_TENSOR larger than the loop's buffer, its fixed part at buf's front (have bytes in
 * all): checked as fleetd_fast_requests checks one, the bytes already here copied, the rest
 * read from the socket straight into the tensor (one copy, no receive buffer in between).
 * 1 served; 0 Python's (nothing consumed); -1 cut (f->body says why; the tensor holds what
 * came, as on Python's streamed path, and the connection ends). */
static int stream_set(struct fleetd_fast *f, const uint8_t *buf, size_t have, uint64_t payload,
                      int tick_ms) {
    uint64_t size = payload - SET_FIXED;
    struct fleetd_region *r;
    uint8_t *dst = set_destination(f, buf + HEADER, payload, &r);
    if (dst == NULL) return 0;
    size_t here = have - HEADER - SET_FIXED;  /* < size: the request is not whole */
    memcpy(dst, buf + HEADER + SET_FIXED, here);
    r->written = 1;
    struct fleetd_body *b = &f->body;
    b->waited_ns = 0;
    b->got = have;
    size_t n = recv_body(f->fd, dst + here, size - here, b->timeout_ms, b->min_rate,
                         &b->waited_ns, &b->got, &b->why, tick_ms);
    if (here + n < size) {
        b->cmd = CMD_SET_TENSOR;
        return -1;
    }
    f->served.set_count += 1;
    f->served.set_bytes += HEADER + payload;
    return 1;
}

/* PEER_GATE(stream, seq) at `req`: 1 answered 1 (the staged copy written into the session's own
 * buffer), 0 Python's (nothing changed: not staged within gate_ms, refused, another session's
 * buffer, any failed check), -1 the answer could not be sent (f->error). */
static int peer_gate(struct fleetd_fast *f, struct out *o, const uint8_t *req) {
    struct fleetd_peer *p = &f->peer;
    uint64_t stream = u64_at(req), seq = u64_at(req + 8), size = 0;
    uint8_t dst[PS_TENSOR];
    int64_t until = now_ns() + (int64_t)p->gate_ms * 1000000;
    if (fleetd_streams_wait(p->streams, stream, seq, p->owner, until, dst, &size) != PS_STAGED)
        return 0;
    struct fleetd_region *r;
    uint8_t *to = checked_region(dst, 0, size, f->regions, f->n_regions, f->blck, f->tsize,
                                 f->n_types, &r);
    if (to == NULL) return 0;
    uint8_t *data = fleetd_streams_settle(p->streams, stream, seq, p->owner);
    if (data == NULL) {  /* only this thread settles its streams: not expected */
        f->error = -EPROTO;
        return -1;
    }
    memcpy(to, data, size);
    r->written = 1;
    fleetd_streams_done(p->streams, data, size);
    f->served.gate_count += 1;
    uint8_t landed = 1;
    return reply(f, o, 1, &landed) == 0 ? 1 : -1;
}

/* PEER_PUSH at buf's front (its fixed part in, have bytes in all, payload as its header says):
 * staged when Python vouched for its destination and the streams admit it, the bytes already
 * here copied and the rest read from the socket. 1 served (answered 1); 0 Python's (nothing
 * changed); -1 its body was cut (f->body says why; the copy is refused) or the answer not sent. */
static int peer_push(struct fleetd_fast *f, struct out *o, const uint8_t *buf, size_t have,
                     uint64_t payload, int tick_ms) {
    struct fleetd_peer *p = &f->peer;
    const uint8_t *h = buf + HEADER;
    uint64_t stream = u64_at(h), seq = u64_at(h + 8), size = payload - PS_PUSH_FIXED;
    const uint8_t *dst = h + 17;
    uint8_t *data;
    if (fleetd_streams_admit(p->streams, stream, seq, size, h[16],
                             __atomic_load_n(p->p2p, __ATOMIC_ACQUIRE), 1, dst,
                             __atomic_load_n(p->frees, __ATOMIC_ACQUIRE), &data) != 0)
        return 0;
    size_t here = have - HEADER - PS_PUSH_FIXED;
    if (here > size) here = (size_t)size;
    memcpy(data, h + PS_PUSH_FIXED, here);
    if (here < size) {
        struct fleetd_body *b = &f->body;
        b->waited_ns = 0;
        b->got = have;
        if (flush(f, o) != 0) {
            fleetd_streams_refuse(p->streams, stream, seq, data, size);
            return -1;
        }
        size_t n = recv_body(f->fd, data + here, size - here, b->timeout_ms, b->min_rate,
                             &b->waited_ns, &b->got, &b->why, tick_ms);
        if (here + n < size) {
            fleetd_streams_refuse(p->streams, stream, seq, data, size);
            b->cmd = CMD_PEER_PUSH;
            return -1;
        }
    }
    /* counted before staging: a gate that sees the bytes then sees the count too */
    f->served.push_count += 1;
    f->served.push_bytes += HEADER + payload;
    fleetd_streams_stage(p->streams, stream, seq, dst, data, size);
    uint8_t staged = 1;
    return reply(f, o, 1, &staged) == 0 ? 1 : -1;
}

/* COPY_TENSOR_TO_ASYNC at `req` (payload bytes, whole): the source region of the session's own
 * buffer read now and pushed on the route Python armed for its (stream, endpoint). 1 served
 * (no answer to the client), 0 Python's (nothing changed). */
static int copy_async(struct fleetd_fast *f, const uint8_t *req, uint64_t payload) {
    struct fleetd_peer *p = &f->peer;
    const uint8_t *h = req + 2 * TENSOR;
    uint64_t size = u64_at(h), stream = u64_at(h + 8), seq = u64_at(h + 16);
    uint32_t ep_len = u32_at(h + 24);
    if (COPY_FIXED + (uint64_t)ep_len != payload || size == 0 || size > ROUTE_INLINE_MAX) return 0;
    struct fleetd_route *r = NULL;
    for (int i = 0; i < p->n_routes; ++i) {
        struct fleetd_route *c = p->routes[i];
        if (c->fd >= 0 && c->stream == stream && (uint32_t)c->ep_len == ep_len &&
            memcmp(c->ep, h + 28, ep_len) == 0) { r = c; break; }
    }
    if (r == NULL || seq <= r->last_seq || !__atomic_load_n(p->p2p, __ATOMIC_ACQUIRE)) return 0;
    struct fleetd_region *which;
    const uint8_t *src = checked_region(req, 0, size, f->regions, f->n_regions, f->blck, f->tsize,
                                       f->n_types, &which);
    if (src == NULL) return 0;
    if (fleetd_route_push(r, p->streams, seq, req + TENSOR, src, size) == 0) return 0;
    f->served.copy_count += 1;
    f->served.copy_bytes += HEADER + payload;
    return 1;
}

/* Serve the session from `buf` (cap bytes, f->have of them already there) until a request is
 * Python's: whole fast requests as fleetd_fast_requests, the armed GRAPH_RECOMPUTE, and the
 * recv between them, so a decode step costs no interpreter at all. Returns a LOOP_* answer,
 * with the bytes left at buf's front in f->have (Python's receive buffer takes them). */
int fleetd_fast_loop(struct fleetd_fast *f, uint8_t *buf, size_t cap, int wait_ms, int budget_ms) {
    size_t have = f->have;
    int64_t until = now_ns() + (int64_t)budget_ms * 1000000;
    int answer;
    struct timeval was;  /* between requests a blocking recv() waits wait_ms for the next */
    /* wait_ms < 0: the socket's own SO_RCVTIMEO stands (a worker: its daemon set it) */
    int restore = wait_ms >= 0 ? set_recv_timeout(f->fd, wait_ms, &was) : -1;
    int tick_ms = restore >= 0 ? wait_ms : 0;  /* a tick a body may rely on */
    struct out o;
    o.n = 0;
    f->error = 0;
    for (;;) {
        size_t used = serve_requests(f, &o, buf, have);
        if (used) {
            memmove(buf, buf + used, have - used);
            have -= used;
        }
        if (f->error) { answer = LOOP_ERROR; break; }
        if (have >= HEADER) {
            uint64_t payload = u64_at(buf + 1);
            struct fleetd_recompute *g = &f->rc;
            if (buf[0] == CMD_GRAPH_RECOMPUTE && payload == 4) {
                if (have < HEADER + 4) goto more;
                if (g->device < 0 || u32_at(buf + HEADER) != (uint32_t)g->device ||
                    __atomic_load_n(g->frees, __ATOMIC_ACQUIRE) != g->frees_seen) {
                    answer = LOOP_PYTHON; break;
                }
                if (__atomic_add_fetch(g->computing, 1, __ATOMIC_ACQ_REL) != 1) {
                    /* another session computes: the thread share is Python's to decide */
                    __atomic_sub_fetch(g->computing, 1, __ATOMIC_ACQ_REL);
                    answer = LOOP_PYTHON; break;
                }
                if (flush(f, &o) != 0) { answer = LOOP_ERROR; break; }
                int done = recompute(f);
                __atomic_sub_fetch(g->computing, 1, __ATOMIC_ACQ_REL);
                memmove(buf, buf + HEADER + 4, have - HEADER - 4);
                have -= HEADER + 4;
                if (!done) { answer = LOOP_WORKER; break; }
                f->served.recompute_count += 1;
                f->served.recompute_ns += (uint64_t)(now_ns() - g->started_ns);
                for (int i = 0; i < g->n_written; ++i) f->regions[g->written[i]].written = 1;
                continue;
            }
            /* a SET not whole yet: too large for the buffer, or a hidden state still arriving,
             * goes on straight into its tensor, not through the buffer (one copy less, and no
             * part of the next request moved to the front after it) */
            if (buf[0] == CMD_SET_TENSOR && payload >= SET_FIXED && f->body.timeout_ms > 0 &&
                (payload > cap - HEADER || (HEADER + payload > have && payload >= STREAM_MIN))) {
                if (have < HEADER + SET_FIXED) goto more;
                if (flush(f, &o) != 0) { answer = LOOP_ERROR; break; }
                int r = stream_set(f, buf, have, payload, tick_ms);
                if (r == 0) { answer = LOOP_PYTHON; break; }
                have = 0;
                if (r < 0) { answer = LOOP_BODY; break; }
                continue;
            }
            if (buf[0] == CMD_PEER_GATE && payload == GATE_PAYLOAD && f->peer.streams != NULL) {
                if (have < HEADER + GATE_PAYLOAD) goto more;
                if (flush(f, &o) != 0) { answer = LOOP_ERROR; break; }  /* the gate may wait */
                int r = peer_gate(f, &o, buf + HEADER);
                if (r == 0) { answer = LOOP_PYTHON; break; }
                if (r < 0) { answer = LOOP_ERROR; break; }
                memmove(buf, buf + HEADER + GATE_PAYLOAD, have - HEADER - GATE_PAYLOAD);
                have -= HEADER + GATE_PAYLOAD;
                continue;
            }
            if (buf[0] == CMD_COPY_TENSOR_TO_ASYNC && f->peer.n_routes > 0 &&
                payload <= cap - HEADER) {
                if (have < HEADER + payload) goto more;
                if (!copy_async(f, buf + HEADER, payload)) { answer = LOOP_PYTHON; break; }
                memmove(buf, buf + HEADER + payload, have - HEADER - payload);
                have -= HEADER + payload;
                continue;
            }
            if (buf[0] == CMD_PEER_PUSH && payload >= PS_PUSH_FIXED && f->peer.streams != NULL &&
                f->body.timeout_ms > 0) {
                if (have < HEADER + PS_PUSH_FIXED) goto more;
                int r = peer_push(f, &o, buf, have, payload, tick_ms);
                if (r == 0) { answer = LOOP_PYTHON; break; }
                if (r < 0) { answer = f->error ? LOOP_ERROR : LOOP_BODY; have = 0; break; }
                size_t used = HEADER + payload <= have ? (size_t)(HEADER + payload) : have;
                memmove(buf, buf + used, have - used);
                have -= used;
                continue;
            }
            if (buf[0] == CMD_GET_ALIGNMENT && payload == 4) {
                /* a client's cheapest round trip (a sync): the device's constant, no interpreter */
                if (have < HEADER + 4) goto more;
                uint32_t device = u32_at(buf + HEADER);
                if (device >= (uint32_t)f->n_align) { answer = LOOP_PYTHON; break; }
                f->served.align_count += 1;  /* before the reply, as a GET: a reader sees every answer */
                if (reply(f, &o, 8, (const uint8_t *)&f->align[device]) != 0) {
                    answer = LOOP_ERROR; break;
                }
                memmove(buf, buf + HEADER + 4, have - HEADER - 4);
                have -= HEADER + 4;
                continue;
            }
            /* a whole request fleetd_fast_requests left, another command, or one too large */
            if ((buf[0] != CMD_SET_TENSOR && buf[0] != CMD_GET_TENSOR) || payload > cap - HEADER ||
                HEADER + payload <= have) {
                answer = LOOP_PYTHON; break;
            }
        }
    more:
        /* between requests only: a request C started reading stays C's to serve. A worker
         * streams none: one still arriving a budget later goes back to its daemon, which
         * serves a request that trickles in under the session's rules. */
        if (have == 0 || f->rc.inline_worker != NULL) {
            int64_t now = now_ns();
            int64_t end = __atomic_load_n(&f->rc.yield_asked, __ATOMIC_ACQUIRE) ? 0 : until;
            if (now >= end && (have == 0 || now >= until + (int64_t)budget_ms * 1000000)) {
                answer = LOOP_BUDGET;
                break;
            }
        }
        if (flush(f, &o) != 0) { answer = LOOP_ERROR; break; }
        ssize_t n = recv(f->fd, buf + have, cap - have, 0);
        if (n > 0) { have += (size_t)n; continue; }
        if (n == 0) { answer = LOOP_EOF; break; }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) { answer = LOOP_IDLE; break; }  /* wait_ms */
        f->error = -errno;
        answer = LOOP_ERROR;
        break;
    }
    if (flush(f, &o) != 0) answer = LOOP_ERROR;  /* every answer out before Python's next */
    if (restore > 0) setsockopt(f->fd, SOL_SOCKET, SO_RCVTIMEO, &was, sizeof was);
    f->have = have;
    return answer;
}

/* The pool's count of computing sessions, shared with fleetd_fast_loop. */
int32_t fleetd_atomic_add(int32_t *p, int32_t delta) {
    return __atomic_add_fetch(p, delta, __ATOMIC_ACQ_REL);
}

/* The layout the ctypes mirrors (fleetd.compute.native) must match, for tests/test_fast_path.py:
 * sizes of the structs, then the offsets of fleetd_fast's later fields. */
size_t fleetd_fast_layout(int which) {
    switch (which) {
    case 0: return sizeof(struct fleetd_fast);
    case 1: return sizeof(struct fleetd_served);
    case 2: return sizeof(struct fleetd_recompute);
    case 3: return sizeof(struct fleetd_region);
    case 4: return offsetof(struct fleetd_fast, served);
    case 5: return offsetof(struct fleetd_fast, have);
    case 6: return offsetof(struct fleetd_fast, rc);
    case 7: return offsetof(struct fleetd_recompute, timeout_ns);
    case 8: return offsetof(struct fleetd_fast, body);
    case 9: return sizeof(struct fleetd_body);
    case 10: return offsetof(struct fleetd_fast, peer);
    case 11: return sizeof(struct fleetd_peer);
    case 12: return offsetof(struct fleetd_fast, align);
    case 13: return offsetof(struct fleetd_fast, n_align);
    default: return 0;
    }
}

/* A streamed request body (SET_TENSOR's data, PEER_PUSH's) read straight into dst[0, n) in one
 * call, under the session's rules for a started request (Session.recv_in_request): no byte for
 * timeout_ms, or past timeout_ms of waiting less than min_rate bytes a second of it, ends it.
 * `*waited_ns` and `*got` carry the request's time spent waiting and bytes so far, in and out.
 * Returns the bytes read (n when whole), or stops early with *why set: 1 the sender was too
 * slow, 2 no byte for timeout_ms, 3 the peer closed, or -errno. */
size_t fleetd_recv_body(int fd, uint8_t *dst, size_t n, int timeout_ms, uint64_t min_rate,
                        int64_t *waited_ns, uint64_t *got, int *why) {
    return recv_body(fd, dst, n, timeout_ms, min_rate, waited_ns, got, why, 0);
}

/* fleetd_recv_body for the loop, whose SO_RCVTIMEO is its tick already (tick_ms): a body then
 * costs no socket option (a 256 KiB SET was 3 of them and its recv()s; now 2.7 recv()s, the
 * stock server's 3.7), a silent tick is counted until timeout_ms. */
static size_t recv_body(int fd, uint8_t *dst, size_t n, int timeout_ms, uint64_t min_rate,
                        int64_t *waited_ns, uint64_t *got, int *why, int tick_ms) {
    struct timeval was;  /* blocking recv()s: a 1 MiB body is 16 wake-ups */
    int restore = tick_ms > 0 ? 0 : set_recv_timeout(fd, timeout_ms, &was);
    int64_t silent_ns = 0;  /* since the last byte: no byte for timeout_ms ends it */
    size_t done = 0;
    *why = 0;
    while (done < n) {
        if (*waited_ns > (int64_t)timeout_ms * 1000000 &&
            (u128)*got * 1000000000 < (u128)min_rate * (uint64_t)*waited_ns) {
            *why = 1;
            break;
        }
        int64_t t0 = now_ns();
        ssize_t k = recv(fd, dst + done, n - done, 0);
        int64_t spent = now_ns() - t0;
        *waited_ns += spent;  /* the copy's time too: microseconds a megabyte */
        if (k > 0) {
            done += (size_t)k;
            *got += (uint64_t)k;
            silent_ns = 0;
            continue;
        }
        if (k == 0) { *why = 3; break; }
        if (errno == EINTR) continue;
        if ((errno == EAGAIN || errno == EWOULDBLOCK) && tick_ms > 0 &&
            (silent_ns += spent) < (int64_t)timeout_ms * 1000000)
            continue;  /* a tick of the loop's, not yet the request's timeout */
        *why = errno == EAGAIN || errno == EWOULDBLOCK ? 2 : -errno;  /* no byte for timeout_ms */
        break;
    }
    if (restore > 0) setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &was, sizeof was);
    return done;
}
