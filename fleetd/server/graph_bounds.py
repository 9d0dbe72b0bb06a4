"""What a GRAPH_COMPUTE may make the daemon hold: its size, and how far a view may outgrow the
bytes it addresses.

A view's kernels work on its logical shape (product of ne), not on the bytes it spans
(ggml_nbytes): a stride-0 view of a 64-byte buffer can stand for 2^124 elements and drive
temporaries of that size under the execution lock. Real graphs never overlap their elements
much (a contiguous or permuted tensor has logical size == nbytes), so a view whose logical
size exceeds its extent by more than a bound is refused before any array exists.
"""

from __future__ import annotations

import numpy as np

from fleetd.errors import RemoteProtocolError
from fleetd.wire import TYPE_TRAITS, GraphCompute
from fleetd.wire.ggml import GGML_TYPE_COUNT

# Bytes per element of each type as a float (0 for unknown types: build_plan refuses those).
_ELEMENT_BYTES = np.zeros(max(GGML_TYPE_COUNT, max(TYPE_TRAITS) + 1), np.float64)
_BLOCK = np.ones_like(_ELEMENT_BYTES)
for _t, _tr in TYPE_TRAITS.items():
    if _tr.blck_size:
        _ELEMENT_BYTES[_t] = _tr.type_size / _tr.blck_size
        _BLOCK[_t] = _tr.blck_size


def check_graph(ev: GraphCompute, max_tensors: int, view_expansion: float, view_slack: int) -> None:
    """Raise RemoteProtocolError when the graph is larger than `max_tensors` (nodes or tensors),
    or when one of its tensors' logical bytes exceed `view_expansion` x its extent + `view_slack`."""
    n_tensors = len(ev.tensors)
    if len(ev.nodes) > max_tensors or n_tensors > max_tensors:
        raise RemoteProtocolError(
            f"GRAPH_COMPUTE: {len(ev.nodes)} nodes / {n_tensors} tensors, limit {max_tensors}"
        )
    if not n_tensors:
        return
    rec = ev.tensors
    ne = rec["ne"].astype(np.float64)
    nb = rec["nb"].astype(np.float64)
    types = np.minimum(rec["type"], len(_ELEMENT_BYTES) - 1)
    per_element = _ELEMENT_BYTES[types]
    logical = ne.prod(axis=1) * per_element  # floats: 2^128 is fine, no overflow
    # ggml_nbytes, in floats: the first element's bytes plus the span of every further index.
    extent = np.maximum(ne[:, 0] * nb[:, 0] / _BLOCK[types], per_element) + (
        (np.maximum(ne[:, 1:], 1) - 1) * nb[:, 1:]
    ).sum(axis=1)
    too_big = logical > view_expansion * extent + view_slack
    if too_big.any():
        i = int(np.flatnonzero(too_big)[0])
        raise RemoteProtocolError(
            f"GRAPH_COMPUTE: tensor id {int(rec['id'][i]):#x} ne={rec['ne'][i].tolist()} "
            f"nb={rec['nb'][i].tolist()} stands for {logical[i]:.3g} bytes over an extent of "
            f"{extent[i]:.3g} (limit {view_expansion:g}x + {view_slack})"
        )
