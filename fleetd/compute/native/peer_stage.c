/* The destination side of the asynchronous peer copy, daemon-wide: streams owned by client
 * sessions, pushes staged until the owner's PEER_WAIT / PEER_GATE writes them, and the one
 * budget of peer-copy bytes both sides hold (fleetd.server.peer_streams has the rules; this is
 * their one implementation when the library is there, so Python's handlers and the sessions' C
 * loops share it: a PEER_PUSH staged by one session's loop is found by another's PEER_GATE).
 *
 * Ownership of a push's bytes: admit() mallocs them and hands them to the reader; while the
 * slot is ARRIVING the reader owns them (a wait that gives up, or the owner leaving, only
 * drops the slot); stage() gives them to the slot, or frees them when the slot is gone. A
 * STAGED slot's bytes go to the waiter at settle(), who frees them with done().
 *
 * Everything is under one mutex; waits use one condition (CLOCK_MONOTONIC). Callers from
 * Python come through ctypes, which lets go of the interpreter lock for the call. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer_stage.h"

enum { SLOT_ARRIVING = PS_ARRIVING, SLOT_STAGED = PS_STAGED, SLOT_REFUSED = PS_REFUSED };

struct slot {
    uint64_t seq;
    int32_t state;
    uint64_t size;
    uint8_t *data;          /* STAGED only */
    uint8_t dst[PS_TENSOR];
};

struct stream {
    uint64_t id;
    int64_t owner;
    uint64_t waited;        /* the highest seq a wait settled: later pushes for it are late */
    uint32_t n, cap;
    struct slot *slots;
    /* a destination Python checked (regions.region) for a push of `ok_size` bytes while the
     * registry's free count was `ok_frees`: a push with the same tensor bytes and size may be
     * staged in C as long as nothing was freed since */
    int ok;
    uint64_t ok_size, ok_frees;
    uint8_t ok_dst[PS_TENSOR];
};

struct fleetd_streams {
    pthread_mutex_t mu;
    pthread_cond_t changed;  /* a slot settled (staged, refused) or a stream closed; or room */
    int64_t held, limit;
    uint32_t max_per_owner, max_unwaited;
    uint32_t n, cap;
    struct stream *streams;
};

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void wait_until(struct fleetd_streams *t, int64_t until_ns) {
    struct timespec ts = {until_ns / 1000000000, until_ns % 1000000000};
    pthread_cond_timedwait(&t->changed, &t->mu, &ts);
}

struct fleetd_streams *fleetd_streams_new(int64_t limit, uint32_t max_per_owner,
                                          uint32_t max_unwaited) {
    struct fleetd_streams *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&t->changed, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&t->mu, NULL);
    t->limit = limit;
    t->max_per_owner = max_per_owner;
    t->max_unwaited = max_unwaited;
    return t;
}

static void drop_stream(struct fleetd_streams *t, uint32_t i) {
    struct stream *s = &t->streams[i];
    for (uint32_t k = 0; k < s->n; ++k) {
        if (s->slots[k].state == SLOT_STAGED) {
            t->held -= (int64_t)s->slots[k].size;
            free(s->slots[k].data);
        }
    }
    free(s->slots);
    t->streams[i] = t->streams[--t->n];
}

/* -- the budget ------------------------------------------------------------------------------ */

int fleetd_mem_reserve(struct fleetd_streams *t, uint64_t n, int64_t timeout_ns) {
    int64_t until = mono_ns() + (timeout_ns > 0 ? timeout_ns : 0);
    pthread_mutex_lock(&t->mu);
    int ok = 0;
    for (;;) {
        if (n <= (uint64_t)t->limit && (int64_t)n <= t->limit - t->held) { ok = 1; break; }
        if (n > (uint64_t)t->limit || mono_ns() >= until) break;
        wait_until(t, until);
    }
    if (ok) t->held += (int64_t)n;
    pthread_mutex_unlock(&t->mu);
    return ok;
}

void fleetd_mem_release(struct fleetd_streams *t, uint64_t n) {
    if (n == 0) return;
    pthread_mutex_lock(&t->mu);
    t->held -= (int64_t)n;
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->mu);
}

int64_t fleetd_mem_held(struct fleetd_streams *t) {
    pthread_mutex_lock(&t->mu);
    int64_t held = t->held;
    pthread_mutex_unlock(&t->mu);
    return held;
}

/* -- streams ------------------------------------------------------------------------------ */

static struct stream *find(struct fleetd_streams *t, uint64_t id) {
    for (uint32_t i = 0; i < t->n; ++i) {
        if (t->streams[i].id == id) return &t->streams[i];
    }
    return NULL;
}

static struct slot *slot_of(struct stream *s, uint64_t seq) {
    for (uint32_t k = 0; k < s->n; ++k) {
        if (s->slots[k].seq == seq) return &s->slots[k];
    }
    return NULL;
}

/* A new stream `id` owned by session `owner`: 0, 1 the id is taken, 2 the owner has
 * max_per_owner already, -ENOMEM. */
int fleetd_streams_open(struct fleetd_streams *t, uint64_t id, int64_t owner) {
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    uint32_t owned = 0;
    for (uint32_t i = 0; i < t->n; ++i) owned += t->streams[i].owner == owner;
    if (id == 0 || find(t, id) != NULL) {
        rc = 1;
    } else if (owned >= t->max_per_owner) {
        rc = 2;
    } else {
        if (t->n == t->cap) {
            uint32_t cap = t->cap ? 2 * t->cap : 16;
            struct stream *grown = realloc(t->streams, cap * sizeof *grown);
            if (grown == NULL) rc = -ENOMEM;
            else { t->streams = grown; t->cap = cap; }
        }
        if (rc == 0) {
            struct stream *s = &t->streams[t->n++];
            memset(s, 0, sizeof *s);
            s->id = id;
            s->owner = owner;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void fleetd_streams_close_owner(struct fleetd_streams *t, int64_t owner) {
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = 0; i < t->n;) {
        if (t->streams[i].owner == owner) drop_stream(t, i);
        else ++i;
    }
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->mu);
}

/* Python checked `dst` for a push of `size` bytes at free count `frees` (see struct stream). */
void fleetd_streams_vouch(struct fleetd_streams *t, uint64_t id, const uint8_t *dst, uint64_t size,
                          uint64_t frees) {
    pthread_mutex_lock(&t->mu);
    struct stream *s = find(t, id);
    if (s != NULL) {
        memcpy(s->ok_dst, dst, PS_TENSOR);
        s->ok_size = size;
        s->ok_frees = frees;
        s->ok = 1;
    }
    pthread_mutex_unlock(&t->mu);
}

/* May the push (stream, seq, size, flags) be staged? 0: yes, its bytes reserved and a buffer
 * for them in *data (the caller reads them in, then stage() or refuse()); otherwise a PS_*
 * reason it is refused. With `c_only` (a session's C loop), `dst` must be a vouched one and a
 * refusal changes nothing (Python serves the push and says why); without it a refusal marks
 * the seq refused (its wait answers 0 at once). */
int fleetd_streams_admit(struct fleetd_streams *t, uint64_t id, uint64_t seq, uint64_t size,
                         uint32_t flags, int p2p, int c_only, const uint8_t *dst, uint64_t frees,
                         uint8_t **data) {
    *data = NULL;
    pthread_mutex_lock(&t->mu);
    int reason = 0;
    struct stream *s = find(t, id);
    if (s == NULL) { reason = PS_UNKNOWN; goto out; }
    if (seq <= s->waited || slot_of(s, seq) != NULL) { reason = PS_LATE; goto out; }
    if (s->n >= t->max_unwaited) { reason = PS_TOO_MANY; goto out; }
    if (flags & PS_PUSH_FAILED) reason = PS_SOURCE_FAILED;
    else if (!p2p) reason = PS_P2P_OFF;
    else if (size > (uint64_t)t->limit || (int64_t)size > t->limit - t->held) reason = PS_NO_ROOM;
    else if (c_only && !(s->ok && s->ok_size == size && s->ok_frees == frees &&
                         memcmp(s->ok_dst, dst, PS_TENSOR) == 0)) reason = PS_NOT_VOUCHED;
    if (reason == 0 && (*data = malloc(size ? size : 1)) == NULL) reason = PS_NO_ROOM;
    if (reason != 0 && c_only) goto out;
    if (s->n == s->cap) {
        uint32_t cap = s->cap ? 2 * s->cap : 4;
        struct slot *grown = realloc(s->slots, cap * sizeof *grown);
        if (grown == NULL) {  /* refused without a slot: the wait runs out instead */
            free(*data);
            *data = NULL;
            reason = PS_NO_ROOM;
            goto out;
        }
        s->slots = grown;
        s->cap = cap;
    }
    struct slot *sl = &s->slots[s->n++];
    memset(sl, 0, sizeof *sl);
    sl->seq = seq;
    sl->size = size;
    sl->state = reason ? SLOT_REFUSED : SLOT_ARRIVING;
    if (reason == 0) t->held += (int64_t)size;
    /* A refusal answers the wait now; an arrival only lengthens it, which the waiter finds
     * when it next looks: waking it for that would cost the critical path a switch. */
    if (reason) pthread_cond_broadcast(&t->changed);
out:
    pthread_mutex_unlock(&t->mu);
    return reason;
}

/* The pushed bytes are all in: the slot is staged for its wait (it takes `data`), or, when
 * the slot went meanwhile (its wait gave up, the owner left), they are let go. */
void fleetd_streams_stage(struct fleetd_streams *t, uint64_t id, uint64_t seq, const uint8_t *dst,
                          uint8_t *data, uint64_t size) {
    pthread_mutex_lock(&t->mu);
    struct stream *s = find(t, id);
    struct slot *sl = s ? slot_of(s, seq) : NULL;
    if (sl != NULL && sl->state == SLOT_ARRIVING) {
        sl->state = SLOT_STAGED;
        sl->data = data;
        memcpy(sl->dst, dst, PS_TENSOR);
    } else {
        t->held -= (int64_t)size;
        free(data);
    }
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->mu);
}

/* An admitted push failed while its bytes came in: they are let go, its wait answers 0. */
void fleetd_streams_refuse(struct fleetd_streams *t, uint64_t id, uint64_t seq, uint8_t *data,
                           uint64_t size) {
    pthread_mutex_lock(&t->mu);
    t->held -= (int64_t)size;
    free(data);
    struct stream *s = find(t, id);
    struct slot *sl = s ? slot_of(s, seq) : NULL;
    if (sl != NULL && sl->state == SLOT_ARRIVING) sl->state = SLOT_REFUSED;
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->mu);
}

/* Wait until copy `seq` of stream `id` is staged or refused, or until `until_ns`
 * (CLOCK_MONOTONIC). Changes nothing. Returns PS_NOT_OWNER (no such stream of `owner`),
 * PS_OUT_OF_ORDER (seq not after the last one settled), 0 (nothing came yet), or the slot's
 * state: SLOT_ARRIVING, SLOT_REFUSED, SLOT_STAGED (with its size, and its tensor in dst). */
int fleetd_streams_wait(struct fleetd_streams *t, uint64_t id, uint64_t seq, int64_t owner,
                        int64_t until_ns, uint8_t *dst, uint64_t *size) {
    pthread_mutex_lock(&t->mu);
    int rc;
    for (;;) {
        struct stream *s = find(t, id);
        if (s == NULL || s->owner != owner) { rc = PS_NOT_OWNER; break; }
        if (seq <= s->waited) { rc = PS_OUT_OF_ORDER; break; }
        struct slot *sl = slot_of(s, seq);
        rc = sl ? sl->state : 0;
        if (rc == SLOT_STAGED) {
            memcpy(dst, sl->dst, PS_TENSOR);
            *size = sl->size;
        }
        if (rc == SLOT_STAGED || rc == SLOT_REFUSED || mono_ns() >= until_ns) break;
        wait_until(t, until_ns);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Copy `seq` is settled, whatever came of it: a later push for it is late, copies before it
 * the client skipped are dropped. Returns its staged bytes (the caller writes them, then
 * done()), or NULL. Only the stream's owner calls this, after a wait. */
uint8_t *fleetd_streams_settle(struct fleetd_streams *t, uint64_t id, uint64_t seq, int64_t owner) {
    uint8_t *data = NULL;
    pthread_mutex_lock(&t->mu);
    struct stream *s = find(t, id);
    if (s != NULL && s->owner == owner && seq > s->waited) {
        s->waited = seq;
        for (uint32_t k = 0; k < s->n;) {
            struct slot *sl = &s->slots[k];
            if (sl->seq > seq) { ++k; continue; }
            if (sl->state == SLOT_STAGED) {
                if (sl->seq == seq) {
                    data = sl->data;  /* its bytes stay reserved until done() */
                } else {
                    t->held -= (int64_t)sl->size;
                    free(sl->data);
                }
            }
            s->slots[k] = s->slots[--s->n];
        }
        pthread_cond_broadcast(&t->changed);
    }
    pthread_mutex_unlock(&t->mu);
    return data;
}

/* The settled bytes were written (or could not be): let them go. */
void fleetd_streams_done(struct fleetd_streams *t, uint8_t *data, uint64_t size) {
    free(data);
    fleetd_mem_release(t, size);
}

void fleetd_mem_set_limit(struct fleetd_streams *t, int64_t limit) {
    pthread_mutex_lock(&t->mu);
    t->limit = limit;
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->mu);
}

/* -- the source side: pushes a session's loop sends on a route (peer_stage.h) --------------- */

#include <linux/sockios.h>  /* SIOCOUTQ */
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define ANSWER 9  /* PEER_PUSH's answer: size u64 (1), staged u8 */

static struct fleetd_push *nth(struct fleetd_route *r, uint32_t i) {
    return &r->ring[(r->head + i) % ROUTE_RING];
}

/* Answers that came, read without waiting for more than `block_ms` (0: only what is there):
 * each settles the oldest push still without one (1 landed: its bytes let go; 0 failed: kept
 * for Python). A malformed answer, an error or the link closing breaks the route. Landed pushes
 * at the ring's head leave it. Returns the answers read. */
static size_t read_answers(struct fleetd_route *r, struct fleetd_streams *t, int fd, int block_ms) {
    size_t got = 0;
    while (r->answered < r->n && !r->broken) {
        int ready = 0;
        if (ioctl(fd, FIONREAD, &ready) != 0) { r->broken = 1; break; }
        if (ready < ANSWER) {
            if (block_ms <= 0) break;
            struct pollfd p = {fd, POLLIN, 0};
            int k = poll(&p, 1, block_ms);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            if (ioctl(fd, FIONREAD, &ready) != 0 || ready == 0) { r->broken = 1; break; }
            if (ready < ANSWER) continue;
        }
        uint32_t want = (uint32_t)ready / ANSWER;
        if (want > r->n - r->answered) want = r->n - r->answered;
        uint8_t buf[ANSWER * 16];
        if (want > 16) want = 16;
        ssize_t k = recv(fd, buf, want * ANSWER, MSG_DONTWAIT);
        if (k != (ssize_t)(want * ANSWER)) { r->broken = 1; break; }
        for (uint32_t i = 0; i < want; ++i) {
            uint64_t size;
            memcpy(&size, buf + i * ANSWER, 8);
            uint8_t staged = buf[i * ANSWER + 8];
            struct fleetd_push *p = nth(r, r->answered);
            if (size != 1 || staged > 1) { r->broken = 1; break; }
            r->answered += 1;
            got += 1;
            if (staged) {
                p->state = PUSH_LANDED;
                r->landed_count += 1;
                r->landed_bytes += p->size;
                free(p->data);
                p->data = NULL;
                fleetd_mem_release(t, p->size);
            } else {
                p->state = PUSH_FAILED;
            }
        }
        while (r->n && nth(r, 0)->state == PUSH_LANDED) {
            r->head = (r->head + 1) % ROUTE_RING;
            r->n -= 1;
            r->answered -= 1;
        }
    }
    return got;
}

/* The answers that came on a route the caller holds (r->fd), without waiting. */
size_t fleetd_route_read_answers(struct fleetd_route *r, struct fleetd_streams *t, int block_ms) {
    return read_answers(r, t, r->fd, block_ms);
}

/* Every push on the route answered, read from the link's socket `fd`, waiting up to timeout_ms
 * in all (the pusher thread, once the session let go of the route: r->fd stays -1, so no loop
 * pushes on it meanwhile): 1 all answered, 0 not (the route is broken, and the pushes still
 * unanswered are failed: kept for Python). */
int fleetd_route_drain(struct fleetd_route *r, struct fleetd_streams *t, int fd, int timeout_ms) {
    int64_t until = mono_ns() + (int64_t)timeout_ms * 1000000;
    while (r->answered < r->n && !r->broken) {
        int64_t left = (until - mono_ns()) / 1000000;
        if (left <= 0) break;
        if (fd < 0) { r->broken = 1; break; }
        read_answers(r, t, fd, left > 1000 ? 1000 : (int)left);
    }
    if (r->answered < r->n) {
        r->broken = 1;
        for (uint32_t i = r->answered; i < r->n; ++i) nth(r, i)->state = PUSH_FAILED;
        r->answered = r->n;
    }
    return !r->broken;
}

/* Would `bytes` more fit the link's send buffer now, so that sending them cannot wait? The
 * queue (SIOCOUTQ: not yet sent or not yet acknowledged) plus them within half of SO_SNDBUF
 * (the kernel doubles what is asked, for its own overhead). A destination that stops reading
 * closes its window, the queue stays, and the loop leaves the copy to the pusher's thread
 * rather than wait on that socket with its client's commands behind it. With every push on the
 * route answered (`all_answered`) the queue is empty without asking: an answer leaves the
 * destination after it read the whole push, and its segment acknowledges every byte before it. */
static int fits_send_buffer(int fd, uint64_t bytes, int all_answered) {
    int queued = 0, sndbuf = 0;
    socklen_t len = sizeof sndbuf;
    if (!all_answered && (ioctl(fd, SIOCOUTQ, &queued) != 0 || queued < 0)) return 0;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) != 0 || sndbuf <= 0) return 0;
    return (uint64_t)queued + bytes <= (uint64_t)sndbuf / 2;
}

/* PEER_PUSH(stream, seq, dst, src[0, size)) on the route's link, its bytes kept in the ring
 * until the answer: 1 sent; 0 not attempted (no room in the ring, the budget or the link's send
 * buffer: Python's); -1 the send failed (the route is broken, the push failed and kept for
 * Python). */
int fleetd_route_push(struct fleetd_route *r, struct fleetd_streams *t, uint64_t seq,
                      const uint8_t *dst, const uint8_t *src, uint64_t size) {
    fleetd_route_read_answers(r, t, 0);
    if (r->broken || r->n >= ROUTE_RING) return 0;
    uint8_t head[9 + PS_PUSH_FIXED];  /* the request's header and fixed part, then its data */
    if (!fits_send_buffer(r->fd, sizeof head + size, r->answered == r->n)) return 0;
    if (!fleetd_mem_reserve(t, size, 0)) return 0;
    uint8_t *data = malloc(size);
    if (data == NULL) { fleetd_mem_release(t, size); return 0; }
    memcpy(data, src, size);
    struct fleetd_push *p = nth(r, r->n);
    p->stream = r->stream;
    p->seq = seq;
    p->size = size;
    p->data = data;
    p->state = PUSH_SENT;
    r->n += 1;
    r->last_seq = seq;
    uint64_t payload = PS_PUSH_FIXED + size;
    head[0] = 0x44;  /* PEER_PUSH */
    memcpy(head + 1, &payload, 8);
    memcpy(head + 9, &r->stream, 8);
    memcpy(head + 17, &seq, 8);
    head[25] = 0;  /* flags */
    memcpy(head + 26, dst, PS_TENSOR);
    struct iovec iov[2] = {{head, sizeof head}, {data, size}};
    if (fleetd_send_all(r->fd, iov, 2) != 0) {  /* it fits the buffer: it does not wait */
        r->broken = 1;
        /* it and any push before it still unanswered: the link is lost with them */
        for (uint32_t i = r->answered; i < r->n; ++i) nth(r, i)->state = PUSH_FAILED;
        r->answered = r->n;
        return -1;
    }
    r->pushed_count += 1;
    r->pushed_bytes += size;
    return 1;
}

/* Python collected the ring's failed pushes (their bytes copied out): let the C copies go, the
 * budget unchanged (the kept copies hold it now), and empty the ring. With `release`, the
 * budget is released too (the session ended: nothing is kept). */
void fleetd_route_clear(struct fleetd_route *r, struct fleetd_streams *t, int release) {
    for (uint32_t i = 0; i < r->n; ++i) {
        struct fleetd_push *p = nth(r, i);
        if (p->data != NULL) {
            if (release) fleetd_mem_release(t, p->size);
            free(p->data);
            p->data = NULL;
        }
    }
    r->head = r->n = r->answered = 0;
}

size_t fleetd_route_layout(int which) {
    switch (which) {
    case 0: return sizeof(struct fleetd_route);
    case 1: return sizeof(struct fleetd_push);
    case 2: return offsetof(struct fleetd_route, broken);
    case 3: return offsetof(struct fleetd_route, ring);
    case 4: return ROUTE_INLINE_MAX;  /* the bounds Python mirrors, so they cannot drift */
    case 5: return ROUTE_ENDPOINT;
    default: return 0;
    }
}
