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
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define CMD_SET_TENSOR 6
#define CMD_GET_TENSOR 8
#define HEADER 9          /* | cmd u8 | payload_size u64 | */
#define TENSOR 296        /* rpc_tensor */
#define SET_FIXED 305     /* tensor, cache_flag u8, offset u64 */
#define GET_PAYLOAD 312   /* tensor, offset u64, size u64 */

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

struct fleetd_served {   /* what the call served, for the session's counters */
    uint64_t set_count, set_bytes;   /* request bytes, header included */
    uint64_t get_count, get_bytes, get_reply_bytes;
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

/* Send all of header + data; 0, or -errno (EAGAIN: SO_SNDTIMEO ran out). */
static int send_reply(int fd, uint64_t size, const uint8_t *data) {
    uint8_t header[8];
    memcpy(header, &size, 8);
    struct iovec iov[2] = {{header, 8}, {(void *)data, size}};
    int first = 0;
    while (first < 2) {
        struct msghdr msg = {0};
        msg.msg_iov = &iov[first];
        msg.msg_iovlen = 2 - first;
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        while (first < 2 && (size_t)n >= iov[first].iov_len) {
            n -= iov[first].iov_len;
            ++first;
        }
        if (first < 2) {
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + n;
            iov[first].iov_len -= n;
        }
    }
    return 0;
}

struct fleetd_fast {      /* one session's fast path, set up once, passed by pointer */
    int fd;
    int n_regions;
    struct fleetd_region *regions;
    const uint32_t *blck;    /* per ggml type: elements per block (0: no such type) */
    const uint32_t *tsize;   /* per ggml type: bytes per block */
    uint32_t n_types;
    int error;               /* 0, or -errno of a reply that could not be sent */
    struct fleetd_served served;
};

/* Serve the whole fast requests at the front of data[0, len): the bytes consumed. A reply that
 * could not be sent sets f->error (the connection is then broken) and stops there. */
size_t fleetd_fast_requests(struct fleetd_fast *f, const uint8_t *data, size_t len) {
    size_t pos = 0;
    f->error = 0;
    while (len - pos >= HEADER) {
        const uint8_t *req = data + pos;
        uint64_t payload = u64_at(req + 1);
        if (payload > len - pos - HEADER) break;  /* not whole yet */
        const uint8_t *t = req + HEADER;
        struct fleetd_region *r;
        if (req[0] == CMD_SET_TENSOR) {
            if (payload < SET_FIXED) break;
            if (t[TENSOR] != 0) break;  /* the cache flag: Python stores the file */
            if (memcmp(t + T_NAME, "blk.", 4) == 0) break;  /* a weight: Python notes its layer */
            uint64_t size = payload - SET_FIXED;
            uint8_t *dst = checked_region(t, u64_at(t + TENSOR + 1), size, f->regions, f->n_regions,
                                          f->blck, f->tsize, f->n_types, &r);
            if (dst == NULL) break;
            memcpy(dst, t + SET_FIXED, size);
            r->written = 1;
            f->served.set_count += 1;
            f->served.set_bytes += HEADER + payload;
        } else if (req[0] == CMD_GET_TENSOR) {
            if (payload != GET_PAYLOAD) break;
            uint64_t size = u64_at(t + TENSOR + 8);
            const uint8_t *src = checked_region(t, u64_at(t + TENSOR), size, f->regions,
                                                f->n_regions, f->blck, f->tsize, f->n_types, &r);
            if (src == NULL) break;
            int rc = send_reply(f->fd, size, src);
            if (rc != 0) {
                f->error = rc;
                return pos;
            }
            f->served.get_count += 1;
            f->served.get_bytes += HEADER + payload;
            f->served.get_reply_bytes += 8 + size;
        } else {
            break;
        }
        pos += HEADER + payload;
    }
    return pos;
}
