/* peer_stage.c: the asynchronous peer copy's staging, shared by Python and the sessions' loops. */
#ifndef FLEETD_PEER_STAGE_H
#define FLEETD_PEER_STAGE_H
#include <stddef.h>
#include <stdint.h>

#define PS_TENSOR 296        /* rpc_tensor on the wire */
#define PS_PUSH_FAILED 1     /* PEER_PUSH flag: the source failed this copy, no data follows */

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
