"""Every error fleetd raises on purpose.

    FleetdError
    ├── ProtocolError
    │   ├── LocalProtocolError    our code asked for something the protocol forbids
    │   └── RemoteProtocolError   the peer sent something malformed: close that connection
    ├── TransportError
    │   ├── ConnectTimeout
    │   ├── ReadTimeout
    │   └── PeerClosed            EOF or reset in the middle of a message
    ├── ComputeError              a graph fleetd cannot compute: close that connection
    │   └── UnsupportedOp         names the op and the types
    └── FleetError                one or more nodes of a fleet operation failed
"""


class FleetdError(Exception):
    """Base of every error fleetd raises on purpose."""


class ProtocolError(FleetdError):
    pass


class LocalProtocolError(ProtocolError):
    pass


class RemoteProtocolError(ProtocolError):
    pass


class TransportError(FleetdError):
    pass


class ConnectTimeout(TransportError):
    pass


class ReadTimeout(TransportError):
    pass


class PeerClosed(TransportError):
    pass


class ComputeError(FleetdError):
    pass


class UnsupportedOp(ComputeError):
    pass


class FleetError(FleetdError):
    pass
