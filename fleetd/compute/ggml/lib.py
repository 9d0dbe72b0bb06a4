"""The foreign side of the ggml device: libggml-base + libggml-cpu of the pinned llama.cpp build,
their public types and the functions fleetd calls: each a typed stub on GgmlLibrary, declared
for ctypes by a decorator per library (`ggml_base_function`, `ggml_cpu_function`) and bound to
the loaded library's function by `GgmlLibrary()`. Nothing else lives here.

Layouts follow `ggml/include/ggml.h` of the pinned tree (llama-cpp-python 0.3.36's vendor dir).
`load()` checks the one size it can against the library (`ggml_tensor_overhead`), so a build of
another ggml version with a different struct fails at load, not in a kernel.
"""

# mypy: disable-error-code="empty-body"
# (GgmlLibrary's stubs never run: each is replaced by its C function when the library loads)

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from ctypes import POINTER, Array, c_bool, c_char, c_char_p, c_int, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from fleetd.tools import LLAMA_VERSION, build_dir
from fleetd.wire.ggml import GGML_MAX_DIMS, GGML_MAX_NAME, GGML_MAX_OP_PARAMS, GGML_MAX_SRC

if TYPE_CHECKING:
    from ctypes import _Pointer  # a POINTER(...) result, in the stubs' annotations

GGML_OBJECT_SIZE = 32  # struct ggml_object: offs, size, next, type, padding[4]

GGML_TENSOR_FLAG_COMPUTE = 16
GGML_STATUS_SUCCESS = 0


class GgmlInitParams(ctypes.Structure):
    """`struct ggml_init_params`, the argument of ggml_init."""

    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor`, the fields in header order; load() checks its size against the library."""


GgmlTensor._fields_ = [
    ("type", c_int),
    ("buffer", c_void_p),  # ggml_backend_buffer_t
    ("ne", c_int64 * GGML_MAX_DIMS),
    ("nb", c_size_t * GGML_MAX_DIMS),
    ("op", c_int),
    ("op_params", c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", c_int32),
    ("src", POINTER(GgmlTensor) * GGML_MAX_SRC),
    ("view_src", POINTER(GgmlTensor)),
    ("view_offs", c_size_t),
    ("data", c_void_p),
    ("name", c_char * GGML_MAX_NAME),
    ("extra", c_void_p),
    ("padding", c_char * 8),
]


class GgmlTypeTraits(ctypes.Structure):
    """`struct ggml_type_traits` (libggml-base): which types can convert to f32."""

    _fields_ = [
        ("type_name", c_char_p),
        ("blck_size", c_int64),
        ("blck_size_interleave", c_int64),
        ("type_size", c_size_t),
        ("is_quantized", c_bool),
        ("to_float", c_void_p),
        ("from_float_ref", c_void_p),
    ]


class GgmlTypeTraitsCpu(ctypes.Structure):
    """`struct ggml_type_traits_cpu` (libggml-cpu): which types the CPU kernels can dot or quantize to."""

    _fields_ = [
        ("from_float", c_void_p),
        ("vec_dot", c_void_p),
        ("vec_dot_type", c_int),
        ("nrows", c_int64),
    ]


# The same layout as a numpy dtype, to fill a graph's tensors column by column.
TENSOR_DTYPE = np.dtype(
    {
        "names": [f[0] for f in GgmlTensor._fields_],
        "formats": [
            "<i4",
            "<u8",
            ("<i8", 4),
            ("<u8", 4),
            "<i4",
            ("<i4", 16),
            "<i4",
            ("<u8", GGML_MAX_SRC),
            "<u8",
            "<u8",
            "<u8",
            f"S{GGML_MAX_NAME}",
            "<u8",
            "V8",
        ],
        "offsets": [getattr(GgmlTensor, f[0]).offset for f in GgmlTensor._fields_],
        "itemsize": ctypes.sizeof(GgmlTensor),
    }
)

ggml_context_p = c_void_p
ggml_cgraph_p = c_void_p
ggml_backend_t = c_void_p
ggml_backend_buffer_t = c_void_p
ggml_tensor_p = POINTER(GgmlTensor)

_Stub = TypeVar("_Stub", bound=Callable[..., Any])
_ArgTypes = list[type[Any]]
_ResType = type[Any] | None

# Every declared function: name -> (library, argtypes, restype); "base" is libggml-base, "cpu"
# libggml-cpu. GgmlLibrary binds them when it is made.
_DECLARED: dict[str, tuple[str, _ArgTypes, _ResType]] = {}


def ctypes_function_for(
    library: str,
) -> Callable[[str, _ArgTypes, _ResType], Callable[[_Stub], _Stub]]:
    """A decorator factory for the functions of one library (llama-cpp-python's
    `ctypes_function_for_shared_library`): `@ggml_base_function(name, argtypes, restype)` on a
    typed stub of GgmlLibrary declares the C function the stub stands for."""

    def ctypes_function(name: str, argtypes: _ArgTypes, restype: _ResType) -> Callable[[_Stub], _Stub]:
        def declare(stub: _Stub) -> _Stub:
            if stub.__name__ != name or name in _DECLARED:  # bound by its own name, once
                raise TypeError(f"stub {stub.__name__} for {name}: one per function, same name")
            _DECLARED[name] = (library, argtypes, restype)
            return stub

        return declare

    return ctypes_function


ggml_base_function = ctypes_function_for("base")
ggml_cpu_function = ctypes_function_for("cpu")


class GgmlLibrary:
    """The loaded libraries. Each method below is a typed stub of one C function; `__init__`
    replaces it on the instance by that function of the loaded library, argtypes and restype
    set, so `lib.ggml_init(params)` is a ctypes call with no Python frame of ours around it.
    ctypes gives a c_void_p result as an int, or None for NULL: `| None` where the C function
    returns NULL (most abort instead); a POINTER(...) result as a ctypes pointer."""

    def __init__(self, base: ctypes.CDLL, cpu: ctypes.CDLL, cpu_path: Path) -> None:
        self.cpu_path = cpu_path
        libs = {"base": base, "cpu": cpu}
        for name, (library, argtypes, restype) in _DECLARED.items():
            fn = getattr(libs[library], name)
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, fn)  # shadows the stub (a method is a non-data descriptor)
        expected = GGML_OBJECT_SIZE + ctypes.sizeof(GgmlTensor)
        if self.ggml_tensor_overhead() != expected:
            raise OSError(
                f"{cpu_path.parent}: struct ggml_tensor is not the one of llama.cpp "
                f"{LLAMA_VERSION} (overhead {self.ggml_tensor_overhead()}, expected {expected})"
            )

    def function_address(self, name: str) -> int:
        """The C address of a bound function, for C code that calls it (worker_loop.c)."""
        fn: Any = getattr(self, name)
        return ctypes.cast(fn, ctypes.c_void_p).value or 0

    # -- libggml-base ---------------------------------------------------------------------------

    @ggml_base_function("ggml_init", [GgmlInitParams], ggml_context_p)
    def ggml_init(self, params: GgmlInitParams, /) -> int: ...

    @ggml_base_function("ggml_free", [ggml_context_p], None)
    def ggml_free(self, ctx: int, /) -> None: ...

    @ggml_base_function("ggml_tensor_overhead", [], c_size_t)
    def ggml_tensor_overhead(self, /) -> int: ...

    @ggml_base_function("ggml_graph_overhead_custom", [c_size_t, c_bool], c_size_t)
    def ggml_graph_overhead_custom(self, size: int, grads: bool, /) -> int: ...

    @ggml_base_function("ggml_new_tensor", [ggml_context_p, c_int, c_int, POINTER(c_int64)], ggml_tensor_p)
    def ggml_new_tensor(
        self, ctx: int, type: int, n_dims: int, ne: Array[c_int64], /
    ) -> _Pointer[GgmlTensor]: ...

    @ggml_base_function("ggml_new_graph_custom", [ggml_context_p, c_size_t, c_bool], ggml_cgraph_p)
    def ggml_new_graph_custom(self, ctx: int, size: int, grads: bool, /) -> int: ...

    @ggml_base_function("ggml_add", [ggml_context_p, ggml_tensor_p, ggml_tensor_p], ggml_tensor_p)
    def ggml_add(
        self, ctx: int, a: _Pointer[GgmlTensor], b: _Pointer[GgmlTensor], /
    ) -> _Pointer[GgmlTensor]: ...

    @ggml_base_function("ggml_graph_add_node", [ggml_cgraph_p, ggml_tensor_p], None)
    def ggml_graph_add_node(self, cgraph: int, tensor: _Pointer[GgmlTensor], /) -> None: ...

    @ggml_base_function("ggml_graph_n_nodes", [ggml_cgraph_p], c_int)
    def ggml_graph_n_nodes(self, cgraph: int, /) -> int: ...

    @ggml_base_function("ggml_nbytes", [ggml_tensor_p], c_size_t)
    def ggml_nbytes(self, tensor: _Pointer[GgmlTensor], /) -> int: ...

    @ggml_base_function("ggml_op_name", [c_int], c_char_p)
    def ggml_op_name(self, op: int, /) -> bytes: ...  # a name for every op below GGML_OP_COUNT

    @ggml_base_function("ggml_type_name", [c_int], c_char_p)
    def ggml_type_name(self, type: int, /) -> bytes | None: ...  # None: a type number ggml left out

    @ggml_base_function("ggml_status_to_string", [c_int], c_char_p)
    def ggml_status_to_string(self, status: int, /) -> bytes: ...  # a string for every status

    @ggml_base_function("ggml_get_type_traits", [c_int], POINTER(GgmlTypeTraits))
    def ggml_get_type_traits(self, type: int, /) -> _Pointer[GgmlTypeTraits]: ...

    @ggml_base_function("ggml_backend_graph_compute", [ggml_backend_t, ggml_cgraph_p], c_int)
    def ggml_backend_graph_compute(self, backend: int, cgraph: int, /) -> int: ...

    @ggml_base_function("ggml_backend_free", [ggml_backend_t], None)
    def ggml_backend_free(self, backend: int, /) -> None: ...

    @ggml_base_function("ggml_backend_cpu_buffer_from_ptr", [c_void_p, c_size_t], ggml_backend_buffer_t)
    def ggml_backend_cpu_buffer_from_ptr(self, ptr: int, size: int, /) -> int: ...

    @ggml_base_function("ggml_backend_buffer_free", [ggml_backend_buffer_t], None)
    def ggml_backend_buffer_free(self, buffer: int, /) -> None: ...

    # -- libggml-cpu ----------------------------------------------------------------------------

    @ggml_cpu_function("ggml_backend_cpu_init", [], ggml_backend_t)
    def ggml_backend_cpu_init(self, /) -> int | None: ...  # None: no memory for its context

    @ggml_cpu_function("ggml_backend_cpu_set_n_threads", [ggml_backend_t, c_int], None)
    def ggml_backend_cpu_set_n_threads(self, backend_cpu: int, n_threads: int, /) -> None: ...

    @ggml_cpu_function("ggml_get_type_traits_cpu", [c_int], POINTER(GgmlTypeTraitsCpu))
    def ggml_get_type_traits_cpu(self, type: int, /) -> _Pointer[GgmlTypeTraitsCpu]: ...


# scripts/build-llama.sh's native build: both ggml libraries linked whole into one, whose calls
# bind inside it, as the static stock server has them (two -fPIC libraries ran a pipeline node's
# graph 13-44% longer; docs/DESIGN.md "One ggml library").
ONE_LIBRARY = "libggml-fleetd.so"


def library_dirs() -> list[Path]:
    """Where the libraries may be, in order: $FLEETD_GGML_LIB_DIR, the build cache of
    scripts/build-llama.sh, then next to this package (what `fleetctl deploy` ships). fleetd's
    own libfleetd-native.so is looked for in the same places (fleetd.compute.native)."""
    if os.environ.get("FLEETD_GGML_LIB_DIR"):
        return [Path(os.environ["FLEETD_GGML_LIB_DIR"])]
    return [build_dir() / "lib", Path(__file__).with_name("_lib")]


def _best_cpu_variant(directory: Path) -> Path | None:
    """libggml-cpu.so of a native build, else the portable variant this CPU scores highest
    (GGML_BACKEND_DL builds export `ggml_backend_score`; 0 means it cannot run here). Call it
    with this directory's libggml-base loaded: a variant needs libggml-base.so.0, which only
    that loaded copy provides (by its soname) where the build tree's RPATH does not exist."""
    native = directory / "libggml-cpu.so"
    if native.exists():
        return native
    best, best_score = None, 0
    for path in sorted(directory.glob("libggml-cpu-*.so")):
        try:
            score_fn = ctypes.CDLL(str(path)).ggml_backend_score
        except (OSError, AttributeError):
            continue
        score_fn.restype = c_int
        if (score := score_fn()) > best_score:
            best, best_score = path, score
    return best


def load() -> GgmlLibrary:
    """Load the libraries from the first directory that has them; OSError says why not."""
    tried = []
    for directory in library_dirs():
        one_path = directory / ONE_LIBRARY
        if one_path.exists():  # the native build: ggml-base and ggml-cpu in one library
            one = ctypes.CDLL(str(one_path), mode=ctypes.RTLD_GLOBAL)
            return GgmlLibrary(one, one, one_path)
        base_path = directory / "libggml-base.so"
        if not base_path.exists():
            tried.append(f"{directory}: no libggml-base.so")
            continue
        # RTLD_GLOBAL: libggml-cpu resolves its libggml-base symbols against this copy. Loaded
        # before any libggml-cpu: a shipped directory holds libggml-base.so only, and the
        # variants' DT_NEEDED libggml-base.so.0 matches this copy's soname.
        base = ctypes.CDLL(str(base_path), mode=ctypes.RTLD_GLOBAL)
        cpu_path = _best_cpu_variant(directory)
        if cpu_path is None:
            tried.append(f"{directory}: no libggml-cpu that loads and runs on this CPU")
            continue
        return GgmlLibrary(base, ctypes.CDLL(str(cpu_path)), cpu_path)
    raise OSError("ggml libraries not found (run scripts/build-llama.sh ggml): " + "; ".join(tried))
