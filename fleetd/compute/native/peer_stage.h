/* peer_stage.c: the asynchronous peer copy's staging, shared by Python and the sessions' loops. */
#ifndef FLEETD_PEER_STAGE_H
#define FLEETD_PEER_STAGE_H
#include <stddef.h>
#include <stdint.h>

#define PS_TENSOR 296        /* rpc_tensor on the wire */
#define PS_PUSH_FAILED 1     /* PEER_PUSH flag: the source failed this copy, no data follows */
#define PS_PUSH_FIXED (17 + PS_TENSOR)  /* PEER_PUSH's payload before its data: stream u64,
                                           seq u64, flags u8, dst rpc_tensor */

/* fleetd_streams_admit's reasons (fleetd.server.peer_streams words them) */
enum {
    PS_UNKNOWN = 1,        /* no such stream */
    PS_LATE = 2,           /* seq waited for already, or pushed twice */
    PS_TOO_MANY = 3,       /* max_unwaited copies of the stream not waited for */
    PS_SOURCE_FAILED = 4,  /* PS_PUSH_FAILED */
    PS_P2P_OFF = 5,
    PS_NO_ROOM = 6,        /* the peer-copy budget */
    PS_NOT_VOUCHED = 7,    /* C only: a destination Python has not checked */
};
/* fleetd_streams_wait's answers besides 0 and a slot state */
enum { PS_NOT_OWNER = -1, PS_OUT_OF_ORDER = -2 };
enum { PS_ARRIVING = 1, PS_STAGED = 2, PS_REFUSED = 3 };

struct fleetd_streams;

int fleetd_streams_admit(struct fleetd_streams *t, uint64_t id, uint64_t seq, uint64_t size,
                         uint32_t flags, int p2p, int c_only, const uint8_t *dst, uint64_t frees,
                         uint8_t **data);
void fleetd_streams_stage(struct fleetd_streams *t, uint64_t id, uint64_t seq, const uint8_t *dst,
                          uint8_t *data, uint64_t size);
void fleetd_streams_refuse(struct fleetd_streams *t, uint64_t id, uint64_t seq, uint8_t *data,
                           uint64_t size);
int fleetd_streams_wait(struct fleetd_streams *t, uint64_t id, uint64_t seq, int64_t owner,
                        int64_t until_ns, uint8_t *dst, uint64_t *size);
uint8_t *fleetd_streams_settle(struct fleetd_streams *t, uint64_t id, uint64_t seq, int64_t owner);
void fleetd_streams_done(struct fleetd_streams *t, uint8_t *data, uint64_t size);
#endif

/* -- the source side: a session's pushes on one link, from its loop (peer_stage.c) ---------- */

#define ROUTE_RING 64          /* pushes in flight on one route */
#define ROUTE_ENDPOINT 260     /* MAX_ENDPOINT_LEN */
#define ROUTE_INLINE_MAX 65536 /* _Pusher.INLINE_MAX: larger copies are Python's */
enum { PUSH_SENT = 1, PUSH_LANDED = 2, PUSH_FAILED = 3 };

struct fleetd_push {
    uint64_t stream, seq, size;
    uint8_t *data;             /* the bytes read at the copy, kept until the answer */
    int32_t state;
    int32_t reserved;
};

/* One (stream, endpoint) of a session whose link the C loop may push on: Python vouched for the
 * endpoint (resolved, allowed, the link open, the pusher idle) and hands the route to the loop
 * (fd >= 0) or to its pusher thread (drain), never to both. */
struct fleetd_route {
    uint64_t stream;
    uint64_t last_seq;         /* the stream's last seq this session took: seqs must increase */
    int32_t fd;                /* the link's socket while the loop holds the route; else -1 */
    int32_t ep_len;
    uint8_t ep[ROUTE_ENDPOINT];
    int32_t broken;            /* a send failed or an answer was malformed: Python drops the link */
    uint32_t head, n;          /* the ring: pushes [head, head + n) in send order ... */
    uint32_t answered;         /* ... of which the first `answered` have their answer */
    uint64_t pushed_count, pushed_bytes, landed_count, landed_bytes;  /* only grow */
    struct fleetd_push ring[ROUTE_RING];
};

/* fastpath.c */
struct iovec;
int fleetd_send_all(int fd, struct iovec *iov, int n);

int fleetd_route_drain(struct fleetd_route *r, struct fleetd_streams *t, int fd, int timeout_ms);
size_t fleetd_route_read_answers(struct fleetd_route *r, struct fleetd_streams *t, int block_ms);
int fleetd_route_push(struct fleetd_route *r, struct fleetd_streams *t, uint64_t seq,
                      const uint8_t *dst, const uint8_t *src, uint64_t size);
