"""nki-library's own kernels and torch references, loaded from the unpacked sources for the real-shape tier (test code;
nothing in src/ imports this).

nki-library d2ad3a5 (../shared/nxdi-cpu; setup.sh unpacks it to <venv>/nxdi-cpu-src/nki-library) ships each kernel
as Python that NKI traces: its argument checks (`kernel_assert`), its tile loops and every static index it takes
run in Python before anything reaches a NeuronCore. `kernel_problems` runs that Python with the `nki` package stood
in by a shape-only tracer (`_nki_tracer`): tensors are shapes and dtypes, the ISA calls do nothing, and every static
slice or access pattern is checked against the tensor it reads or writes, as NKI's tracer and the DMA engines'
bounds checks would. So the kernel's own asserts are the checks here, and a new assert upstream is a new check; an
out-of-bounds static index (the 128-row output tiles of a prefill that is not a multiple of 128) is one too. What
the tracer cannot see: values (a dynamic index's range; those are checked from the real tensors by the tests),
SBUF/PSUM capacity, the compiler's instruction limits, numerics (the torch references are for those).

`reference(name)` loads a kernel's torch reference file by path, with the one name it imports that the tarball
lacks (moe_cte_torch.py's BWMMFunc, from nki-library's test tree) stood in by an enum of the same members.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import io
import sys
import traceback
import types
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import torch

# setup.sh unpacks the tarball beside NxD/NxDI in the venv; NKI_LIBRARY_SRC overrides (e.g. a git checkout)
NKI_LIBRARY = Path(sys.prefix) / "nxdi-cpu-src" / "nki-library"
PACKAGE = "_nkilib_d2ad3a5"  # the sources' nkilib, loaded under a name of their own beside the shim's nkilib


def library_root() -> Path:
    import os

    root = Path(os.environ.get("NKI_LIBRARY_SRC", NKI_LIBRARY))
    if not (root / "src/nkilib_src/nkilib").is_dir():
        raise FileNotFoundError(f"{root}: no nki-library sources (src/nkilib_src/nkilib); run "
                                f"../shared/nxdi-cpu/setup.sh or set NKI_LIBRARY_SRC")
    return root


# -- the shape-only tracer standing in for `nki` ------------------------------------------------------------------

class KernelBoundsError(AssertionError):
    """A static index or access pattern outside the tensor it addresses."""


TORCH_TO_NKI = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.int8: "int8",
                torch.int16: "int16", torch.bool: "bool_", torch.float8_e4m3fn: "float8_e4m3",
                torch.float8_e5m2: "float8_e5m2"}
NKI_DTYPES = ("bfloat16", "float16", "float32", "tfloat32", "int8", "int16", "int32", "int64", "uint8", "uint16",
              "uint32", "bool_", "float8_e4m3", "float8_e5m2", "float8_e4m3fn", "float8_e4m3fn_x4",
              "float8_e5m2_x4", "float4_e2m1fn_x4")


class DS:
    """nl.ds(start, size): a dynamic-looking slice of static start and size."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start, self.size = start, size


class Tile:
    """An nl.ndarray as NKI's tracer sees it: a shape, a dtype, a buffer; indexing and access patterns are
    bounds-checked against the tensor they address (`_base_numel`: its whole storage, views included)."""

    __slots__ = ("shape", "dtype", "buffer", "name", "_base_numel", "oob")

    def __init__(self, shape, dtype=None, buffer=None, name=None, base_numel=None, oob=None):
        self.shape = tuple(int(s) for s in shape)
        if dtype not in NKI_DTYPES:
            raise TypeError(f"dtype {dtype!r} is not an NKI dtype")
        self.dtype, self.buffer, self.name = dtype, buffer, name
        self._base_numel = base_numel if base_numel is not None else _numel(self.shape)
        self.oob = oob  # why this view leaves its tensor: raised when an instruction reads or writes it

    def _sub(self, shape, oob=None, dtype=None) -> "Tile":
        return Tile(shape, dtype or self.dtype, self.buffer, base_numel=self._base_numel, oob=self.oob or oob)

    def __repr__(self):
        return f"Tile({list(self.shape)}, {self.dtype}, {self.buffer})"

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index) -> "Tile":
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (len(self.shape) - len(index) + 1) + index[at + 1:]
        if len(index) > len(self.shape):
            raise KernelBoundsError(f"{len(index)} indices into {self!r}")
        out, oob = [], None
        for dim, (i, n) in enumerate(zip(index + (slice(None),) * (len(self.shape) - len(index)), self.shape)):
            if isinstance(i, DS):
                if not (0 <= i.start and i.size >= 0 and i.start + i.size <= n):
                    oob = oob or f"ds({i.start}, {i.size}) on dim {dim} of {self!r}"
                out.append(i.size)
            elif isinstance(i, slice):
                start, stop, step = i.start or 0, n if i.stop is None else i.stop, i.step or 1
                if isinstance(start, Tile) or isinstance(stop, Tile):
                    out.append(n)
                    continue
                if not (0 <= start <= stop <= n):
                    oob = oob or f"{start}:{stop} on dim {dim} of {self!r}"
                out.append(max(0, -(-(stop - start) // step)))
            elif isinstance(i, Tile):  # a dynamic index: its values are the runtime's (checked from real tensors)
                out.append(1)
            else:
                if not 0 <= int(i) < n:
                    oob = oob or f"index {i} on dim {dim} of {self!r}"
        return self._sub(out, oob)

    def ap(self, pattern, offset=0, scalar_offset=None, vector_offset=None, indirect_dim=None, dtype=None,
           **_):
        """An access pattern [[stride, count], ...] from `offset`. With a dynamic offset (scalar_offset: a whole
        slab of the outer dimension per unit; vector_offset: the indirect dimension's rows), the static part must
        stay within one slab / one row, as the DMA addresses them."""
        pattern = [list(p) for p in pattern]
        counts = [int(c) for _, c in pattern]
        if isinstance(offset, Tile):  # a runtime offset
            return self._sub(counts, dtype=dtype)
        span = [(p[0] * (p[1] - 1)) for p in pattern if p[1] > 0]
        if vector_offset is not None:
            d = indirect_dim or 0
            span = [p[0] * (p[1] - 1) for k, p in enumerate(pattern) if k != d and p[1] > 0]
            limit = self._base_numel // max(self.shape[0], 1)
        elif scalar_offset is not None:
            limit = self._base_numel // max(self.shape[0], 1)
        else:
            limit = self._base_numel
        last = offset + sum(span)
        oob = None
        if any(c < 0 for c in counts) or offset < 0 or (min(counts, default=1) > 0 and last >= limit):
            oob = (f"access pattern {pattern} from offset {offset} reaches element {last} of {limit} "
                   f"({'one slab of ' if limit != self._base_numel else ''}{self!r})")
        return self._sub(counts, oob, dtype)

    def reshape(self, shape) -> "Tile":
        shape = tuple(shape)
        if _numel(shape) != self.numel:
            raise KernelBoundsError(f"reshape of {self!r} to {list(shape)}")
        return self._sub(shape)

    def view(self, dtype) -> "Tile":
        return self._sub(self.shape, dtype=dtype)

    def get_view(self):
        return self


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _Grid:
    """The program (physical core) the kernel body is traced for: LNC=2 launches it once per core. `registers`: the
    values runtime registers will load, in order (a dynamic loop's trip count is data), when a caller knows them."""
    n_programs, program_id = 1, 0
    registers: list = []


class _Register:
    """nisa.register_alloc(): a runtime scalar; nl.dynamic_range over it runs to the value _Grid.registers gave it."""
    value = None


def _register_load(register, src, *args, **kwargs):
    _op("nki.isa.register_load")(src)
    register.value = _Grid.registers.pop(0) if _Grid.registers else None


def _dynamic_range(start, stop=None, step=1):
    if stop is None:
        start, stop = 0, start
    if isinstance(stop, _Register):
        if stop.value is None:
            raise TypeError("a dynamic loop over a runtime register whose value this trace was not given")
        stop = stop.value
    return range(start, stop, step)


def _op(name):
    """An ISA call: it reads and writes its tile arguments, so a view outside its tensor fails here."""
    def op(*args, **kwargs):
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, Tile) and t.oob:
                    raise KernelBoundsError(f"{name}: {t.oob}")
        return None
    op.__name__ = name
    return op


class _Symbol:
    """An enum-like constant (nl.add, nisa.vector_engine, oob_mode.skip, ...): compared by identity."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class _Namespace(types.ModuleType):
    """A module whose unknown attributes are no-op ISA calls (lower case) or constants."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Symbol(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Ops(_Namespace):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _op(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _NKIObject:
    """nl.NKIObject: a plain record; subclasses are dataclasses or set their fields in __init__."""

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)


class _Kernel:
    """nki.jit: the traced function itself; `kernel[grid](...)` traces it for each program of the grid."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __getitem__(self, grid):
        return lambda *a, **k: self.fn(*a, **k)


def _jit(fn=None, *args, **kwargs):
    if callable(fn) and not args and not kwargs:
        return _Kernel(fn)
    return _Kernel


def _shared_constant(source, dtype=None, **_) -> Tile:
    """nl.shared_constant: an HBM constant from a .npy file (the topk kernel writes its rotation matrices so)."""
    import numpy as np

    array = np.load(source) if isinstance(source, (str, Path)) else np.asarray(source)
    return Tile(array.shape, dtype or TORCH_TO_NKI[torch.from_numpy(array[:0].copy()).dtype], _Symbol("shared_hbm"))


class _NcVersion(enum.IntEnum):
    gen2 = 2  # trn1
    gen3 = 3  # trn2
    gen4 = 4  # trn3


def _nki_tracer() -> dict[str, types.ModuleType]:
    """The modules standing in for `nki`, `nki.isa`, `nki.isa.constants`, `nki.language` (and nki.typing, nki.tensor)
    while a kernel is imported and traced."""
    nki = types.ModuleType("nki")
    nl = _Ops("nki.language")
    nisa = _Ops("nki.isa")
    constants = _Namespace("nki.isa.constants")
    typing_ = _Namespace("nki.typing")
    for name in NKI_DTYPES:
        setattr(nl, name, name)
    nl.bool = "bool_"
    for name in ("sbuf", "psum", "hbm", "shared_hbm", "private_hbm", "shared_constant"):
        setattr(nl, name, _Symbol(f"nl.{name}"))
    nl.ndarray = lambda shape, dtype=None, buffer=None, name=None, **_: Tile(shape, dtype, buffer, name)
    nl.zeros = lambda shape, dtype=None, buffer=None, name=None, **_: Tile(shape, dtype, buffer, name)
    nl.ds = DS
    nl.NKIObject = _NKIObject
    nl.affine_range = nl.sequential_range = nl.static_range = lambda *a, **_: range(*a)
    nl.dynamic_range = _dynamic_range
    nisa.register_alloc = lambda *a, **_: _Register()
    nisa.register_load = _register_load
    nl.program_ndim = lambda: 1 if _Grid.n_programs > 1 else 0
    nl.num_programs = lambda axes=0: _Grid.n_programs
    nl.program_id = lambda axis=0: _Grid.program_id
    nl.load = lambda src, **_: (_op("nki.language.load")(src), Tile(src.shape, src.dtype, _Symbol("nl.sbuf")))[1]
    nl.tile_size = types.SimpleNamespace(pmax=128, psum_fmax=512, gemm_stationary_fmax=128, gemm_moving_fmax=512,
                                         psum_partition_dim=128)
    nl.ndarray_type = Tile
    nl.shared_constant = _shared_constant
    nl.shared_identity_matrix = lambda n, dtype="bfloat16", **_: Tile((n, n), dtype, _Symbol("nl.sbuf"))
    nisa.nc_version = _NcVersion
    nisa.get_nc_version = lambda: _NcVersion.gen3
    nisa.constants = constants
    for name in ("skip", "error"):
        setattr(constants, "oob_mode", getattr(constants, "oob_mode", types.SimpleNamespace()))
        setattr(constants.oob_mode, name, _Symbol(f"oob_mode.{name}"))
    nki.jit = _jit
    nki.isa, nki.language, nki.typing = nisa, nl, typing_
    nki.dtype = str
    nki.tensor = Tile
    return {"nki": nki, "nki.isa": nisa, "nki.isa.constants": constants, "nki.language": nl,
            "nki.typing": typing_}


_TRACER = _nki_tracer()


@contextmanager
def _tracing(n_programs: int = 1, program_id: int = 0):
    """sys.modules' `nki` is the tracer (and the grid this program's) inside; what was there is put back after."""
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "nki" or k.startswith("nki.")}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(_TRACER)
    previous = (_Grid.n_programs, _Grid.program_id)
    _Grid.n_programs, _Grid.program_id = n_programs, program_id
    try:
        yield
    finally:
        _Grid.n_programs, _Grid.program_id = previous
        for k in _TRACER:
            sys.modules.pop(k, None)
        sys.modules.update(saved)


def _package() -> None:
    """PACKAGE and its subpackages as bare namespaces over the sources: importing one kernel runs that kernel's
    module and its imports, not every package __init__ (moe_cte's imports the MX kernels and their dependencies)."""
    if PACKAGE in sys.modules:
        return
    root = library_root() / "src/nkilib_src/nkilib"
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        name = ".".join([PACKAGE, *d.relative_to(root).parts])
        m = types.ModuleType(name)
        m.__path__ = [str(d)]
        m.__package__ = name
        sys.modules[name] = m


def module(dotted: str) -> types.ModuleType:
    """A module of the sources, e.g. "core.moe.moe_cte.bwmm_shard_on_block", imported with the tracer as `nki`."""
    _package()
    with _tracing():
        return importlib.import_module(f"{PACKAGE}.{dotted}")


# -- kernels: entry points, and their traced argument checks --------------------------------------------------------

KERNELS = {  # name -> (module, function)
    "bwmm_shard_on_block": ("core.moe.moe_cte.bwmm_shard_on_block", "bwmm_shard_on_block"),
    "blockwise_mm_baseline_shard_intermediate_hybrid": ("core.moe.moe_cte.bwmm_shard_on_I",
                                                        "blockwise_mm_baseline_shard_intermediate_hybrid"),
    "cumsum": ("core.cumsum.cumsum", "cumsum"),
    "topk": ("core.topk.rotational_topk", "topk"),
    "cascaded_max": ("core.max.cascaded_max", "cascaded_max"),
}


def kernel(name: str):
    mod, fn = KERNELS[name]
    return getattr(module(mod), fn)


@contextmanager
def counting(name: str, function: str):
    """Counts, per program, the calls a kernel's module makes of one of its own functions (the per-block step, to
    count the blocks a trace computes): yields the list of counts, filled as programs are traced."""
    mod = module(KERNELS[name][0])
    original, counts = getattr(mod, function), []
    last = [None]

    def counted(*args, **kwargs):
        if last[0] != _Grid.program_id or not counts:
            counts.append(0)
            last[0] = _Grid.program_id
        counts[-1] += 1
        return original(*args, **kwargs)

    setattr(mod, function, counted)
    try:
        yield counts
    finally:
        setattr(mod, function, original)


def source_file(name: str) -> Path:
    return library_root() / "src/nkilib_src/nkilib" / (KERNELS[name][0].replace(".", "/") + ".py")


def as_tile(value):
    """A torch tensor as the kernel's tracer sees an HBM argument; anything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in TORCH_TO_NKI:
            raise TypeError(f"{value.dtype} has no NKI dtype")
        return Tile(value.shape, TORCH_TO_NKI[value.dtype], _TRACER["nki.language"].shared_hbm)
    return value


def translate(value):
    """NxD passes the shim's enums and records (or, on trn2, the SDK's nkilib's); the sources' own classes of the
    same name stand for them here, by name: the kernel compares them by identity."""
    cls = type(value)
    if isinstance(value, enum.Enum):
        for mod in ("core.utils.common_types", "core.moe.moe_cte.moe_cte_utils"):
            ours = getattr(module(mod), cls.__name__, None)
            if ours is not None and value.name in ours.__members__:
                return ours[value.name]
        raise TypeError(f"{value!r}: no enum {cls.__name__} in nki-library's common types")
    if cls.__name__ == "SkipMode":
        return module("core.moe.moe_cte.moe_cte_utils").SkipMode(bool(value.skip_token), bool(value.skip_weight))
    if isinstance(value, str) and value in NKI_DTYPES:
        return value  # the shim's nl dtypes are these strings too
    return value


def kernel_problems(name: str, kwargs: dict, grid: int | None = 2, args: tuple = (),
                    registers: list | None = None) -> list[str]:
    """The kernel's own checks on these arguments, launched as NxD/NxDI launch it (`kernel[grid](...)`, traced once
    per program of the grid; grid None: a plain call, one program): [] when every assert holds and every static
    access is in bounds, else what failed and where (file:line under src/nkilib_src/nkilib/). `registers`: the runtime
    values its dynamic loops run to (each program loads them in order)."""
    entry = kernel(name)
    targs = tuple(as_tile(translate(a)) for a in args)
    tkw = {k: as_tile(translate(v)) for k, v in kwargs.items()}
    problems = []
    for pid in range(grid or 1):
        _Grid.registers = list(registers or [])
        with _tracing(grid or 1, pid), redirect_stdout(io.StringIO()):  # nki-library's logger prints
            try:
                (entry if grid is None else entry[grid])(*targs, **tkw)
            except (AssertionError, TypeError, IndexError, ValueError, KeyError, AttributeError) as e:
                problems.append(f"program {pid}: {_message(e)} at {_where(e)}")
    return problems


def _message(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "Kernel validation exception: " in text:  # kernel_assert's wrapping, kernel_assert.py:17
        text = "kernel_assert: " + text.split("Kernel validation exception: ", 1)[1].split(" - Please check", 1)[0]
    return text if isinstance(e, AssertionError) else f"{type(e).__name__}: {text}"


def _where(e: Exception) -> str:
    """The innermost frame in nki-library's kernel sources (not kernel_assert's own): the assert or the access that
    failed, as file:line under src/nkilib_src/nkilib/."""
    root = library_root() / "src/nkilib_src/nkilib"
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f.filename.startswith(str(root)) and not f.filename.endswith("kernel_assert.py")]
    f = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
    path = Path(f.filename)
    return f"{path.relative_to(root) if path.is_relative_to(root) else path}:{f.lineno}"


# -- torch references -----------------------------------------------------------------------------------------------

class BWMMFunc(enum.Enum):
    """Stand-in for nki-library's test enum (test/integration/nkilib/core/moe/moe_cte/test_moe_cte_common.py, not in
    the tarball), which moe_cte_torch_ref imports at call time and compares by member."""
    SHARD_ON_BLOCK = 1
    SHARD_ON_HIDDEN = 2
    SHARD_ON_INTERMEDIATE = 3
    SHARD_ON_INTERMEDIATE_AFFINITY_ON_INTERMEDIATE = 4
    SHARD_ON_INTERMEDIATE_HW = 5
    SHARD_ON_INTERMEDIATE_DROPPING = 6


_TEST_MODULE = "test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common"

REFERENCES = {  # name -> (module, function)
    "bwmm_shard_on_block": ("core.moe.moe_cte.moe_cte_torch", "moe_cte_torch_ref"),
    "cumsum": ("core.cumsum.cumsum_torch", "cumsum_torch_ref"),
    "topk": ("core.topk.torch_ref", "topk_torch_ref"),
    "cascaded_max": ("core.max.cascaded_max_torch", "cascaded_max_torch_ref"),
}


def reference(name: str):
    mod, fn = REFERENCES[name]
    return getattr(module(mod), fn)


def moe_cte_reference(**kwargs) -> dict:
    """moe_cte_torch_ref with its test enum stood in (for the call's duration only: `test` is a common name)."""
    saved = {k: sys.modules.get(k) for k in _parents(_TEST_MODULE)}
    stand_in = types.ModuleType(_TEST_MODULE)
    stand_in.BWMMFunc = BWMMFunc
    for k in _parents(_TEST_MODULE):
        sys.modules[k] = stand_in if k == _TEST_MODULE else types.ModuleType(k)
    try:
        return reference("bwmm_shard_on_block")(bwmm_func=BWMMFunc.SHARD_ON_BLOCK, **kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _parents(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
