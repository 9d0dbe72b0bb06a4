"""Sans-IO ggml RPC protocol core: no sockets, threads or clocks in this package."""
# ruff: noqa: F401  (re-exports: the flat public API)

from fleetd.wire.commands import (
    COMMANDS,
    MAX_ENDPOINT_LEN,
    MAX_GRAPH_NODES,
    PROTOCOL_VERSION,
    AllocBuffer,
    BufferClear,
    BufferGetBase,
    Cmd,
    CommandSpec,
    CopyTensor,
    CopyTensorTo,
    DeviceCount,
    Feature,
    FreeBuffer,
    GetAlignment,
    GetAllocSize,
    GetDeviceMemory,
    GetMaxSize,
    GetTensor,
    GraphCompute,
    GraphRecompute,
    Hello,
    InitTensor,
    MemsetTensor,
    PeerBarrier,
    Request,
    SetTensor,
    SetTensorHash,
    cmd_name,
)
from fleetd.wire.connection import (
    NEED_DATA,
    ClientConnection,
    ServerConnection,
    data_response_header,
    encode_response,
    hello_response,
    size_rule_error,
)
from fleetd.wire.ggml import (
    GGML_TYPE_COUNT,
    METADATA_OPS,
    TYPE_TRAITS,
    GgmlOp,
    GgmlType,
    GluOp,
    TensorFlag,
    UnaryOp,
    contiguous_strides,
    nbytes,
    op_name,
    row_size,
    type_name,
)
from fleetd.wire.hashing import fnv1a_64
from fleetd.wire.replies import (
    AllocBufferReply,
    BufferGetBaseReply,
    CopyTensorReply,
    CopyTensorToReply,
    DataReply,
    DeviceCountReply,
    GetAlignmentReply,
    GetAllocSizeReply,
    GetDeviceMemoryReply,
    GetMaxSizeReply,
    HelloReply,
    PeerBarrierReply,
    Reply,
    SetTensorHashReply,
)
from fleetd.wire.state import KNOWN_FEATURES, HelloGate, State
from fleetd.wire.tensor import RPC_TENSOR, RPC_TENSOR_DTYPE, RpcTensor, check_type

__all__ = [name for name in dir() if not name.startswith("_")]
