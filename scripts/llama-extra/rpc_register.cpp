// fleetd: make test-backend-ops see an RPC server as a backend device.
// A static initializer reads FLEETD_RPC_ENDPOINT ("host:port") and registers the RPC backend
// for it before main runs, so `test-backend-ops -b RPC0` compares that server with the CPU.
#include <cstdlib>
#include "ggml-backend.h"
#include "ggml-rpc.h"

namespace {
struct fleetd_rpc_register {
    fleetd_rpc_register() {
        const char * endpoint = std::getenv("FLEETD_RPC_ENDPOINT");
        if (endpoint == nullptr || *endpoint == '\0') {
            return;
        }
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint);
        if (reg != nullptr) {
            ggml_backend_register(reg);
        }
    }
};
const fleetd_rpc_register fleetd_rpc_register_instance;
}  // namespace
