"""A strict stand-in for CuPy, for proving the GPU path on a CPU (tests only, not a device).

Its arrays (:class:`DeviceArray`) hold a NumPy array that nothing outside may see, and refuse
every implicit trip to host memory where CuPy raises, and a few where CuPy would copy quietly:

* ``np.asarray(a)`` / ``np.array(a)`` (``__array__``) and every NumPy function given one
  (``np.concatenate``, ``np.argsort``, ...: ``__array_function__``), and ufunc methods
  (``np.add.at``): TypeError. (CuPy dispatches some NumPy functions to its own; refusing them
  all keeps layer code on ``xp = array_module(x)``, which works on both.)
* mixing with ``numpy.ndarray`` in arithmetic, in ``xp.`` functions, as an index, or as the
  value of an assignment: TypeError (Python and NumPy scalars are fine, as on CuPy).

Crossings are explicit and counted in :data:`crossings`: ``asarray`` of host data and
``.set()`` (h2d), ``asnumpy`` / ``.get()`` / ``.tolist()`` (d2h), and reads of a device scalar
(``float()``, ``int()``, ``bool()``, ``.item()``: ``scalar``). ``cuda.get_current_stream()
.synchronize()`` counts synchronisations. ``scatter_add`` is cupyx.scatter_add.

Why not the ``array-api-strict`` package: it is the array API standard's namespace (no
``einsum``, no ``.reshape``/``.sum`` methods, no ``asnumpy``/``.get()``/``.set()``), while refmp,
like CuPy, speaks NumPy's API; running refmp on it would test a rewrite, not the CuPy path.

Use: ``backend.use(strict)`` before building a model; ``backend.use("numpy")`` after.
"""

from __future__ import annotations

import os
import sys
import traceback
import types

import numpy as np


class Crossings:
    """Host<->device traffic through the stand-in, whoever caused it. With ``trace`` on,
    ``log`` gets (kind, nbytes, site, staged) per crossing: ``site`` the innermost refmp
    function outside runtime/backend.py and the MPI layer's distributed/comm.py and
    distributed/waiting.py ("refmp/training/trainer.py:step"), ``staged`` whether it was Comm
    staging a buffer for MPI (distributed/comm.py: a wait finishes a staged receive through it)."""

    def __init__(self):
        self.trace = False
        self.reset()

    def reset(self) -> None:
        self.bytes = {"d2h": 0, "h2d": 0}
        self.count = {"d2h": 0, "h2d": 0, "scalar": 0, "sync": 0}
        self.log: list[tuple[str, int, str, bool]] = []

    def add(self, kind: str, nbytes: int = 0) -> None:
        self.count[kind] += 1
        if kind in self.bytes:
            self.bytes[kind] += int(nbytes)
        if self.trace and kind != "sync":
            stack = traceback.extract_stack()
            files = [f.filename.replace(os.sep, "/") for f in stack]
            ours = [(f, s.name) for f, s in zip(files, stack, strict=True) if "/refmp/" in f
                    and not f.endswith(("/refmp/runtime/backend.py", "/refmp/distributed/comm.py",
                                        "/refmp/distributed/waiting.py"))]
            site = f"refmp/{ours[-1][0].rsplit('/refmp/', 1)[1]}:{ours[-1][1]}" if ours else "?"
            staged = any(f.endswith("/refmp/distributed/comm.py") for f in files)
            self.log.append((kind, int(nbytes), site, staged))


crossings = Crossings()


def _refuse(what: str):
    raise TypeError(f"strict device array: {what} (implicit host conversion; CuPy refuses it)")


def _dev(v):
    """Operand or argument -> the NumPy array inside; host arrays refused."""
    if isinstance(v, DeviceArray):
        return v._a
    if isinstance(v, np.ndarray):
        _refuse(f"a numpy.ndarray {v.shape} mixed with device arrays")
    if isinstance(v, (list, tuple)):
        return type(v)(_dev(e) for e in v)
    if isinstance(v, dict):
        return {k: _dev(e) for k, e in v.items()}
    return v


def _wrap(r):
    """NumPy result -> device array (NumPy scalars become 0-d arrays, as CuPy returns)."""
    if isinstance(r, np.ndarray):
        return DeviceArray(r)
    if isinstance(r, np.generic):
        return DeviceArray(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(e) for e in r)
    if isinstance(r, list):
        return [_wrap(e) for e in r]
    return r


def _binop(ufunc, reflected=False):
    def op(self, other):
        o = _dev(other)
        return DeviceArray(np.asarray(ufunc(o, self._a) if reflected else ufunc(self._a, o)))
    return op


def _inplace(ufunc):
    def op(self, other):
        ufunc(self._a, _dev(other), out=self._a)
        return self
    return op


def _unary(ufunc):
    return lambda self: DeviceArray(ufunc(self._a))


class DeviceArray:
    """An array in "device memory": NumPy inside, no implicit way out."""

    __slots__ = ("_a",)
    __hash__ = None

    def __init__(self, a: np.ndarray):
        self._a = a

    # --- what CuPy refuses --------------------------------------------------------------------
    def __array__(self, *args, **kwargs):
        _refuse("__array__ (np.asarray / np.array of a device array; use .get() or asnumpy)")

    def __array_function__(self, func, types, args, kwargs):
        _refuse(f"numpy.{func.__name__} given a device array (use xp = array_module(x))")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            _refuse(f"numpy.{ufunc.__name__}.{method} given a device array")
        kwargs = {k: _dev(v) for k, v in kwargs.items()}
        return _wrap(ufunc(*_dev(inputs), **kwargs))

    # --- explicit transfers (CuPy's) ----------------------------------------------------------
    def get(self) -> np.ndarray:
        crossings.add("d2h", self._a.nbytes)
        return self._a.copy()

    def set(self, host) -> None:
        if not isinstance(host, np.ndarray) or host.shape != self._a.shape:
            raise ValueError(f"set: expected a numpy.ndarray of shape {self._a.shape}")
        crossings.add("h2d", host.nbytes)
        np.copyto(self._a, host)

    def tolist(self):
        crossings.add("d2h", self._a.nbytes)
        return self._a.tolist()

    def item(self):
        crossings.add("scalar")
        return self._a.item()

    def __float__(self):
        crossings.add("scalar")
        return float(self._a)

    def __int__(self):
        crossings.add("scalar")
        return int(self._a)

    def __bool__(self):
        crossings.add("scalar")
        return bool(self._a)

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "version": 3,
                "strides": None if a.flags.c_contiguous else a.strides,
                "data": (a.ctypes.data, False)}

    # --- metadata and methods -----------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: DeviceArray(self._a.T))

    def view(self, dtype=None):
        if isinstance(dtype, type) and issubclass(dtype, np.ndarray):
            _refuse("view as a numpy.ndarray")
        return DeviceArray(self._a.view() if dtype is None else self._a.view(dtype))

    def __getattr__(self, name):
        if name in ("tobytes", "tofile", "dump", "dumps", "ctypes", "__array_interface__",
                    "__array_struct__"):
            _refuse(f".{name}")
        attr = getattr(self._a, name)
        if callable(attr):
            return lambda *a, **k: _wrap(attr(*_dev(a), **_dev(k)))
        return _wrap(attr)

    def __getitem__(self, key):
        return _wrap(self._a[_dev(key)])

    def __setitem__(self, key, value):
        self._a[_dev(key)] = _dev(value)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(r) for r in self._a)

    def __repr__(self):
        return f"DeviceArray({self._a!r})"

    __add__, __radd__, __iadd__ = _binop(np.add), _binop(np.add, True), _inplace(np.add)
    __sub__, __rsub__, __isub__ = _binop(np.subtract), _binop(np.subtract, True), _inplace(np.subtract)
    __mul__, __rmul__, __imul__ = _binop(np.multiply), _binop(np.multiply, True), _inplace(np.multiply)
    __truediv__, __rtruediv__ = _binop(np.true_divide), _binop(np.true_divide, True)
    __itruediv__ = _inplace(np.true_divide)
    __floordiv__, __rfloordiv__ = _binop(np.floor_divide), _binop(np.floor_divide, True)
    __ifloordiv__ = _inplace(np.floor_divide)
    __mod__, __rmod__, __imod__ = _binop(np.mod), _binop(np.mod, True), _inplace(np.mod)
    __pow__, __rpow__, __ipow__ = _binop(np.power), _binop(np.power, True), _inplace(np.power)
    __matmul__, __rmatmul__ = _binop(np.matmul), _binop(np.matmul, True)
    __and__, __rand__ = _binop(np.bitwise_and), _binop(np.bitwise_and, True)
    __iand__ = _inplace(np.bitwise_and)
    __or__, __ror__, __ior__ = _binop(np.bitwise_or), _binop(np.bitwise_or, True), _inplace(np.bitwise_or)
    __xor__, __rxor__ = _binop(np.bitwise_xor), _binop(np.bitwise_xor, True)
    __lshift__, __rshift__ = _binop(np.left_shift), _binop(np.right_shift)
    __eq__, __ne__ = _binop(np.equal), _binop(np.not_equal)
    __lt__, __le__ = _binop(np.less), _binop(np.less_equal)
    __gt__, __ge__ = _binop(np.greater), _binop(np.greater_equal)
    __neg__, __pos__ = _unary(np.negative), _unary(np.positive)
    __abs__, __invert__ = _unary(np.absolute), _unary(np.invert)


# --- the module: NumPy's functions over device arrays -------------------------------------------

def asarray(a, dtype=None, order=None):
    """cupy.asarray: a device array as it is, host data copied to the device (h2d)."""
    if isinstance(a, DeviceArray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    host = np.array(a, dtype=dtype, order=order or "K")
    crossings.add("h2d", host.nbytes)
    return DeviceArray(host)


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, DeviceArray):
        return DeviceArray(np.array(a._a, dtype=dtype, copy=copy, order=order))
    return asarray(a, dtype, order)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, DeviceArray):
        return asarray(np.ascontiguousarray(a, dtype))
    return DeviceArray(np.ascontiguousarray(a._a, dtype))


def asnumpy(a) -> np.ndarray:
    """cupy.asnumpy: device -> host (d2h); host arrays pass."""
    return a.get() if isinstance(a, DeviceArray) else np.asarray(a)


def scatter_add(a, idx, values) -> None:
    """cupyx.scatter_add: a[idx[i]] += values[i], repeated indices accumulating."""
    np.add.at(a._a, _dev(idx), _dev(values))


class _Stream:
    def synchronize(self) -> None:
        crossings.add("sync")


cuda = types.SimpleNamespace(get_current_stream=lambda: _Stream())
ndarray = DeviceArray


def _function(fn):
    def call(*args, **kwargs):
        return _wrap(fn(*_dev(args), **_dev(kwargs)))
    call.__name__ = getattr(fn, "__name__", "function")
    return call


class _Namespace(types.ModuleType):
    """NumPy's attributes: functions over device arrays; dtypes and constants as they are."""

    def __init__(self, name, base):
        super().__init__(name)
        self._base = base

    def __getattr__(self, name):
        attr = getattr(self._base, name)
        if isinstance(attr, types.ModuleType):
            return _Namespace(f"{self.__name__}.{name}", attr)
        if isinstance(attr, type) or not callable(attr):
            return attr  # dtypes (np.float64), constants (np.pi, np.newaxis)
        return _function(attr)


class _Strict(_Namespace):
    pass


_mod = sys.modules[__name__]
_this = _Strict(__name__, np)
_this.__dict__.update({k: v for k, v in vars(_mod).items() if not k.startswith("__")})
_this.__doc__, _this.__file__ = __doc__, __file__
sys.modules[__name__] = _this
