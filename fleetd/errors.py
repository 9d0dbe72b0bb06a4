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
    """A message breaks protocol 7 or fleetd's extension; which side broke it is the subclass."""


class LocalProtocolError(ProtocolError):
    """Our own code asked to send what the protocol forbids; the connection stays usable."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed or out of order: close that connection."""


class TransportError(FleetdError):
    """The stream under a connection failed: connect refused or unreachable, or a socket error."""


class ConnectTimeout(TransportError):
    """No connection (or no SSH banner) within the connect timeout."""


class ReadTimeout(TransportError):
    """The peer sent nothing within the read timeout."""


class PeerClosed(TransportError):
    """The other end closed or reset the connection in the middle of a message."""


class ComputeError(FleetdError):
    """A graph fleetd cannot compute (bad indices, a dead or busy worker): close that connection."""


class UnsupportedOp(ComputeError):
    """An op, or a combination of types, that fleetd has no kernel for; the message names both."""


class FleetError(FleetdError):
    """A fleet operation failed: fleetctl prints one line and exits 1."""


class UsageError(FleetError):
    """The operator's input names something that is not there or cannot go together: exit 2."""
