/* libfleetd-native: the little compiled code fleetd has of its own (the ggml kernels are ggml's).
 *
 * FNV-1a 64, the stock server's fnv_hash (ggml-rpc.cpp), for the cache directory
 * (SET_TENSOR with the cache flag, SET_TENSOR_HASH): byte-serial, so a plain loop is all there
 * is, and no CPU-specific flags: the same build runs on every node a deploy reaches.
 * Built by scripts/build-llama.sh next to the ggml libraries; bound in __init__.py. */
#include <stddef.h>
#include <stdint.h>

uint64_t fleetd_fnv1a_64(const uint8_t *data, size_t len, uint64_t hash) {
    for (size_t i = 0; i < len; ++i) {
        hash ^= data[i];
        hash *= 0x100000001b3ULL;
    }
    return hash;
}
