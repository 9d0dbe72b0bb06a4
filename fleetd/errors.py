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
└── FleetError                a fleet operation failed (fleetctl prints one line, exit 1)
    ├── UsageError            the operator asked for what is not there (a node name, a flag
    │                         combination): fleetctl's usage line, exit 2
    ├── NodesFileError        a bad line in the nodes file, with its number   (fleet/nodes_file.py)
    ├── FleetFailed           some nodes failed; carries the whole result     (fleet/node.py)
    └── NodeError             one node failed; `str()` is the reason shown    (fleet/ssh.py)
        ├── SshError          refused, unreachable, authentication, host key
        ├── ControlUnreachable the control port did not open through SSH
        └── ControlError      the control API answered an error status       (fleet/control_client.py)
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


class UsageError(FleetError):
    """The operator's input names something that is not there or cannot go together: exit 2."""
